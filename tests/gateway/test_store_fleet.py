"""Gateways sharing one store, as real `saltgate serve` processes (docs/store.md).

- A key created or revoked, a salt rotated, or a tenant's allowed models set, through the
  CLI takes effect on every gateway within a second, on both backends (SQLite: a shared
  file both poll; PostgreSQL: LISTEN/NOTIFY).
- PostgreSQL stopped with `pg_ctl stop -m immediate` under load and started again: every
  response delivered with a 200 has exactly one usage record (none lost, none doubled).
- Past `store_outage_grace_s` a gateway answers 503 with a clear message, and /ready 503
  (so a balancer stops sending), and serves again once the store is back.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Tap, run
from tests.support.gateways import SALTGATE, GatewayProcess, cli, spawn, write_gateway_config
from tests.support.http import async_client
from tests.support.leaks import leaks
from tests.support.postgres import new_database
from tests.support.waiting import eventually

from saltgate.config import create_master_key, load_master_key
from saltgate.derivations.derive import cache_salt, derive_subkeys
from saltgate.sim.run import SimConfig, start_sim
from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import TenantStore, new_api_key
from saltgate_devkit.services import PostgresServer

PROPAGATION_LIMIT_S = 1.0


async def _until_both(
    gateways: list[GatewayProcess], seen: Callable[[GatewayProcess], Awaitable[bool]], what: str
) -> float:
    """Seconds until `seen` holds on every gateway (each polled until it does)."""
    start = time.monotonic()
    pending = list(gateways)

    async def everywhere() -> bool:
        nonlocal pending
        pending = [g for g in pending if not await seen(g)]
        return not pending

    await eventually(everywhere, timeout_s=PROPAGATION_LIMIT_S, what=f"{what} on every gateway")
    return time.monotonic() - start


def test_store_changes_reach_every_gateway_within_a_second(
    store_settings: StoreSettings, tmp_path: Path
) -> None:
    master = tmp_path / "master.key"
    create_master_key(master)
    k_salt = derive_subkeys(load_master_key(master)).salt

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0))
        tap = Tap(sim)
        await tap.start()
        replica = f"http://127.0.0.1:{tap.port}"
        configs = [
            write_gateway_config(
                tmp_path / f"gw{i}.toml",
                state_dir=tmp_path / f"state{i}",
                master_key_file=master,
                replicas=[replica],
                store=store_settings,
            )
            for i in range(2)
        ]

        async def admin(on: int, *args: str) -> str:
            """The CLI, as an operator on either gateway's node would run it."""
            return await asyncio.to_thread(cli, *args, "--config", str(configs[on]))

        await admin(0, "tenants", "create", "acme")
        first = await admin(1, "keys", "create", "acme")
        [tenant_line] = (await admin(0, "tenants", "list")).splitlines()
        tenant_id = tenant_line.split("\t")[0]
        gateways = [
            await GatewayProcess.start(c, tmp_path / f"gw{i}.log") for i, c in enumerate(configs)
        ]
        http = async_client(timeout=10)

        async def status(g: GatewayProcess, key: str) -> int:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
            resp = await http.post(
                f"{g.url}/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
            )
            return resp.status_code

        async def salt_via(g: GatewayProcess) -> str:
            assert await status(g, first) == 200
            forwarded = [r for r in tap.seen if r.method == b"POST"][-1]
            return str(orjson.loads(forwarded.body)["cache_salt"])

        try:
            for g in gateways:
                assert await status(g, first) == 200
                assert await salt_via(g) == cache_salt(k_salt, tenant_id, "0", None)

            key = await admin(0, "keys", "create", "acme")
            took = await _until_both(gateways, lambda g: _is(status(g, key), 200), "a created key")
            print(f"{store_settings.backend}: created key live everywhere in {took:.3f} s")

            await admin(1, "tenants", "rotate-salt", "acme")
            rotated = cache_salt(k_salt, tenant_id, "1", None)
            took = await _until_both(
                gateways, lambda g: _is(salt_via(g), rotated), "a rotated salt"
            )
            print(f"{store_settings.backend}: rotated salt live everywhere in {took:.3f} s")

            key_id = (await admin(0, "keys", "list", "acme")).splitlines()[-1].split("\t")[0]
            await admin(0, "keys", "revoke", key_id)
            took = await _until_both(gateways, lambda g: _is(status(g, key), 401), "a revocation")
            print(f"{store_settings.backend}: revocation live everywhere in {took:.3f} s")
            assert all([await status(g, first) == 200 for g in gateways])

            # Outside its allowed models, the model is 404 as if it did not exist.
            await admin(1, "tenants", "set-models", "acme", "other-model,another")
            [line] = (await admin(0, "tenants", "list")).splitlines()
            assert line.endswith("\tmodels another,other-model\tlimits none\tweight 1")
            took = await _until_both(gateways, lambda g: _is(status(g, first), 404), "a model list")
            print(f"{store_settings.backend}: allowed models live everywhere in {took:.3f} s")
            await admin(0, "tenants", "set-models", "acme", "--all")
            [line] = (await admin(1, "tenants", "list")).splitlines()
            assert line.endswith("\tmodels all\tlimits none\tweight 1")
            await _until_both(gateways, lambda g: _is(status(g, first), 200), "every model again")

            # Limits travel the same way: every answer then carries them (docs/limits.md).
            async def limited(g: GatewayProcess) -> bool:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
                resp = await http.post(
                    f"{g.url}/v1/completions",
                    json=body,
                    headers={"authorization": f"Bearer {first}"},
                )
                return bool(resp.headers.get("x-ratelimit-limit-requests") == "1000")

            await admin(1, "tenants", "set-limits", "acme", "--rpm", "1000")
            took = await _until_both(gateways, limited, "a tenant's limits")
            print(f"{store_settings.backend}: limits live everywhere in {took:.3f} s")
        finally:
            await http.aclose()
            for g in gateways:
                await g.stop()
            await tap.close()
            await sim.close()

    run(main)


