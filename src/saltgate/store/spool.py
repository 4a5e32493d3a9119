"""Usage records that could not reach PostgreSQL, kept in local append-only files.

While the database is out of reach, the ledger appends each batch of records to the
current segment file with one write and one fsync (group commit), and only then lets
the responses complete: a record is durable on local disk before its client sees the
answer. When the database is back the ledger replays the sealed segments into it with
ON CONFLICT DO NOTHING on the request id, so a record replayed twice (a crash between
the replay's commit and the file's removal) still counts once, then deletes them.

Format: one JSON array per line, the UsageRecord's fields in order (null for an unknown
cached-token count, a record without a price or without a replica; lines of releases
before the cost columns have nine fields, before the replica eleven; both still replay).
A crash can leave the last line torn (no newline); that record was never acknowledged,
and reading stops before it. Segment files are 0600 in a 0700 directory; they hold
tenant and key ids and token counts, never a key or a prompt.

Several gateways may share one spool directory: each holds an exclusive flock on the
segment it appends to, and a replayer takes the same lock before it reads a segment, so a
live writer's file is never replayed from under it, and one segment is replayed by one
process at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from saltgate.store.ledger import UsageRecord

log = logging.getLogger(__name__)

SEGMENT_GLOB = "usage-*.spool"
_NULLABLE = ("cached_tokens", "cost_micro_usd", "price_version", "replica")


def _kinds(name: str) -> tuple[type, ...]:
    """The JSON types a UsageRecord field may have in a spooled line."""
    kinds: tuple[type, ...] = (
        (int, float)
        if name == "ts"
        else (int,)
        if name.endswith(("tokens", "status", "usd"))
        else (str,)
    )
    return (*kinds, type(None)) if name in _NULLABLE else kinds


_FIELD_TYPES = tuple(_kinds(name) for name in UsageRecord._fields)
# Lines spooled before records carried their cost (schema version 4) have nine fields;
# they replay as records priced at report time.
_FIELDS_BEFORE_COST = 9
_FIELDS_BEFORE_REPLICA = 11  # schema version 9


def encode(records: Sequence[UsageRecord]) -> bytes:
    return b"".join(orjson.dumps(list(rec)) + b"\n" for rec in records)


def decode_line(line: bytes) -> UsageRecord | None:
    """One spooled record, or None if the line is not one (never acknowledged)."""
    try:
        fields = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(fields, list) or len(fields) not in (
        _FIELDS_BEFORE_COST,
        _FIELDS_BEFORE_REPLICA,
        len(_FIELD_TYPES),
    ):
        return None
    for value, kinds in zip(fields, _FIELD_TYPES, strict=False):
        if isinstance(value, bool) or not isinstance(value, kinds):
            return None
    return UsageRecord(*fields)


@dataclass(frozen=True, slots=True)
class Segment:
    """A sealed segment, read and locked for replay; `release` unlocks it (and with
    ``remove=True`` deletes it first, once its records are in the database)."""

    path: Path
    records: list[UsageRecord]
    skipped: int  # lines that were not records (a torn tail)
    _fd: int

    @property
    def rejected_path(self) -> Path:
        """Where the records of this segment the database refused are kept."""
        return self.path.with_name("rejected-" + self.path.stem + ".jsonl")

    def release(self, *, remove: bool) -> None:
        try:
            if remove:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                _fsync_dir(self.path.parent)
        finally:
            os.close(self._fd)


class Spool:
    """The current segment of this process, and the sealed ones of the directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None
        self._path: Path | None = None
        self._lock = asyncio.Lock()
        self.records_written = 0

    async def append(self, records: Sequence[UsageRecord]) -> None:
        """Return once `records` are on disk (written and fsync'd); OSError if not."""
        data = encode(records)
        async with self._lock:
            await asyncio.to_thread(self._append, data)
        self.records_written += len(records)

    async def seal(self) -> None:
        """Close the current segment; the next append starts a new one."""
        async with self._lock:
            self._close()

    def close(self) -> None:
        self._close()

    def sealed(self) -> list[Path]:
        """Segment files of this directory other than the one this process appends to,
        oldest first (some may be locked by another live process)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.glob(SEGMENT_GLOB) if p != self._path)

    def claim(self, path: Path) -> Segment | None:
        """Lock and read a sealed segment; None if another process holds it, or it is gone."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            records, skipped = read_records(_read_all(fd))
        except BaseException:
            os.close(fd)
            raise
        if skipped:
            log.warning("spool %s: %d line(s) that are no record skipped", path, skipped)
        return Segment(path, records, skipped, fd)

    def set_aside(self, segment: Segment, records: Sequence[UsageRecord]) -> Path:
        """Keep records the database refused (same format, never replayed by itself): an
        operator can fix the cause and rename the file to ``usage-*.spool`` to retry."""
        path = segment.rejected_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            _write_all(fd, encode(records))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(path.parent)
        return path

    # -- on the spool's thread ------------------------------------------------------------

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            self._open_segment()
        assert self._fd is not None
        try:
            _write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            # The file may now end in a torn line: later records go to a new segment.
            self._close()
            raise

    def _open_segment(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"usage-{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}.spool"
        path = self.directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # fresh file: nobody else can hold it
        _fsync_dir(self.directory)  # the file's name survives a power loss too
        self._fd, self._path = fd, path

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = self._path = None


def read_records(data: bytes) -> tuple[list[UsageRecord], int]:
    """The records in a segment's bytes, and how many lines were not records."""
    records: list[UsageRecord] = []
    skipped = 0
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # torn tail: written, never fsync'd to completion, never acknowledged
        skipped += 1
    for line in lines:
        rec = decode_line(line)
        if rec is None:
            skipped += 1
        else:
            records.append(rec)
    return records, skipped


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
