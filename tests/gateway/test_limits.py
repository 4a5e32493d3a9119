"""Limits enforced by the real gateway over loopback (docs/limits.md): 429s in each API's
shape with an exact Retry-After, rate-limit headers on every answer, a spent budget that
tells the SDKs not to retry, and reservations returned whichever way a request ends."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from tests.gateway.stack import MODEL, Stack, new_state_dir, run, stack
from tests.support.gateways import (
    GatewayProcess,
    cli,
    per_worker,
    series,
    write_gateway_config,
)
from tests.support.http import async_client
from tests.support.waiting import eventually

from saltgate.governance.limits import Limits
from saltgate.serving.run import start_gateway
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.tenants import TenantStore


async def limit(s: Stack, tenant: str, limits: Limits | None) -> None:
    """Set the tenant's limits as the CLI does, and wait until the gateway has them."""
    with TenantStore.from_state_dir(s.state_dir) as store:
        store.set_limits(tenant, limits)
    keys = s.gateway.gateway.keys

    def arrived() -> bool:
        principal = keys.authenticate(s.keys[tenant])
        return principal is not None and principal.limits == limits

    await eventually(arrived, what="the limits reach the gateway")


CONTEXT = 256  # the replica's max_model_len where a test clamps the output with it
LONG_PROMPT = "hello there " * 90


