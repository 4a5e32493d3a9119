"""Each key's last use, written by the ledgers once per interval and at close, on both
backends; never in the usage transaction itself."""

from __future__ import annotations

import asyncio

from tests.support.ledger import usage_record
from tests.support.waiting import eventually

from saltgate.store.backends import open_database
from saltgate.store.ledger import Ledger
from saltgate.store.pg_ledger import PgLedger
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import last_used


def _marks(settings: StoreSettings) -> dict[str, float]:
    db = open_database(settings)
    try:
        return last_used(db, ["key_0", "key_1", "key_2", "key_9"])
    finally:
        db.close()


def _series() -> list:  # type: ignore[type-arg]
    """key_0 used at ts 0 then 2 (the later wins), key_1 at 1."""
    first, second, third = usage_record(0), usage_record(1), usage_record(2)
    return [first, second, third._replace(key_id="key_0", request_id="req-x")]


def test_last_use_is_written_after_the_interval_and_at_close(
    store_settings: StoreSettings,
) -> None:
    async def run() -> None:
        if store_settings.backend == "sqlite":
            assert store_settings.sqlite_path is not None
            ledger: Ledger | PgLedger = Ledger(store_settings.sqlite_path, key_use_interval_s=0.05)
        else:
            open_database(store_settings).close()  # migrated, as a gateway's start does
            ledger = PgLedger(store_settings, key_use_interval_s=0.05)
            await ledger.start()
        first, second, third = _series()
        await ledger.record(first)
        await ledger.record(second)
        await eventually(lambda: len(_marks(store_settings)) == 2, what="marks written")
        assert _marks(store_settings) == {"key_0": first.ts, "key_1": second.ts}
        await ledger.record(third)
        await eventually(
            lambda: _marks(store_settings)["key_0"] == third.ts, what="a later use moves it"
        )
        # An older mark never moves it back (two gateways writing out of order).
        await ledger.record(usage_record(0)._replace(request_id="req-old"))
        ledger.key_use_interval_s = 3600  # from here, only close writes
        await ledger.record(usage_record(9))
        await ledger.aclose()
        assert _marks(store_settings) == {
            "key_0": third.ts,
            "key_1": second.ts,
            "key_9": usage_record(9).ts,
        }

    asyncio.run(run())
