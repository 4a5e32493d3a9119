"""The console's sign-in sessions, cross-origin refusal and response headers.

A session is opaque: the browser holds 32 random bytes in an HttpOnly, SameSite=Strict
cookie, the server a record found by the cookie's SHA-256 (a memory dump of the table
holds no cookie). The record keeps the admin token the operator signed in with, on the
server only, so every page is the admin API called with that token: its scopes, its
tenant pinning and its audit trail apply unchanged, and revoking the token ends every
session made with it at the next page. Sign-out deletes the record; a session also ends
after SESSION_IDLE_S without a request and SESSION_MAX_S after sign-in.

Cross-site request forgery: a state-changing request (any method but GET and HEAD) is
refused unless the browser says it came from this origin (``Sec-Fetch-Site``
same-origin or none, else an ``Origin`` equal to this listener's), as Go 1.25's
CrossOriginProtection does. With SameSite=Strict that is two independent defences.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from saltgate.http import Request
from saltgate.store.tenants import ADMIN_TOKEN_PREFIX

COOKIE: Final = "saltgate_console"
COOKIE_PATH: Final = "/console/"
SESSION_IDLE_S: Final = 30 * 60.0
SESSION_MAX_S: Final = 8 * 3600.0
MAX_SESSIONS: Final = 1000  # the oldest goes first beyond this: memory stays bounded
# Failed sign-ins: per token prefix, and over all (a spread-out guesser); SignInLimiter.
SIGN_IN_PER_KEY: Final = 5
SIGN_IN_ALL: Final = 60
PREFIX_CHARS: Final = 8
SIGN_IN_WINDOW_S: Final = 60.0

CSP: Final = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
SAFE_METHODS: Final = (b"GET", b"HEAD")


def security_headers() -> list[tuple[bytes, bytes]]:
    """Sent with every console response; no Access-Control-* header ever is."""
    return [
        (b"content-security-policy", CSP),
        (b"x-content-type-options", b"nosniff"),
        (b"x-frame-options", b"DENY"),
        (b"referrer-policy", b"same-origin"),
        (b"cross-origin-opener-policy", b"same-origin"),
        (b"cross-origin-resource-policy", b"same-origin"),
        (b"cache-control", b"no-store"),
    ]


def same_origin(request: Request, *, tls: bool) -> bool:
    """Whether an unsafe request came from a page of this origin (see the module doc)."""
    site = request.header(b"sec-fetch-site")
    if site is not None:
        return site in (b"same-origin", b"none")
    origin = request.header(b"origin")
    host = request.header(b"host")
    if origin is None or host is None:
        return False  # a browser sends Origin with every POST; a missing one is refused
    own = (b"https://" if tls else b"http://") + host
    return hmac.compare_digest(origin, own)


def cookie_value(request: Request) -> str | None:
    """The session cookie's value, if the request has one."""
    for name, value in request.headers:
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _, val = part.strip().partition("=")
            if key == COOKIE and val:
                return val
    return None


def set_cookie(value: str, *, tls: bool) -> bytes:
    secure = "; Secure" if tls else ""
    return (
        f"{COOKIE}={value}; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict{secure}; "
        f"Max-Age={int(SESSION_MAX_S)}"
    ).encode()


def clear_cookie(*, tls: bool) -> bytes:
    secure = "; Secure" if tls else ""
    return f"{COOKIE}=; Path={COOKIE_PATH}; HttpOnly; SameSite=Strict{secure}; Max-Age=0".encode()


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("ascii", "replace")).digest()


@dataclass(slots=True)
class Session:
    """A signed-in browser: the admin token it acts with (server side only) and who it is."""

    token: str = field(repr=False)
    token_id: str
    scopes: frozenset[str]
    tenant_id: str | None
    started: float
    seen: float


class Sessions:
    """Live sessions by the SHA-256 of their cookie; `clock` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._live: OrderedDict[bytes, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def start(
        self, token: str, token_id: str, scopes: frozenset[str], tenant_id: str | None
    ) -> str:
        """A new session; returns the cookie value (shown to the browser only)."""
        value = secrets.token_urlsafe(32)
        now = self.clock()
        self._live[_digest(value)] = Session(token, token_id, scopes, tenant_id, now, now)
        while len(self._live) > MAX_SESSIONS:
            self._live.popitem(last=False)
        return value

    def find(self, value: str | None) -> Session | None:
        """The live session of a cookie value; an expired one is dropped and not found."""
        if value is None:
            return None
        key = _digest(value)
        session = self._live.get(key)
        if session is None:
            return None
        now = self.clock()
        if now - session.seen > SESSION_IDLE_S or now - session.started > SESSION_MAX_S:
            del self._live[key]
            return None
        session.seen = now
        return session

    def end_token(self, token: str) -> None:
        """Every session signed in with `token` (the API no longer accepts it)."""
        for key in [k for k, s in self._live.items() if hmac.compare_digest(s.token, token)]:
            del self._live[key]

    def end(self, value: str | None) -> None:
        """Sign-out: the session is gone from the server, whatever the browser keeps."""
        if value is not None:
            self._live.pop(_digest(value), None)


class SignInLimiter:
    """Sliding-window counts of failed sign-ins: per token prefix, and in all.

    Only failures count, so signing in (and out, and in again) never uses up anything.
    The key is not the client's address: behind the SSH tunnel docs/console.md
    recommends, every operator is 127.0.0.1, and one mistyping (or hostile) client would
    block them all. It is the presented token's first PREFIX_CHARS characters after
    ``sgadm_``: an operator retyping their own token spends their own budget, and a
    client failing with other tokens does not touch it (it would have to know the
    token's first 48 random bits). A guesser changing prefixes meets the budget over
    all failures, SIGN_IN_ALL a minute; admin tokens hold 256 random bits, so the limits
    bound the store reads an unauthenticated client causes, not the odds of a guess.
    Spending that budget blocks sign-in for everyone for up to a minute: the price of
    bounding a spread-out guesser; sessions already signed in, the API and the CLI are
    unaffected, and each failure is in the admin access log with its peer.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._all: deque[float] = deque()
        self._per: dict[str, deque[float]] = {}

    def allow(self, token: str) -> bool:
        """Whether a sign-in with `token` may be checked now (counts nothing)."""
        start = self.clock() - SIGN_IN_WINDOW_S
        while self._all and self._all[0] <= start:
            self._all.popleft()
        mine = self._per.get(key_of(token))
        while mine and mine[0] <= start:
            mine.popleft()
        return len(self._all) < SIGN_IN_ALL and len(mine or ()) < SIGN_IN_PER_KEY

    def failed(self, token: str) -> None:
        """Count a refused sign-in with `token`."""
        now = self.clock()
        if len(self._per) > MAX_SESSIONS:  # many prefixes: forget those with no recent try
            start = now - SIGN_IN_WINDOW_S
            self._per = {k: w for k, w in self._per.items() if w and w[-1] > start}
        self._per.setdefault(key_of(token), deque()).append(now)
        self._all.append(now)


def key_of(token: str) -> str:
    """The limiter's key for a presented token: its first characters after the prefix."""
    return token.removeprefix(ADMIN_TOKEN_PREFIX)[:PREFIX_CHARS]
