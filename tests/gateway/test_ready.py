"""/health is liveness, /ready readiness: 503 once no replica is healthy (per model with
?model=) or the store is past its grace (tests/gateway/test_store_fleet.py drives a real
PostgreSQL outage through it), 200 otherwise; and `serve --check` through the real CLI."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.gateway.stack import MODEL, run, stack
from tests.routing.test_routing_gateway import FAST_PROBES, kill
from tests.support.gateways import SALTGATE, write_gateway_config
from tests.support.waiting import eventually

from saltgate.config import ConfigError, create_master_key, load_config
from saltgate.gateway.readiness import ReplicaView, readiness, store_state
from saltgate.serving.check import check_config


def test_readiness_rules() -> None:
    up, down = ReplicaView(True, ("m", "n")), ReplicaView(False, ("m", "x"))
    ready, body = readiness(0.0, 60.0, [up, down])
    assert ready and body["store"] == "ok"
    assert body["replicas"] == {
        "healthy": 1,
        "total": 2,
        "list": [{"replica": 0, "healthy": True}, {"replica": 1, "healthy": False}],
    }
    assert body["models"] == {"m": True, "n": True, "x": False}
    assert readiness(0.0, 60.0, [up, down], "n")[0]
    assert not readiness(0.0, 60.0, [up, down], "x")[0]  # listed, but only by a down replica
    ready, body = readiness(0.0, 60.0, [up], "unknown")
    assert not ready and body["models"]["unknown"] is False
    assert not readiness(0.0, 60.0, [down])[0]
    assert not readiness(0.0, 60.0, [])[0]
    # The store: out of reach within its grace still serves (from the keys it knows).
    assert [store_state(s, 60.0) for s in (0.0, 1.0, 60.0, 60.5)] == [
        "ok",
        "degraded",
        "degraded",
        "unreachable",
    ]
    assert readiness(59.0, 60.0, [up])[0]
    ready, body = readiness(61.0, 60.0, [up])
    assert not ready and body["store"] == "unreachable" and body["store_down_s"] == 61.0
    # Draining (SIGTERM): not ready whatever else holds, so balancers stop sending.
    assert readiness(0.0, 60.0, [up])[1]["draining"] is False
    ready, body = readiness(0.0, 60.0, [up], draining=True)
    assert not ready and body["draining"] is True and body["replicas"]["healthy"] == 1


def test_ready_follows_replica_health_while_health_stays_200(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=2, router=FAST_PROBES) as s, s.client() as anyone:

            async def ready(query: str = "") -> httpx.Response:
                return await anyone.get("/ready" + query)

            resp = await ready()
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert body["ready"] and body["store"] == "ok"
            assert body["replicas"]["healthy"] == 2 and body["models"] == {MODEL: True}
            assert (await ready(f"?model={MODEL}")).status_code == 200
            other = await ready("?model=not-served")
            assert other.status_code == 503 and other.json()["models"]["not-served"] is False
            for tap in s.taps:  # the body names replicas by index, never by address
                assert str(tap.port) not in resp.text
            assert (await anyone.post("/ready")).status_code == 405

            await kill(s.taps[0])
            await eventually(
                lambda: s.gateway.gateway.readiness()[1]["replicas"]["healthy"] == 1,
                what="one replica down",
            )
            assert (await ready()).status_code == 200  # one healthy replica serves
            await kill(s.taps[1])
            await eventually(
                lambda: not s.gateway.gateway.readiness()[0], what="no replica healthy"
            )
            resp = await ready()
            assert resp.status_code == 503
            assert resp.json()["replicas"]["healthy"] == 0
            assert resp.json()["models"] == {MODEL: False}
            assert (await ready(f"?model={MODEL}")).status_code == 503
            health = await anyone.get("/health")
            assert health.status_code == 200  # liveness: the process still answers

    run(main)


def _serve_check(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SALTGATE), "serve", "--check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_serve_check_validates_without_serving(tmp_path: Path) -> None:
    master = tmp_path / "master.key"
    create_master_key(master)
    # Nothing listens on these: --check does not touch the network.
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=["http://127.0.0.1:9", "http://127.0.0.1:10"],
        gateway_extra=f'access_log = "{tmp_path / "gw.log"}"\n',
    )
    done = _serve_check(config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"saltgate: config {config} is valid (2 replicas, store ")
    assert not (tmp_path / "state").exists()  # nothing created: no store, no state dir
    assert not (tmp_path / "gw.log").exists()

    os.chmod(master, 0o644)  # the mistake serve would stop with
    done = _serve_check(config)
    assert done.returncode == 2
    assert "readable by others" in done.stderr and done.stdout == ""


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ('trusted_proxies = ["10.0.0.1/8"]\n', "gateway.trusted_proxies"),
        ('access_log = "/nonexistent-dir/gw.log"\n', "gateway.access_log"),
    ],
)
def test_serve_check_names_the_problem(tmp_path: Path, extra: str, needle: str) -> None:
    master = tmp_path / "master.key"
    create_master_key(master)
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=["http://127.0.0.1:9"],
        gateway_extra=extra,
    )
    done = _serve_check(config)
    assert done.returncode == 2 and needle in done.stderr, done.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_a_taken_port_is_named_by_check_and_serve(tmp_path: Path, workers: int) -> None:
    """An admin port in use was reported against the inference port ("cannot serve on
    HOST:PORT"), and `--check` passed: both now name the admin listener and its options,
    with exit 1 (a port may be free a moment later; the unit retries 1, not 2)."""
    master = tmp_path / "master.key"
    create_master_key(master)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        busy = taken.getsockname()[1]
        config = write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            master_key_file=master,
            replicas=["http://127.0.0.1:9"],
            admin_port=busy,
        )
        checked = _serve_check(config)
        served = subprocess.run(
            [str(SALTGATE), "serve", "--config", str(config), "--workers", str(workers)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    for done in (checked, served):
        assert done.returncode == 1, done.stderr
        said = f"cannot listen on 127.0.0.1:{busy} (the admin listener: gateway.admin_host, "
        assert said in done.stderr, done.stderr
        assert "cannot serve on" not in done.stderr


def test_check_refuses_tracing_without_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[tracing]` without the otel extra passed `--check`, then `serve` failed."""
    master = tmp_path / "master.key"
    create_master_key(master)
    config = load_config(
        write_gateway_config(
            tmp_path / "gw.toml",
            state_dir=tmp_path / "state",
            master_key_file=master,
            replicas=["http://127.0.0.1:9"],
            sections='[tracing]\notlp_endpoint = "http://127.0.0.1:4318"\n',
        )
    )
    assert "replicas" in check_config(config)  # installed here: passes
    real = importlib.util.find_spec

    def without_otel(name: str, *args: Any) -> Any:
        return None if name.startswith("opentelemetry") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_otel)
    with pytest.raises(ConfigError, match=r"pip install 'saltgate\[otel\]'"):
        check_config(config)
