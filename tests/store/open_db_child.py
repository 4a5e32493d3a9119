"""The body of a process that opens databases together with others (spawned by
tests/store/test_tenants.py; a module of its own so that a spawned interpreter can
import it)."""

from __future__ import annotations

import sqlite3
from multiprocessing.synchronize import Barrier
from pathlib import Path

from saltgate.store.sqlite import open_db


def open_each_when_all_are_ready(paths: list[Path], ready: Barrier, errors: Path) -> None:
    """Open every database in turn, each as soon as every process is ready to open it,
    and append what failed to `errors`."""
    for path in paths:
        ready.wait(timeout=60)
        try:
            open_db(path).close()
        except sqlite3.Error as exc:
            with errors.open("a") as out:
                out.write(f"{path.name}: {exc}\n")
