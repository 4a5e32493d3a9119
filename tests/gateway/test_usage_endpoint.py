"""GET /v1/usage on the inference port: a tenant reads its own usage with its own API key,
in the admin API's shape, and never another tenant's."""

from __future__ import annotations

import time
from pathlib import Path

from tests.gateway.stack import MODEL, run, stack

HOUR = 3600


def test_a_tenant_reads_its_own_usage_and_only_its_own(tmp_path: Path) -> None:
    async def go() -> None:
        async with stack(tmp_path) as s:
            body = {"model": MODEL, "prompt": "count these", "max_tokens": 3}
            before = int(time.time())
            start = before - before % HOUR  # two hours: the requests may cross into the next
            async with s.client("alice") as alice, s.client("bob") as bob:
                for _ in range(3):
                    assert (await alice.post("/v1/completions", json=body)).status_code == 200
                assert (await bob.post("/v1/completions", json=body)).status_code == 200
                query = {
                    "start_time": str(start),
                    "end_time": str(start + 2 * HOUR),
                    "bucket_width": "1h",
                    "group_by": "tenant,key,model,replica",
                }
                mine = (await alice.get("/v1/usage", params=query)).json()
                theirs = (await bob.get("/v1/usage", params=query)).json()
                # Asking for the other tenant by id narrows to nothing; it never widens.
                bobs = {r["tenant_id"] for b in theirs["data"] for r in b["results"]}
                nosy = await alice.get("/v1/usage", params={**query, "tenant_ids": ",".join(bobs)})
                bad = await alice.get("/v1/usage", params={**query, "bucket_width": "2h"})
                anonymous = await s.client().get("/v1/usage", params=query)
            a = [r for b in mine["data"] for r in b["results"]]
            assert sum(r["num_model_requests"] for r in a) == 3
            assert {r["model"] for r in a} == {MODEL}
            assert all(r["replica"].startswith("http://127.0.0.1:") for r in a)
            assert sum(r["num_model_requests"] for b in theirs["data"] for r in b["results"]) == 1
            assert len(bobs) == 1 and bobs.isdisjoint(r["tenant_id"] for r in a)
            assert nosy.status_code == 200
            assert all(b["results"] == [] for b in nosy.json()["data"])
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "bucket_width"
            assert anonymous.status_code == 401

    run(go)
