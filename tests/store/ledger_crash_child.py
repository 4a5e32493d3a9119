"""Crash-test subject: many writers record forever, printing each acknowledged record.

    python ledger_crash_child.py DB_PATH WRITERS

A line "w<writer>-<seq>\\n" goes to stdout (one unbuffered write) only after
`Ledger.record` returned for that record; the test SIGKILLs this process and checks that
every printed record is in the database.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from saltgate.store.ledger import Ledger, UsageRecord


async def main(db: str, writers: int) -> None:
    ledger = Ledger(db)

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
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