async def _is(value: Awaitable[object], expected: object) -> bool:
    return await value == expected


# -- PostgreSQL down under load ----------------------------------------------------------


class Tally:
    """What clients received: per key, 200s and their token sums; everything else."""

    def __init__(self) -> None:
        self.ok: Counter[str] = Counter()
        self.prompt: Counter[str] = Counter()
        self.completion: Counter[str] = Counter()
        self.failed: list[str] = []
        self.during_outage = 0


def _usage_of(resp: httpx.Response, stream: bool) -> dict[str, int]:
    if not stream:
        return dict(resp.json()["usage"])
    for line in resp.text.splitlines():
        if line.startswith("data: {") and '"usage"' in line:
            doc = orjson.loads(line[6:])
            if doc.get("usage"):
                return dict(doc["usage"])
    raise AssertionError(f"stream without usage: {resp.text[-300:]}")


async def _load(
    url: str,
    keys: dict[str, str],
    tally: Tally,
    *,
    stop: asyncio.Event,
    outage: Callable[[], bool],
    clients_per_key: int = 2,
) -> None:
    async def client(key_id: str, key: str, seed: int) -> None:
        rng = random.Random(seed)
        headers = {"authorization": f"Bearer {key}"}
        async with async_client(base_url=url, headers=headers, timeout=30) as http:
            while not stop.is_set():
                stream = rng.random() < 0.5
                body: dict[str, object] = {
                    "model": MODEL,
                    "prompt": f"outage test {rng.random()}",
                    "max_tokens": rng.randint(1, 6),
                }
                if stream:
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                during = outage()
                try:
                    resp = await http.post("/v1/completions", json=body)
                except httpx.HTTPError as exc:
                    tally.failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                if resp.status_code != 200:
                    tally.failed.append(f"{resp.status_code}: {resp.text[:200]}")
                    continue
                usage = _usage_of(resp, stream)
                tally.ok[key_id] += 1
                tally.prompt[key_id] += usage["prompt_tokens"]
                tally.completion[key_id] += usage["completion_tokens"]
                if during and outage():
                    tally.during_outage += 1

    await asyncio.gather(
        *(
            client(key_id, key, seed * 100 + n)
            for seed, (key_id, key) in enumerate(keys.items())
            for n in range(clients_per_key)
        )
    )


