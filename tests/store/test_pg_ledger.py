"""The PostgreSQL ledger on a real server: commit before acknowledge, group commit, one
record per request id, and a local spool through an outage, replayed exactly once."""

from __future__ import annotations

import asyncio
import fcntl
import os
import shutil
import time
from pathlib import Path

import orjson
import psycopg
import pytest
from tests.support.crash import acknowledged_before_sigkill
from tests.support.ledger import USAGE_COLUMNS, postgres_rows, usage_record
from tests.support.postgres import new_database
from tests.support.waiting import eventually

from saltgate.prices import PriceVersion
from saltgate.store.ledger import LedgerError, UsageRecord, new_request_id
from saltgate.store.pg_ledger import PgLedger
from saltgate.store.postgres import PostgresDatabase, conninfo
from saltgate.store.settings import StoreSettings
from saltgate.store.spool import Spool, encode, read_records
from saltgate_devkit.services import PostgresServer


def _spooled(settings: StoreSettings) -> list[Path]:
    assert settings.spool_dir is not None
    return sorted(settings.spool_dir.glob("usage-*.spool"))


def test_records_are_committed_before_acknowledged_and_batched(pg_store: StoreSettings) -> None:
    PostgresDatabase(pg_store).close()  # migrate
    records = [usage_record(i) for i in range(500)]

    async def run() -> PgLedger:
        ledger = PgLedger(pg_store)
        await ledger.start()
        await ledger.record(records[0])
        assert len(postgres_rows(pg_store)) == 1  # acknowledged means visible to another connection
        await asyncio.gather(*(ledger.record(r) for r in records[1:]))
        assert len(postgres_rows(pg_store)) == 500
        await ledger.aclose()
        return ledger

    ledger = asyncio.run(run())
    st = ledger.stats()
    assert st.records == 500
    assert st.transactions < 50, st  # concurrent records shared transactions
    assert st.max_batch_seen > 1
    assert postgres_rows(pg_store) == [tuple(r) for r in records]
    assert ledger.spooled == 0 and not _spooled(pg_store)


def test_a_record_committed_twice_counts_once(pg_store: StoreSettings) -> None:
    PostgresDatabase(pg_store).close()

    async def run() -> None:
        ledger = PgLedger(pg_store)
        await ledger.start()
        await ledger.record(usage_record(0))
        await ledger.record(usage_record(0)._replace(prompt_tokens=999))
        await asyncio.gather(
            ledger.record(usage_record(1)),
            ledger.record(usage_record(1)),
            ledger.record(usage_record(2)),
        )
        await ledger.aclose()

    asyncio.run(run())
    assert postgres_rows(pg_store) == [tuple(usage_record(i)) for i in range(3)]


def test_max_batch_bounds_a_transaction(pg_store: StoreSettings) -> None:
    PostgresDatabase(pg_store).close()

    async def run() -> PgLedger:
        ledger = PgLedger(pg_store, max_batch=16)
        await ledger.start()
        await asyncio.gather(*(ledger.record(usage_record(i)) for i in range(200)))
        await ledger.aclose()
        return ledger

    st = asyncio.run(run()).stats()
    assert st.records == 200 and st.max_batch_seen <= 16 and st.transactions >= 200 // 16


