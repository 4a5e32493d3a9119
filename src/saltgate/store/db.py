"""What the admin operations need from a backend: a few statements in transactions.

SQL is written once with ``?`` placeholders and portable types; the PostgreSQL wrapper
turns the placeholders into ``%s``. Driver errors come out as StoreError (a safe
message), constraint violations as ConflictError.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from saltgate.store.settings import Backend


class Database(Protocol):
    backend: Backend
    audit_key: bytes | None  # K_audit: keys the audit log's chain (saltgate.store.audit)

    def describe(self) -> str:
        """Where the data lives, for messages (never a password)."""
        ...

    def query(self, sql: str, params: Sequence[object] = ()) -> list[tuple[Any, ...]]: ...

    def execute(self, sql: str, params: Sequence[object] = ()) -> None: ...

    def execute_many(self, sql: str, rows: Iterable[Sequence[object]]) -> None:
        """One statement for many rows (a copy moves the ledger in pages)."""
        ...

    def transaction(self) -> AbstractContextManager[None]:
        """Statements inside commit together, or not at all."""
        ...

    def read_snapshot(self) -> AbstractContextManager[None]:
        """Reads inside see one consistent state, and block no writer (a report must not
        stall a gateway's ledger)."""
        ...

    def close(self) -> None: ...
