"""The usage-queries benchmark fills its store as production would have it: the rollups
it sums after the bulk load equal the ledger to the token, on both backends, and the
insert trigger is back for what is written after."""

from __future__ import annotations

import asyncio

from saltgate.store.backends import open_database
from saltgate.store.settings import StoreSettings
from saltgate.store.usage_rollups import open_usage_reader, reconcile
from saltgate_bench.usage_queries import fill

DAY = 86400
END = 1_790_000_000 // DAY * DAY


async def _reconcile(settings: StoreSettings) -> tuple[dict[str, int], list[object]]:
    reader = open_usage_reader(settings)
    try:
        totals, mismatches = await reconcile(reader)
    finally:
        await reader.aclose()
    return totals, list(mismatches)


def test_the_fill_leaves_rollups_equal_to_the_ledger(store_settings: StoreSettings) -> None:
    db = open_database(store_settings)
    try:
        fill(db, rows=3000, keys=40, tenants=7, end=END)
        [(keys,)] = db.query("SELECT count(*) FROM api_keys")
        [(hours,)] = db.query("SELECT count(*) FROM usage_rollup_1h")
        # Each row's key is one of its tenant's (a row's values from one draw, not one
        # per use), and each tenant has 3 keys x 2 models x 2 replicas.
        [(foreign,)] = db.query(
            "SELECT count(*) FROM usage WHERE substr(key_id, 1, length(key_id) - 2) "
            "<> 'key_' || substr(tenant_id, 4)"
        )
        [(kinds,)] = db.query(
            "SELECT count(DISTINCT key_id || model || replica) FROM usage WHERE tenant_id = 'tn_0'"
        )
    finally:
        db.close()
    assert keys == 40
    assert foreign == 0
    assert kinds == 12
    assert hours > 0
    totals, mismatches = asyncio.run(_reconcile(store_settings))
    assert mismatches == []
    assert totals["requests"] == 3000
    assert 0 < totals["cached_unknown_requests"] < 3000

    # A record written after the fill lands in the rollups: the trigger is back.
    db = open_database(store_settings)
    try:
        db.execute(
            "INSERT INTO usage (request_id, ts, tenant_id, key_id, model, prompt_tokens, "
            "cached_tokens, completion_tokens, status) VALUES ('after', ?, 'tn_0', 'key_0_0', "
            "'model_0', 7, 3, 5, 200)",
            (END - 10,),
        )
    finally:
        db.close()
    totals, mismatches = asyncio.run(_reconcile(store_settings))
    assert mismatches == []
    assert totals["requests"] == 3001