def _setup_tenant_keys(settings: StoreSettings, n: int) -> dict[str, str]:
    with TenantStore(open_database(settings)) as store:
        store.create_tenant("acme")
        return dict(store.create_key("acme") for _ in range(n))


def _ledger_by_key(settings: StoreSettings) -> dict[str, tuple[int, int, int, int]]:
    """key id -> (records with status 200, other records, prompt sum, completion sum)."""
    db = open_database(settings, create=False)
    try:
        rows = db.query(
            "SELECT key_id, sum(CASE WHEN status = 200 THEN 1 ELSE 0 END), "
            "sum(CASE WHEN status = 200 THEN 0 ELSE 1 END), sum(prompt_tokens), "
            "sum(completion_tokens) FROM usage GROUP BY key_id"
        )
    finally:
        db.close()
    return {k: (int(a), int(b), int(c), int(d)) for k, a, b, c, d in rows}


def test_postgres_stopped_under_load_keeps_one_record_per_delivered_response(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    settings = new_database(private_postgres, tmp_path)
    keys = _setup_tenant_keys(settings, 8)
    master = tmp_path / "master.key"
    create_master_key(master)
    sim, sim_url = spawn(
        ["sim", "--port", "0", "--prefill-ms-per-1k-tokens", "0", "--decode-ms-per-token", "1"],
        "saltgate sim:",
    )
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=[sim_url],
        store=settings,
    )
    tally = Tally()
    window = {"down": False}

    async def main() -> None:
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log")
        try:
            stop = asyncio.Event()
            load = asyncio.create_task(
                _load(gateway.url, keys, tally, stop=stop, outage=lambda: window["down"])
            )

            def delivered() -> int:
                return sum(tally.ok.values())

            await eventually(lambda: delivered() >= 300, timeout_s=60, what="the load runs")
            await asyncio.to_thread(private_postgres.stop, "immediate")
            window["down"] = True
            await eventually(
                lambda: tally.during_outage >= 300, timeout_s=60, what="load during the outage"
            )
            window["down"] = False
            await asyncio.to_thread(private_postgres.start)
            after = delivered() + 300
            await eventually(lambda: delivered() >= after, timeout_s=60, what="load after it")
            stop.set()
            await asyncio.wait_for(load, 60)
            # The gateway replays its spool in the background: wait until it is empty.
            spool = settings.spool_dir
            assert spool is not None
            await eventually(lambda: not list(spool.glob("usage-*.spool")), what="the replay")
        finally:
            await gateway.stop()

    try:
        run(main)
    finally:
        sim.kill()
        sim.wait(timeout=10)
    log = (tmp_path / "gw.log").read_text()
    assert not tally.failed, f"{len(tally.failed)} failed, e.g. {tally.failed[:3]}"
    assert tally.during_outage >= 300
    assert "spooling usage" in log and "replayed" in log, log[-2000:]
    ledger = _ledger_by_key(settings)
    assert set(ledger) == set(keys)
    for key_id in keys:
        ok, other, prompt, completion = ledger[key_id]
        delivered = tally.ok[key_id]
        assert (ok, other) == (delivered, 0), f"{key_id}: {ok} records for {delivered} 200s"
        assert (prompt, completion) == (tally.prompt[key_id], tally.completion[key_id])
    print(
        f"{sum(tally.ok.values())} responses, {tally.during_outage} while PostgreSQL was "
        f"down; the ledger holds exactly one record for each"
    )