def test_an_outage_spools_fsynced_records_and_replays_them_once(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    settings = new_database(private_postgres, tmp_path)
    PostgresDatabase(settings).close()
    before = [usage_record(i) for i in range(0, 100)]
    during = [usage_record(i) for i in range(100, 400)]
    after = [usage_record(i) for i in range(400, 450)]
    kept = tmp_path / "kept"

    async def run() -> PgLedger:
        ledger = PgLedger(settings, retry_interval_s=0.1)
        await ledger.start()
        await asyncio.gather(*(ledger.record(r) for r in before))
        await asyncio.to_thread(private_postgres.stop, "immediate")
        # Acknowledged during the outage: on local disk, one fsync'd write per batch.
        await asyncio.gather(*(ledger.record(r) for r in during))
        assert not ledger.healthy and ledger.spooled == len(during)
        segments = _spooled(settings)
        on_disk = [rec for seg in segments for rec in read_records(seg.read_bytes())[0]]
        assert sorted(on_disk) == during
        shutil.copytree(settings.spool_dir or Path(), kept)  # for the replay-twice check
        await asyncio.to_thread(private_postgres.start)
        await eventually(lambda: not _spooled(settings) and ledger.healthy, what="the replay")
        await asyncio.gather(*(ledger.record(r) for r in after))
        await ledger.aclose()
        return ledger

    ledger = asyncio.run(run())
    assert ledger.replayed == len(during)
    assert postgres_rows(settings) == [tuple(r) for r in before + during + after]

    # Replaying the same segments again (a crash between the replay's commit and the
    # files' removal) adds nothing: the request id is the key.
    async def replay_again() -> PgLedger:
        again = PgLedger(
            StoreSettings(
                settings.backend, settings.url, password_file=settings.password_file, spool_dir=kept
            )
        )
        await again.start()
        await eventually(lambda: not list(kept.glob("usage-*.spool")), what="the replay")
        await again.aclose()
        return again

    assert asyncio.run(replay_again()).replayed == len(during)
    assert postgres_rows(settings) == [tuple(r) for r in before + during + after]
    # Positive control: without the key those rows would have been counted twice.
    db = PostgresDatabase(settings)
    try:
        with pytest.raises(psycopg.errors.UniqueViolation):
            marks = ", ".join(["%s"] * len(UsageRecord._fields))
            db.conn.execute(
                f"INSERT INTO usage ({USAGE_COLUMNS}) VALUES ({marks})", tuple(during[0])
            )
    finally:
        db.close()


def test_a_failed_commit_of_unknown_outcome_is_spooled_not_lost(
    private_postgres: PostgresServer, tmp_path: Path
) -> None:
    """Records in flight when the server dies come back through the spool; records the
    server had committed are not doubled by it."""
    settings = new_database(private_postgres, tmp_path)
    PostgresDatabase(settings).close()
    records = [usage_record(i) for i in range(3000)]

    async def run() -> None:
        ledger = PgLedger(settings, retry_interval_s=0.1, max_batch=64)
        await ledger.start()
        tasks = [asyncio.ensure_future(ledger.record(r)) for r in records]
        await eventually(lambda: ledger.stats().records > 0, what="a first batch committed")
        await asyncio.to_thread(private_postgres.stop, "immediate")
        await asyncio.gather(*tasks)  # every record acknowledged: committed or spooled
        await asyncio.to_thread(private_postgres.start)
        await eventually(lambda: not _spooled(settings) and ledger.healthy, what="the replay")
        assert ledger.spooled > 0, "the outage came too late to test anything"
        await ledger.aclose()

    asyncio.run(run())
    assert postgres_rows(settings) == [tuple(r) for r in records]


def test_a_spool_left_by_an_earlier_process_is_replayed_at_start(pg_store: StoreSettings) -> None:
    PostgresDatabase(pg_store).close()
    assert pg_store.spool_dir is not None
    pg_store.spool_dir.mkdir(mode=0o700)
    leftover = [usage_record(i) for i in range(10)]
    # What a crash leaves: complete lines, then a torn one that was never acknowledged.
    torn = encode([usage_record(99)])[:-7]
    (pg_store.spool_dir / "usage-00000000000000000001-1-aaaa.spool").write_bytes(
        encode(leftover) + torn
    )

    async def run() -> None:
        ledger = PgLedger(pg_store)
        await ledger.start()
        await eventually(lambda: not _spooled(pg_store), what="the leftover's replay")
        await ledger.aclose()

    asyncio.run(run())
    assert postgres_rows(pg_store) == [tuple(r) for r in leftover]


def test_a_spool_replays_unknown_cached_tokens_as_null_and_lines_of_older_releases(
    pg_store: StoreSettings,
) -> None:
    """A record whose cached tokens are unknown and that has a cost reaches PostgreSQL as
    NULL and as recorded; a nine-field line spooled before the cost columns replays too,
    and an eleven-field one from before the replica column."""
    PostgresDatabase(pg_store).close()
    assert pg_store.spool_dir is not None
    pg_store.spool_dir.mkdir(mode=0o700)
    unknown = usage_record(1)._replace(cached_tokens=None, cost_micro_usd=101, price_version="pv_a")
    old = usage_record(2)
    old_line = orjson.dumps(list(old)[:9]) + b"\n"
    priced = usage_record(3)._replace(cost_micro_usd=5, price_version="pv_a")
    priced_line = orjson.dumps(list(priced)[:11]) + b"\n"
    (pg_store.spool_dir / "usage-00000000000000000001-1-aaaa.spool").write_bytes(
        encode([unknown]) + old_line + priced_line
    )

    async def run() -> None:
        ledger = PgLedger(pg_store)
        await ledger.start()
        await eventually(lambda: not _spooled(pg_store), what="the replay")
        await ledger.aclose()

    asyncio.run(run())
    assert postgres_rows(pg_store) == [tuple(unknown), tuple(old), tuple(priced)]
    assert postgres_rows(pg_store)[0][6:11] == (None, 7, 200, 101, "pv_a")


def test_a_refused_record_is_set_aside_without_taking_good_ones_or_the_ledger_down(
    pg_store: StoreSettings,
) -> None:
    """A record the database refuses (here: a count its int4 column cannot hold; the
    gateway never sends one) fails its whole batch; the batch goes through the spool, its
    good records reach the table one by one, and the bad one is kept beside the spool."""
    PostgresDatabase(pg_store).close()
    bad = usage_record(1)._replace(prompt_tokens=2**40)

    async def run() -> PgLedger:
        ledger = PgLedger(pg_store, retry_interval_s=0.1)
        await ledger.start()
        await asyncio.gather(
            ledger.record(usage_record(0)), ledger.record(bad), ledger.record(usage_record(2))
        )
        assert ledger.spooled == 3 and ledger.healthy
        await eventually(lambda: not _spooled(pg_store), what="the replay")
        await ledger.record(usage_record(3))  # straight to the database again
        await ledger.aclose()
        return ledger

    ledger = asyncio.run(run())
    assert ledger.stats().transactions == 1
    assert postgres_rows(pg_store) == [tuple(usage_record(i)) for i in (0, 2, 3)]
    assert pg_store.spool_dir is not None
    [kept] = list(pg_store.spool_dir.glob("rejected-*.jsonl"))
    assert read_records(kept.read_bytes()) == ([bad], 0)
    assert oct(kept.stat().st_mode & 0o777) == "0o600"


def test_a_database_that_connects_but_does_not_answer_starts_the_ledger_spooling(
    pg_store: StoreSettings,
) -> None:
    """`start` promises spooling mode when the database does not answer: one that accepts
    the connection and then holds the prices insert (a lock on the table) must not hold up
    a gateway's start. Once the lock goes, the spooled record reaches PostgreSQL."""
    PostgresDatabase(pg_store).close()
    holder = psycopg.connect(conninfo(pg_store))  # a transaction: the lock lasts until rollback
    try:
        holder.execute("LOCK TABLE prices IN ACCESS EXCLUSIVE MODE")

        async def run() -> PgLedger:
            ledger = PgLedger(
                pg_store,
                prices=[PriceVersion.of_micro("m", 1, 1, 1)],
                commit_timeout_s=0.5,
                retry_interval_s=0.1,
            )
            await asyncio.wait_for(ledger.start(), 60)  # before the fix: waits for the lock
            assert not ledger.healthy
            await ledger.record(usage_record(0))
            assert ledger.spooled == 1 and postgres_rows(pg_store) == []
            await asyncio.to_thread(holder.rollback)
            await eventually(lambda: ledger.healthy and not _spooled(pg_store), what="the replay")
            await ledger.aclose()
            return ledger

        assert asyncio.run(run()).replayed == 1
    finally:
        holder.close()
    assert postgres_rows(pg_store) == [tuple(usage_record(0))]


def test_a_replay_cut_short_leaves_every_segment_claimable(pg_store: StoreSettings) -> None:
    """The database going away mid-replay must not leave a segment locked by this process
    (a later replay would then skip it for the process's whole life)."""
    PostgresDatabase(pg_store).close()
    assert pg_store.spool_dir is not None
    pg_store.spool_dir.mkdir(mode=0o700)
    for n in range(3):
        name = f"usage-0000000000000000000{n}-1-aaaa.spool"
        (pg_store.spool_dir / name).write_bytes(encode([usage_record(n)]))

    async def run() -> None:
        ledger = PgLedger(pg_store)
        conn = await psycopg.AsyncConnection.connect(conninfo(pg_store), autocommit=True)
        await conn.close()  # gone before the first insert
        with pytest.raises(psycopg.OperationalError):
            await ledger._replay(conn)
        for path in _spooled(pg_store):
            segment = ledger.spool.claim(path)
            assert segment is not None, f"{path.name} still locked"
            segment.release(remove=False)

    asyncio.run(run())
    assert len(_spooled(pg_store)) == 3 and postgres_rows(pg_store) == []


def test_a_segment_locked_by_a_live_writer_is_not_replayed(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool")
    asyncio.run(spool.append([usage_record(1)]))
    [path] = list((tmp_path / "spool").glob("usage-*.spool"))
    other = Spool(tmp_path / "spool")  # another gateway sharing the directory
    assert other.sealed() == [path]
    assert other.claim(path) is None  # our segment is still open and locked
    spool.close()
    segment = other.claim(path)
    assert segment is not None and segment.records == [usage_record(1)] and segment.skipped == 0
    fd = os.open(path, os.O_RDONLY)
    try:  # while claimed, nobody else can take it
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    segment.release(remove=True)
    assert not path.exists()


def test_sigkill_while_spooling_loses_no_acknowledged_record(tmp_path: Path) -> None:
    """A record is acknowledged only once its batch is written to the spool: killing the
    process at any moment leaves every acknowledged record in a segment."""
    spool = tmp_path / "spool"
    acked = set(acknowledged_before_sigkill(["--spool", str(spool), "32"], 2000))
    spooled = {
        rec.request_id
        for seg in spool.glob("usage-*.spool")
        for rec in read_records(seg.read_bytes())[0]
    }
    assert len(acked) >= 2000 and len({a.split("-")[0] for a in acked}) == 32
    missing = acked - spooled
    assert not missing, f"{len(missing)} acknowledged, not spooled: {sorted(missing)[:3]}"


def test_spool_lines_that_are_not_records_are_skipped() -> None:
    good = encode([usage_record(1), usage_record(2)])
    data = good + b'["x", "not a float"]\n' + b"[1,2]\n" + b"{}\n" + encode([usage_record(3)])
    records, skipped = read_records(data + b'["torn')
    assert records == [usage_record(1), usage_record(2), usage_record(3)] and skipped == 4
    # Null where unknown or unpriced, and only there; ten fields is no release's line.
    nulls = usage_record(4)._replace(cached_tokens=None)
    no_status = orjson.dumps([*list(usage_record(5))[:8], None]) + b"\n"
    ten = orjson.dumps(list(usage_record(6))[:10]) + b"\n"
    assert read_records(encode([nulls]) + no_status + ten) == ([nulls], 2)


def test_records_are_refused_when_neither_store_nor_spool_takes_them(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the spool directory should be")
    settings = StoreSettings(
        "postgresql",
        "postgresql://saltgate@127.0.0.1:1/none?connect_timeout=1",
        spool_dir=blocker / "spool",
    )

    async def run() -> None:
        ledger = PgLedger(settings, retry_interval_s=5)
        await ledger.start()  # unreachable: starts spooling
        assert not ledger.healthy
        rec = UsageRecord(new_request_id(), time.time(), "t", "k", "m", 1, 0, 1, 200)
        with pytest.raises(LedgerError, match=r"neither reached .* nor could be spooled"):
            await ledger.record(rec)
        await ledger.aclose()
        with pytest.raises(LedgerError, match="closed"):
            await ledger.record(usage_record(1))

    asyncio.run(run())
