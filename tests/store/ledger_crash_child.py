"""Crash-test subject: many writers record forever, printing each acknowledged record.

    python ledger_crash_child.py DB_PATH WRITERS
    python ledger_crash_child.py --spool SPOOL_DIR WRITERS

A line "w<writer>-<seq>\\n" goes to stdout (one unbuffered write) only after
`record` returned for that record; the test SIGKILLs this process and checks that every
printed record is in the database. With --spool the ledger is PostgreSQL's with its
database out of reach, so every record is acknowledged from the spool.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from saltgate.store.ledger import Ledger, UsageLedger, UsageRecord
from saltgate.store.pg_ledger import PgLedger
from saltgate.store.settings import StoreSettings


async def main(target: str, writers: int, spool: bool) -> None:
    ledger: UsageLedger
    if spool:
        unreachable = "postgresql://saltgate@127.0.0.1:1/none?connect_timeout=1"
        pg = PgLedger(StoreSettings("postgresql", unreachable, spool_dir=Path(target)))
        await pg.start()
        ledger = pg
    else:
        ledger = Ledger(target)

    async def writer(i: int) -> None:
        seq = 0
        while True:
            rid = f"w{i}-{seq}"
            rec = UsageRecord(rid, time.time(), "tn_crash", rid, "m", 100, 50, 10, 200)
            await ledger.record(rec)
            os.write(1, f"{rid}\n".encode())
            seq += 1

    await asyncio.gather(*(writer(i) for i in range(writers)))


if __name__ == "__main__":
    args = sys.argv[1:]
    spool = args[0] == "--spool"
    asyncio.run(main(args[-2], int(args[-1]), spool))
