"""The console's session table, origin check and sign-in limiter, without a browser."""

from __future__ import annotations

import pytest

from saltgate.console.security import (
    MAX_SESSIONS,
    SESSION_IDLE_S,
    SESSION_MAX_S,
    SIGN_IN_ALL,
    SIGN_IN_PER_KEY,
    SIGN_IN_WINDOW_S,
    Sessions,
    SignInLimiter,
    cookie_value,
    same_origin,
)
from saltgate.http import Request

pytestmark = pytest.mark.unit


def request(*headers: tuple[bytes, bytes]) -> Request:
    return Request(b"POST", b"/console/tenants", b"", [(b"host", b"127.0.0.1:9001"), *headers], b"")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_same_origin_by_fetch_metadata_then_origin() -> None:
    assert same_origin(request((b"sec-fetch-site", b"same-origin")), tls=False)
    assert same_origin(request((b"sec-fetch-site", b"none")), tls=False)
    assert not same_origin(request((b"sec-fetch-site", b"cross-site")), tls=False)
    assert not same_origin(request((b"sec-fetch-site", b"same-site")), tls=False)
    assert same_origin(request((b"origin", b"http://127.0.0.1:9001")), tls=False)
    assert not same_origin(request((b"origin", b"http://127.0.0.1:9001")), tls=True)
    assert not same_origin(request((b"origin", b"http://localhost:9001")), tls=False)
    assert not same_origin(request((b"origin", b"null")), tls=False)
    assert not same_origin(request(), tls=False)  # neither header: refused


def test_sessions_expire_idle_and_absolute_and_end_at_sign_out() -> None:
    clock = Clock()
    sessions = Sessions(clock)
    value = sessions.start("sgadm_token", "adm_1", frozenset({"tenants:read"}), None)
    assert "sgadm_token" not in value
    found = sessions.find(value)
    assert found is not None and found.token_id == "adm_1"
    clock.now += SESSION_IDLE_S - 1
    assert sessions.find(value) is not None  # a request keeps it alive
    clock.now += SESSION_IDLE_S + 1
    assert sessions.find(value) is None
    assert sessions.find(value) is None and len(sessions) == 0

    value = sessions.start("sgadm_token", "adm_1", frozenset(), None)
    for _ in range(int(SESSION_MAX_S // (SESSION_IDLE_S / 2)) + 1):
        clock.now += SESSION_IDLE_S / 2
        sessions.find(value)
    assert sessions.find(value) is None  # past its absolute lifetime, however busy

    value = sessions.start("sgadm_token", "adm_1", frozenset(), None)
    sessions.end(value)
    assert sessions.find(value) is None
    assert sessions.find("made-up") is None


def test_a_refused_token_ends_all_its_sessions_and_the_table_is_bounded() -> None:
    sessions = Sessions(Clock())
    mine = [sessions.start("sgadm_a", "adm_a", frozenset(), None) for _ in range(3)]
    other = sessions.start("sgadm_b", "adm_b", frozenset(), None)
    sessions.end_token("sgadm_a")
    assert [sessions.find(v) for v in mine] == [None, None, None]
    assert sessions.find(other) is not None
    first = sessions.start("sgadm_c", "adm_c", frozenset(), None)
    for _ in range(MAX_SESSIONS):
        sessions.start("sgadm_c", "adm_c", frozenset(), None)
    assert len(sessions) == MAX_SESSIONS
    assert sessions.find(first) is None


def test_only_failed_sign_ins_count_per_token_prefix_within_the_window() -> None:
    clock = Clock()
    limiter = SignInLimiter(clock)
    mine, other = "sgadm_AAAAAAAA" + "x" * 40, "sgadm_BBBBBBBB" + "y" * 40
    for _ in range(3 * SIGN_IN_PER_KEY):
        assert limiter.allow(mine)  # successes are never counted: only failed() counts
    for _ in range(SIGN_IN_PER_KEY):
        assert limiter.allow(other)
        limiter.failed(other)
    assert not limiter.allow(other)
    assert not limiter.allow("sgadm_BBBBBBBB" + "z" * 40)  # the same prefix: the same count
    assert limiter.allow(mine)  # another prefix (the other operator, same address) is free
    clock.now += SIGN_IN_WINDOW_S
    assert limiter.allow(other)


def test_failures_over_all_prefixes_meet_one_budget() -> None:
    limiter = SignInLimiter(Clock())
    for i in range(SIGN_IN_ALL):
        token = f"sgadm_{i:08d}"
        assert limiter.allow(token)
        limiter.failed(token)
    assert not limiter.allow("sgadm_never-tried")


def test_cookie_value_reads_only_the_console_cookie() -> None:
    req = Request(b"GET", b"/", b"", [(b"cookie", b"a=1; saltgate_console=xyz; b=2")], b"")
    assert cookie_value(req) == "xyz"
    assert cookie_value(Request(b"GET", b"/", b"", [(b"cookie", b"a=1")], b"")) is None
