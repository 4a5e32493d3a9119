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


async def _ledger(settings: StoreSettings, key_use_interval_s: float) -> Ledger | PgLedger:
    """The ledger a gateway opens on `settings`' backend, started."""
    if settings.backend == "sqlite":
        assert settings.sqlite_path is not None
        return Ledger(settings.sqlite_path, key_use_interval_s=key_use_interval_s)
    open_database(settings).close()  # migrated, as a gateway's start does
    ledger = PgLedger(settings, key_use_interval_s=key_use_interval_s)
    await ledger.start()
    return ledger


def test_last_use_is_written_after_the_interval_and_at_close(
    store_settings: StoreSettings,
) -> None:
    async def run() -> None:
        ledger = await _ledger(store_settings, key_use_interval_s=0.05)
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
        ledger.key_use_interval_s = 3600  # the timer pending, then only the close writes
        await ledger.record(usage_record(9))
        await ledger.aclose()
        assert _marks(store_settings) == {
            "key_0": third.ts,
            "key_1": second.ts,
            "key_9": usage_record(9).ts,
        }

    asyncio.run(run())


def test_last_use_waits_for_the_interval_or_the_close(store_settings: StoreSettings) -> None:
    """With an interval longer than the test, committed records leave no mark: none is
    written in their transaction, nor after each commit. Closing writes them."""

    async def run() -> None:
        ledger = await _ledger(store_settings, key_use_interval_s=3600)
        used = [usage_record(9), usage_record(1)]
        for record in used:  # two commits
            await ledger.record(record)
        assert _marks(store_settings) == {}
        await ledger.aclose()
        assert _marks(store_settings) == {r.key_id: r.ts for r in used}

    asyncio.run(run())