def completion(max_tokens: int = 2, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello there", "max_tokens": max_tokens, **extra}


def test_rpm_429_openai_shape_with_exact_retry_and_headers(tmp_path: Any) -> None:
    async def main() -> None:
        async with stack(tmp_path) as s, s.client("alice") as c, s.client("bob") as b:
            await limit(s, "alice", Limits(rpm=2))
            remaining = []
            for _ in range(2):
                resp = await c.post("/v1/completions", json=completion())
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-ratelimit-limit-requests"] == "2"
                remaining.append(resp.headers["x-ratelimit-remaining-requests"])
                assert re.fullmatch(
                    r"(1m0s|\d+(\.\d+)?s)", resp.headers["x-ratelimit-reset-requests"]
                )
            assert remaining == ["1", "0"]  # counts the reservation at once
            refused = await c.post("/v1/completions", json=completion())
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
            assert re.fullmatch(
                rf"Rate limit reached for {MODEL} on requests per min \(RPM\) of this tenant: "
                r"Limit 2, Used 2, Requested 1\. Please try again in \d+(\.\d+)?s\.",
                error["message"],
            ), error["message"]
            wait_ms = int(refused.headers["retry-after-ms"])
            assert 55_000 < wait_ms <= 60_000
            assert int(refused.headers["retry-after"]) == -(-wait_ms // 1000)
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            # Another tenant without limits: served, and no rate-limit headers at all.
            other = await b.post("/v1/completions", json=completion())
            assert other.status_code == 200 and "x-ratelimit-limit-requests" not in other.headers
            # A request larger than a limit can never fit: no retry; a limit of 0 neither.
            await limit(s, "alice", Limits(output_tpm=100, concurrency=0))
            too_large = await c.post("/v1/completions", json=completion(101))
            assert too_large.status_code == 429 and "retry-after" not in too_large.headers
            assert too_large.headers["x-should-retry"] == "false"
            assert too_large.json()["error"]["message"].startswith(
                f"Request too large for {MODEL} on output tokens per min (TPM) of this tenant: "
                "Limit 100, Requested 101."
            )
            nothing = await c.post("/v1/completions", json=completion(1))
            assert nothing.status_code == 429 and "retry-after" not in nothing.headers
            assert "Limit 0, Requested 1. This limit admits nothing" in nothing.text
            # Limits cleared: served again at once.
            await limit(s, "alice", None)
            assert (await c.post("/v1/completions", json=completion())).status_code == 200

    run(main)


def test_anthropic_messages_429_and_headers(tmp_path: Any) -> None:
    async def main() -> None:
        async with stack(tmp_path) as s, s.client("alice") as c:
            await limit(s, "alice", Limits(rpm=1, output_tpm=1000))
            body = {
                "model": MODEL,
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
            }
            ok = await c.post("/v1/messages", json=body)
            assert ok.status_code == 200, ok.text
            assert ok.headers["anthropic-ratelimit-requests-limit"] == "1"
            assert ok.headers["anthropic-ratelimit-requests-remaining"] == "0"
            assert ok.headers["anthropic-ratelimit-output-tokens-remaining"] == "990"
            reset = datetime.fromisoformat(ok.headers["anthropic-ratelimit-requests-reset"])
            assert reset.tzinfo is not None
            refused = await c.post("/v1/messages", json=body)
            assert refused.status_code == 429
            doc = refused.json()
            assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
            assert "Limit 1, Used 1, Requested 1" in doc["error"]["message"]
            wait_ms = int(refused.headers["retry-after-ms"])  # the minute from the first
            assert 55_000 < wait_ms <= 60_000
            assert int(refused.headers["retry-after"]) == -(-wait_ms // 1000)

    run(main)


def test_spent_budget_is_insufficient_quota_without_retry(tmp_path: Any) -> None:
    async def main() -> None:
        async with stack(tmp_path) as s, s.client("alice") as c:
            # A dollar per million input tokens, two per million output (stack's prices):
            # one request reserves a few thousand micro-dollars, the budget is 1.
            await limit(s, "alice", Limits(budget_micro_usd=1, budget_period_s=86400))
            assert (await c.post("/v1/completions", json=completion())).status_code == 200
            refused = await c.post("/v1/completions", json=completion())
            assert refused.status_code == 429
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
            assert refused.headers["x-should-retry"] == "false"
            assert "retry-after" not in refused.headers
            # Counted for the operator, by tenant id and limit (issue 43: refusals had no
            # tenant label); the tenant's name never is one.
            tenant = s.gateway.gateway.keys.authenticate(s.keys["alice"])
            assert tenant is not None
            text = await s.scrape()
            labels = f'tenant="{tenant.tenant_id}",limit="budget",scope="tenant"'
            assert f"saltgate_limit_refusals_total{{{labels}}} 1.0" in text, text
            assert "alice" not in text

    run(main)


def test_a_budget_set_after_spend_counts_it(tmp_path: Any) -> None:
    """The budget's period holds what the ledger recorded before it was set (issue 42:
    after 100x its budget a tenant still got requests through)."""

    async def main() -> None:
        async with stack(tmp_path) as s, s.client("alice") as c:
            for _ in range(3):  # spend, with no budget yet
                assert (await c.post("/v1/completions", json=completion())).status_code == 200
            await limit(s, "alice", Limits(budget_micro_usd=1, budget_period_s=86400))
            refused = await c.post("/v1/completions", json=completion())
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "insufficient_quota"
            # The control: bob spent nothing, so the same budget admits him.
            await limit(s, "bob", Limits(budget_micro_usd=1, budget_period_s=86400))
            async with s.client("bob") as b:
                assert (await b.post("/v1/completions", json=completion())).status_code == 200

    run(main)


def test_a_restarted_gateway_keeps_counting_the_period(tmp_path: Any) -> None:
    """A gateway started after the spend (a restart, or a second one without [cluster])
    refuses a budget the first used up (it forgot, and admitted, before)."""

    async def main() -> None:
        async with stack(tmp_path) as s, s.client("alice") as c:
            spent = Limits(budget_micro_usd=1, budget_period_s=86400)
            await limit(s, "alice", spent)
            assert (await c.post("/v1/completions", json=completion())).status_code == 200
            assert (await c.post("/v1/completions", json=completion())).status_code == 429
            again = await start_gateway(s.gateway.gateway.config)
            try:
                async with async_client(base_url=again.url, timeout=30) as fresh:
                    headers = {"authorization": f"Bearer {s.keys['alice']}"}
                    resp = await fresh.post("/v1/completions", json=completion(), headers=headers)
                    assert resp.status_code == 429, resp.text
                    # A budget raised above the spend admits again at once.
                    await limit(s, "alice", Limits(budget_micro_usd=10**9, budget_period_s=1))
                    await eventually(
                        lambda: (
                            again.gateway.keys.authenticate(s.keys["alice"]) is not None
                            and again.gateway.keys.authenticate(s.keys["alice"]).limits  # type: ignore[union-attr]
                            == Limits(budget_micro_usd=10**9, budget_period_s=1)
                        ),
                        what="the second gateway has the new limits",
                    )
                    resp = await fresh.post("/v1/completions", json=completion(), headers=headers)
                    assert resp.status_code == 200, resp.text
            finally:
                await again.close()

    run(main)


def test_reservations_return_when_requests_end(tmp_path: Any) -> None:
    """A request reserving 100 output tokens that uses fewer (the replica's context
    clamps its output) gives the rest back, exactly; a stream whose client leaves, and
    one that fails, free their concurrency lease."""

    async def main() -> None:
        sim = SimConfig(port=0, decode_ms_per_token=20.0, max_model_len=CONTEXT)
        async with stack(tmp_path, replicas=1, sim=sim) as s, s.client("alice") as c:
            await limit(s, "alice", Limits(output_tpm=150, concurrency=1))
            # A prompt of about 180 tokens leaves room for about 76 of the 100 reserved.
            first = await c.post("/v1/completions", json=completion(100, prompt=LONG_PROMPT))
            assert first.status_code == 200, first.text
            usage = first.json()["usage"]
            used = usage["completion_tokens"]
            assert usage["prompt_tokens"] + used == CONTEXT and used < 100, usage
            # Counted as `used`: one token more than the rest of the limit is refused,
            # the rest exactly is admitted (with nothing returned, 100 + it > 150).
            over = await c.post("/v1/completions", json=completion(150 - used + 1))
            assert over.status_code == 429, over.text
            assert "output tokens per min" in over.json()["error"]["message"], over.text
            rest = await c.post("/v1/completions", json=completion(150 - used))
            assert rest.status_code == 200, rest.text

            await limit(s, "alice", Limits(concurrency=1))
            stream = completion(200, stream=True)
            async with c.stream("POST", "/v1/completions", json=stream) as resp:
                assert resp.status_code == 200
                async for _ in resp.aiter_bytes():
                    break  # the client leaves mid-stream
                busy = await c.post("/v1/completions", json=completion())
                assert busy.status_code == 429
                assert "concurrent requests" in busy.json()["error"]["message"]

            async def admitted() -> bool:
                return (await c.post("/v1/completions", json=completion())).status_code == 200

            await eventually(admitted, what="the abandoned stream's lease freed")

            # The replica fails (the tap before it answers 500): each failure frees its
            # lease, or the second would be a 429.
            await s.sims[0].close()
            for _ in range(2):
                resp = await c.post("/v1/completions", json=completion())
                assert resp.status_code == 500, resp.text

    run(main)


def test_processes_without_a_shared_engine_each_enforce_an_explicit_share(
    tmp_path: Any, caplog: Any
) -> None:
    """Two gateways ([limits] share = 2), each with 2 workers: each process enforces
    rpm 8 / 4 = 2, says so in its log and in a metric, never 4 x 8 in total."""

    async def main() -> None:
        async with stack(tmp_path, workers=2, limits_share=2) as s, s.client("alice") as c:
            await limit(s, "alice", Limits(rpm=8))
            statuses = [
                (await c.post("/v1/completions", json=completion())).status_code for _ in range(3)
            ]
            assert statuses == [200, 200, 429]
            refused = await c.post("/v1/completions", json=completion())
            assert "Limit 2, Used 2" in refused.json()["error"]["message"]
            assert refused.headers["x-ratelimit-limit-requests"] == "2"
            metrics = await s.scrape()
            assert "saltgate_limits_share 4.0" in metrics

    run(main)
    assert "each enforces 1/4 of every tenant's and key's limit" in caplog.text


WORKERS = 2
ROUND = 6  # connections held open at once: least-connections spreads them over both workers


async def _connections_on_both_workers(
    gateway: GatewayProcess, headers: dict[str, str]
) -> list[httpx.AsyncClient]:
    """ROUND clients, each holding one open connection, and both workers holding some:
    each client's first request (unlimited: the model list) is counted by the worker that
    accepted its connection, which answers every later request on it."""
    for _ in range(5):
        clients = [
            async_client(base_url=gateway.url, headers=headers, timeout=30) for _ in range(ROUND)
        ]
        before = await gateway.served_per_worker()
        for c in clients:
            assert (await c.get("/v1/models")).status_code == 200
        after = await gateway.served_per_worker()
        served = {i: after.get(i, 0.0) - before.get(i, 0.0) for i in range(WORKERS)}
        assert sum(served.values()) == ROUND, served
        if all(served.values()):
            return clients
        for c in clients:
            await c.aclose()
    raise AssertionError(f"the connections never reached both workers: {served}")


def test_serve_with_two_workers_holds_one_limit_for_both(tmp_path: Path) -> None:
    """`saltgate serve --workers 2` without [cluster]: at rpm 3, six requests at once on
    six connections spread over both workers admit exactly 3 (the workers count in one
    place, the supervisor); the others get OpenAI's 429 naming the limit 3. Dividing the
    limit between the workers (1 each) admits 2; each worker counting alone, 4 or more."""

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0))
        state = tmp_path / "state"
        key = new_state_dir(state, ("acme",))["acme"]
        with TenantStore.from_state_dir(state) as store:
            store.set_limits("acme", Limits(rpm=3))
        config = write_gateway_config(tmp_path / "gw.toml", state_dir=state, replicas=[sim.url])
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log", workers=WORKERS)
        clients: list[httpx.AsyncClient] = []
        try:
            headers = {"authorization": f"Bearer {key}"}
            clients = await _connections_on_both_workers(gateway, headers)
            answers = await asyncio.gather(
                *(c.post("/v1/completions", json=completion()) for c in clients)
            )
            statuses = sorted(r.status_code for r in answers)
            assert statuses == [200] * 3 + [429] * 3, [r.text for r in answers]
            for refused in (r for r in answers if r.status_code == 429):
                error = refused.json()["error"]
                assert error["code"] == "rate_limit_exceeded", error
                assert "Limit 3, Used 3, Requested 1." in error["message"], error
                assert refused.headers["x-ratelimit-limit-requests"] == "3"
                assert refused.headers["x-ratelimit-remaining-requests"] == "0"
                assert int(refused.headers["retry-after"]) >= 1
            metrics = (
                await clients[0].get(gateway.metrics_url, headers=gateway.metrics_headers)
            ).text
            # Counted in one place: no worker fell back to its share of the limit.
            assert per_worker(series(metrics), "saltgate_limits_shared_up") == {0: 1.0, 1: 1.0}
        finally:
            for c in clients:
                await c.aclose()
            await gateway.stop()
            await sim.close()
        assert "limits shared by this host's workers through the supervisor" in (
            gateway.log.read_text()
        )
        assert gateway.proc.stdout is not None  # what `serve` told the operator at start
        said = (await gateway.proc.stdout.read()).decode()
        assert "saltgate: limits exact on this host; its 2 workers count in one place" in said

    run(main)


def test_a_lease_outliving_lease_ttl_frees_its_slot(tmp_path: Path) -> None:
    """[limits] lease_ttl_s = 1: a stream still running after it no longer holds the
    tenant's one concurrency slot (what frees a killed gateway's slots)."""

    async def main() -> None:
        # The stream lasts 20 s (200 tokens at 100 ms), far past the 5 s waited below.
        sim = SimConfig(port=0, decode_ms_per_token=100.0)
        async with (
            stack(tmp_path, replicas=1, sim=sim, limits_lease_ttl_s=1.0) as s,
            s.client("alice") as c,
        ):
            await limit(s, "alice", Limits(concurrency=1))
            async with c.stream("POST", "/v1/completions", json=completion(200, stream=True)):
                busy = await c.post("/v1/completions", json=completion())
                assert busy.status_code == 429

                async def admitted() -> bool:
                    resp = await c.post("/v1/completions", json=completion())
                    return resp.status_code == 200

                await eventually(admitted, timeout_s=5.0, what="the lease expired")

    run(main)


def test_serve_check_and_set_limits_say_how_limits_are_held(tmp_path: Path) -> None:
    """The operator reads it where the limit is set and where the gateway is checked:
    one host's workers count in one place (exact); two gateways without [cluster] each
    enforce half, and a part of 0 is named as admitting nothing."""
    state = tmp_path / "state"
    new_state_dir(state, ("acme",))
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=state,
        replicas=["http://127.0.0.1:9"],
        admin_port=None,
        sections="[limits]\nshare = 2\n",
    )
    checked = cli("serve", "--check", "--config", str(config), "--workers", "2")
    assert "each of the 2 gateways ([limits] share) enforces floor(L / 2)" in checked
    assert "its 2 workers count in one place, the supervisor" in checked
    assert "floor(L / 4) on its own counts meanwhile" in checked
    said = cli("tenants", "set-limits", "acme", "--rpm", "1", "--config", str(config))
    assert said.splitlines()[0] == "tenant acme limits rpm=1\tweight 1"
    assert "each of the 2 gateways ([limits] share) enforces rpm=0" in said
    assert "rpm = 0 admits nothing there" in said
    alone = cli("tenants", "set-limits", "acme", "--rpm", "3", "--state-dir", str(state))
    assert "enforced: exactly, for each host, the workers of `serve --workers N` together" in (
        alone
    )
