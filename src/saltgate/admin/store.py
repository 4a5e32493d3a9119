"""The admin plane's store: one `Database` (either backend), used from one thread.

The store's operations are blocking (the CLI's), and a SQLite connection belongs to the
thread that opened it; so the admin listener runs every store call on one worker thread
of its own, which opens the database on first use. The event loop (and the gateway's
requests on it) never waits on the store.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from saltgate.store.backends import open_database
from saltgate.store.db import Database
from saltgate.store.settings import StoreSettings

T = TypeVar("T")


class AdminStore:
    """`run(fn)` calls ``fn(database)`` on the store's own thread."""

    def __init__(self, settings: StoreSettings) -> None:
        self._settings = settings
        self._db: Database | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saltgate-admin")

    def _call(self, fn: Callable[[Database], T]) -> T:
        if self._db is None:
            self._db = open_database(self._settings)
        return fn(self._db)

    async def run(self, fn: Callable[[Database], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._call, fn)

    async def aclose(self) -> None:
        def close(_: Database) -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        if self._db is not None:
            await self.run(close)
        self._thread.shutdown(wait=False)
