"""The isolation canary in a live gateway: simulated replicas over loopback, one of them
behind a tap that drops `cache_salt` (a leaky proxy), and its configuration."""

from __future__ import annotations

import re
from pathlib import Path

import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, ledger_rows, long_prompt, run, stack
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.config import CanaryConfig, ConfigError, load_config
from saltgate.gateway import canary as canary_module
from saltgate.routing import Outcome, Verdict
from saltgate.sim.run import SimConfig

FAILURES = "saltgate_isolation_canary_failures_total"
RESULT = "saltgate_isolation_canary_result"


def drop_salt(body: bytes) -> bytes:
    """What a proxy that loses `cache_salt` forwards (probes' empty bodies untouched)."""
    if not body:
        return body
    doc = orjson.loads(body)
    doc.pop("cache_salt", None)
    return orjson.dumps(doc)


def sample(page: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` with (at least) these labels, or None."""
    for line in page.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line[: line.rfind("}")]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def label(s: Stack, i: int) -> str:
    return f"http://127.0.0.1:{s.taps[i].port}"


async def fleet_canary(s: Stack) -> dict[str, str | None]:
    """Each replica's canary state as the console's fleet page shows it (signed in with
    the scraper's usage:read token, which may read the fleet)."""
    admin = f"http://127.0.0.1:{s.gateway.admin_port}"
    token = s.metrics_headers["authorization"].removeprefix("Bearer ")
    async with async_client(base_url=admin, timeout=30) as c:
        signed = await c.post("/console/sign-in", data={"token": token}, headers={"origin": admin})
        assert signed.status_code == 303, signed.text
        page = await c.get("/console/fleet.json")
        assert page.status_code == 200, page.text
        return {r["replica"]: r["canary"] for r in page.json()["replicas"]}


async def send(s: Stack, tenant: str, n: int) -> None:
    async with s.client(tenant) as client:
        for i in range(n):
            body = {"model": MODEL, "prompt": long_prompt(f"{tenant}{i}-", 40), "max_tokens": 2}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text


def test_the_canary_passes_on_salted_replicas_which_stay_in_and_nobody_is_billed(
    tmp_path: Path,
) -> None:
    """On by default: its first round ran at start, on each replica three requests of one
    fresh prompt under two namespaces that are nobody's salt; both pass, both take traffic."""

    async def main() -> None:
        async with stack(tmp_path) as s:
            tenant_salts = {s.salt("alice"), s.salt("bob")}
            for tap in s.taps:
                assert [r.path for r in tap.canary] == [b"/v1/completions"] * 3
                first, other, repeat = (orjson.loads(r.body) for r in tap.canary)
                assert first["prompt"] == other["prompt"] == repeat["prompt"]
                assert first["cache_salt"] == repeat["cache_salt"] != other["cache_salt"]
                assert {first["cache_salt"], other["cache_salt"]}.isdisjoint(tenant_salts)
                assert first["max_tokens"] == 1 and first["model"] == MODEL
            page = await s.scrape()
            for i in (0, 1):
                assert sample(page, RESULT, replica=label(s, i), result="pass") == 1.0
                assert sample(page, RESULT, replica=label(s, i), result="failure") == 0.0
                assert sample(page, FAILURES, replica=label(s, i)) == 0.0
                assert sample(page, "saltgate_replica_healthy", replica=label(s, i)) == 1.0
            # Not through the request path: no request counted, no ledger row.
            assert s.forwarded() == []
            assert "saltgate_requests_total{" not in page
            assert ledger_rows(s) == []
            # The canary's prompt and salts are in no metric label.
            prompt = orjson.loads(s.taps[0].canary[0].body)["prompt"]
            assert prompt.split()[0] not in page
            await send(s, "alice", 6)
            assert all(tap.seen for tap in s.taps)  # both replicas take tenant traffic
            assert len(ledger_rows(s)) == 6  # tenants' requests only

    run(main)


async def leaky_replica_is_caught(tmp_path: Path, timeout_s: float = 10.0) -> None:
    """Replica 0's proxy starts dropping `cache_salt`: the next canary round takes it out
    at once, counts and shows it, and every request goes to replica 1; once the proxy
    keeps the salt again, a passing round brings it back."""
    async with stack(tmp_path, canary=CanaryConfig(interval_s=0.05)) as s:
        canary = s.gateway.gateway.canary
        assert canary is not None
        s.taps[0].request = drop_salt
        leaky = label(s, 0)

        async def out() -> bool:
            return sample(await s.scrape(), "saltgate_replica_healthy", replica=leaky) == 0.0

        await eventually(
            out, timeout_s=timeout_s, what="the leaky replica taken out by the periodic canary"
        )
        page = await s.scrape()
        failures = sample(page, FAILURES, replica=leaky)
        assert failures is not None and failures >= 1
        assert sample(page, RESULT, replica=leaky, result="failure") == 1.0
        assert sample(page, FAILURES, replica=label(s, 1)) == 0.0
        assert sample(page, "saltgate_replica_healthy", replica=label(s, 1)) == 1.0
        assert await fleet_canary(s) == {leaky: "failure", label(s, 1): "pass"}
        assert "cache_salt" in orjson.loads(s.taps[0].canary[-1].body)  # the proxy drops it
        await send(s, "alice", 8)
        await send(s, "bob", 8)
        assert [r for r in s.taps[0].seen if r.method == b"POST"] == []
        assert len([r for r in s.taps[1].seen if r.method == b"POST"]) == 16
        s.taps[0].request = None  # the proxy fixed: the next pass brings it back

        async def back() -> bool:
            return sample(await s.scrape(), "saltgate_replica_healthy", replica=leaky) == 1.0

        await eventually(back, what="the fixed replica back after a passing canary")
        assert sample(await s.scrape(), RESULT, replica=leaky, result="pass") == 1.0
        assert await fleet_canary(s) == {leaky: "pass", label(s, 1): "pass"}


def test_a_replica_behind_a_proxy_that_drops_cache_salt_is_taken_out_at_once(
    tmp_path: Path,
) -> None:
    run(lambda: leaky_replica_is_caught(tmp_path))


def test_positive_control_without_the_canarys_verdict_the_leak_goes_unseen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The canary's check switched off (every run judged a pass): the leaky replica stays
    in rotation, so the test above fails; it is the verdict that catches the leak."""
    monkeypatch.setattr(
        canary_module, "judge", lambda *cached: Outcome(Verdict.PASSED, "switched off")
    )
    with pytest.raises(AssertionError, match="taken out by the periodic canary"):
        run(lambda: leaky_replica_is_caught(tmp_path, timeout_s=2.0))


@pytest.mark.parametrize(
    ("sim", "why"),
    [
        (SimConfig(port=0, enable_prompt_tokens_details=False), "no cached-token count"),
        (SimConfig(port=0, enable_prefix_caching=False), "positive control"),
    ],
    ids=["no-cached-token-details", "no-prefix-caching"],
)
def test_an_inconclusive_canary_is_shown_and_keeps_the_replica_in(
    tmp_path: Path, sim: SimConfig, why: str
) -> None:
    """A replica that does not report cached tokens, or caches nothing: the canary shows
    nothing either way (even behind the leaky proxy), says so, and takes nothing out."""

    async def main() -> None:
        async with stack(tmp_path, sim=sim) as s:
            canary = s.gateway.gateway.canary
            assert canary is not None
            s.taps[0].request = drop_salt
            await canary.run_all()
            page = await s.scrape()
            for i in (0, 1):
                assert sample(page, RESULT, replica=label(s, i), result="inconclusive") == 1.0
                assert sample(page, FAILURES, replica=label(s, i)) == 0.0
                assert sample(page, "saltgate_replica_healthy", replica=label(s, i)) == 1.0
            assert all(why in o.reason for o in canary.last.values())
            assert set((await fleet_canary(s)).values()) == {"inconclusive"}
            await send(s, "alice", 6)
            assert all(tap.seen for tap in s.taps)

    run(main)


def test_the_canary_can_be_switched_off(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, canary=CanaryConfig(enabled=False)) as s:
            assert s.gateway.gateway.canary is None
            assert all(tap.canary == [] for tap in s.taps)
            page = await s.scrape()
            assert RESULT not in page and FAILURES not in page
            assert set((await fleet_canary(s)).values()) == {None}  # shown "not run"

    run(main)


GOOD = '[[replicas]]\nurl = "http://127.0.0.1:8100"\n'


@pytest.mark.unit
def test_the_canary_section_is_read_and_on_by_default(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text(GOOD)
    assert load_config(path).canary == CanaryConfig(enabled=True, interval_s=60.0, timeout_s=30.0)
    path.write_text(GOOD + "[canary]\nenabled = false\ninterval_s = 300\ntimeout_s = 5\n")
    assert load_config(path).canary == CanaryConfig(False, 300.0, 5.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[canary]\nenabled = 1\n", "canary.enabled: expected bool"),
        ("[canary]\ninterval_s = 0\n", "canary.interval_s"),
        ("[canary]\ninterval_s = nan\n", "canary.interval_s"),
        ('[canary]\ninterval_s = "60"\n', "canary.interval_s"),
        ("[canary]\ntimeout_s = 0\n", "canary.timeout_s"),
        ("[canary]\nevery = 60\n", "canary: unknown keys ['every']"),
        ("canary = true\n", "canary: expected a table"),
    ],
)
def test_bad_canary_settings_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "g.toml"
    path.write_text(text + GOOD if text.startswith("canary =") else GOOD + text)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(path)
