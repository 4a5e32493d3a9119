"""A replica that refuses the gateway's API key (issue 43: "the hardest failure of the
session to diagnose"): its probe takes it down at once with a log line naming the cause,
/ready says why, and its 401 never reaches a tenant, whose key is not at fault."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tests.gateway.stack import MODEL, long_prompt, run, stack

from saltgate.sim.run import SimConfig

REPLICA_KEY = "the-replicas-own-key-0123456789"


def test_a_replica_refusing_the_gateways_key_is_down_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="saltgate")

    async def main() -> None:
        # The replicas take a key the gateway was not given (api_key_file missing or wrong).
        sim = SimConfig(port=0, api_key=REPLICA_KEY)
        async with stack(tmp_path, replicas=1, sim=sim) as s, s.client("alice") as alice:
            ready = await alice.get("/ready")
            assert ready.status_code == 503, ready.text
            [replica] = ready.json()["replicas"]["list"]
            assert replica == {"replica": 0, "healthy": False, "reason": "credentials_refused"}
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            answer = await alice.post("/v1/completions", json=body)
            assert answer.status_code == 503, answer.text  # the gateway's, not the replica's
            assert answer.json()["error"]["code"] == "no_replica"
            assert s.forwarded() == []

    run(main)
    said = [r.getMessage() for r in caplog.records if "API key" in r.getMessage()]
    assert said and "refuses the gateway's API key (/v1/models answered 401)" in said[0], said
    assert "[[replicas]] 0" in said[0] and REPLICA_KEY not in caplog.text


def test_a_401_on_a_request_is_never_relayed_and_the_next_replica_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica's key changed under a running gateway (restarted with a new --api-key):
    the first request it refuses goes to the other replica, and it is down at once."""
    caplog.set_level(logging.WARNING, logger="saltgate")

    async def main() -> None:
        async with stack(tmp_path, replicas=2) as s, s.client("alice") as alice:
            s.sims[0].server._api_key = REPLICA_KEY.encode()
            gateway = s.gateway.gateway
            first = gateway.replicas.replicas[0]
            for i in range(100):  # until a request was ranked to replica 0 first
                body = {"model": MODEL, "prompt": long_prompt(f"k{i}", 20), "max_tokens": 2}
                answer = await alice.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text  # never the replica's 401
                if gateway.replicas.down_reason(first) is not None:
                    break
            assert gateway.replicas.down_reason(first) == "credentials_refused"
            ready = (await alice.get("/ready")).json()["replicas"]["list"]
            assert ready[0]["reason"] == "credentials_refused" and ready[1]["healthy"]

    run(main)
    assert "refuses the gateway's API key (a request answered 401)" in caplog.text