def test_past_the_grace_a_gateway_answers_503_until_the_store_returns(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    settings = new_database(private_postgres, tmp_path)
    [(key_id, key)] = _setup_tenant_keys(settings, 1).items()
    assert settings.password_file is not None
    password = settings.password_file.read_text().strip()
    planted = new_api_key()
    master = tmp_path / "master.key"
    create_master_key(master)

    async def main() -> None:
        sim = await start_sim(SimConfig(port=0))
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            master_key_file=master,
            replicas=[sim.url],
            store=settings,
            gateway_extra="store_outage_grace_s = 1.5\n",
        )
        gateway = await GatewayProcess.start(config, tmp_path / "gw.log")
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": MODEL, "prompt": "grace", "max_tokens": 1}
        delivered = 0
        try:
            async with async_client(base_url=gateway.url, headers=headers, timeout=10) as http:
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                delivered += 1
                # Scraped before the outage, as Prometheus does: the admin listener then
                # takes the same token through it (serving/admin_listener.py).
                scrape = await http.get(gateway.metrics_url, headers=gateway.metrics_headers)
                assert scrape.status_code == 200
                ready = await http.get("/ready")
                assert ready.status_code == 200 and ready.json()["store"] == "ok"
                await asyncio.to_thread(private_postgres.stop, "immediate")
                down_at = time.monotonic()
                resp = await http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text  # within the grace
                delivered += 1
                while (resp := await http.post("/v1/completions", json=body)).status_code == 200:
                    delivered += 1
                    assert time.monotonic() - down_at < 1.5, "still serving past the grace"
                    await asyncio.sleep(0.05)
                # The grace runs from the store's last answer, at most a check interval (1 s)
                # before the stop.
                assert time.monotonic() - down_at >= 1.5 - 1.0
                assert resp.status_code == 503
                ready = await http.get("/ready")
                assert ready.status_code == 503, ready.text
                assert ready.json()["store"] == "unreachable"
                assert ready.json()["replicas"]["healthy"] == 1  # the store alone says no
                assert "postgresql://" not in ready.text
                assert (
                    _gauge(
                        await http.get(gateway.metrics_url, headers=gateway.metrics_headers),
                        "unreachable",
                    )
                    >= 1.5
                )
                error = resp.json()["error"]
                assert error["code"] == "store_unavailable"
                assert "key store" in error["message"] and "try again" in error["message"]
                assert "postgresql://" not in resp.text
                assert not leaks(resp.text, api_key=key, store_password=password)
                # Positive control: a 404 echoes the path it was sent (a key-shaped one
                # here), and the same scan finds it in that error.
                echoed = await http.post(f"/{planted}", json=body)
                assert echoed.status_code == 404 and leaks(echoed.text, planted=planted)
                await asyncio.to_thread(private_postgres.start)

                async def serving() -> bool:
                    nonlocal delivered
                    ok = (await http.post("/v1/completions", json=body)).status_code == 200
                    delivered += ok
                    return ok

                await eventually(serving, what="serving again after the store is back")
                ready = await http.get("/ready")
                assert ready.status_code == 200 and ready.json()["store"] == "ok"
                metrics = await http.get(gateway.metrics_url, headers=gateway.metrics_headers)
                assert _gauge(metrics, "unreachable") == 0.0
                assert _gauge(metrics, "spooled") >= delivered - 2  # all but the first, last
            spool = settings.spool_dir
            assert spool is not None
            await eventually(lambda: not list(spool.glob("usage-*.spool")), what="the replay")
        finally:
            await gateway.stop()
            await sim.close()
        ledger = _ledger_by_key(settings)
        assert ledger[key_id][:2] == (delivered, 0)  # a 503 is refused before metering

    run(main)


def _gauge(metrics: httpx.Response, which: str) -> float:
    name = {
        "unreachable": "saltgate_store_unreachable_seconds",
        "spooled": "saltgate_ledger_spooled_records",
    }[which]
    [line] = [ln for ln in metrics.text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


@pytest.mark.parametrize("conflict", ["postgresql", "sqlite"])
def test_state_dir_and_a_configured_store_do_not_mix(tmp_path: Path, conflict: str) -> None:
    url = "postgresql://sg@127.0.0.1:1/x" if conflict == "postgresql" else "sqlite:///other.db"
    config = tmp_path / "gw.toml"
    config.write_text(f'[store]\nurl = "{url}"\n[[replicas]]\nurl = "http://127.0.0.1:1"\n')
    done = subprocess.run(
        [str(SALTGATE), "tenants", "list", "--config", str(config), "--state-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "give --config or --state-dir, not both" in done.stderr
