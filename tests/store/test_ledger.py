"""Usage ledger: commit-before-acknowledge, group commit, and survival of SIGKILL."""

from __future__ import annotations

import asyncio
import sqlite3
import statistics
import time
from pathlib import Path

import pytest
from tests.support.crash import acknowledged_before_sigkill
from tests.support.ledger import sqlite_rows, usage_record

from saltgate.store.ledger import Ledger, LedgerError


def test_records_committed_and_batched(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    n = 500
    records = [usage_record(i) for i in range(n)]

    async def run() -> Ledger:
        ledger = Ledger(path)
        await asyncio.gather(*(ledger.record(r) for r in records))
        # Acknowledged means committed: visible to another connection before close().
        assert len(sqlite_rows(path)) == n
        await ledger.aclose()
        return ledger

    ledger = asyncio.run(run())
    st = ledger.stats()
    assert st.records == n
    assert st.transactions < n // 10, st  # concurrent records shared transactions
    assert st.max_batch_seen > 1
    assert sqlite_rows(path) == [tuple(r) for r in records]


def test_a_record_committed_twice_counts_once(tmp_path: Path) -> None:
    """A retried commit (same request id) is dropped by the unique key, also when both
    copies land in the same batch; the other records of the batch still commit."""
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path)
        await ledger.record(usage_record(0))
        await ledger.record(usage_record(0))
        await asyncio.gather(
            ledger.record(usage_record(1)),
            ledger.record(usage_record(1)),
            ledger.record(usage_record(2)),
        )
        await ledger.aclose()

    asyncio.run(run())
    assert sqlite_rows(path) == [tuple(usage_record(i)) for i in range(3)]


def test_max_batch_bounds_transactions(tmp_path: Path) -> None:
    async def run() -> Ledger:
        ledger = Ledger(tmp_path / "saltgate.db", max_batch=16)
        await asyncio.gather(*(ledger.record(usage_record(i)) for i in range(200)))
        await ledger.aclose()
        return ledger

    st = asyncio.run(run()).stats()
    assert st.records == 200 and st.max_batch_seen <= 16 and st.transactions >= 200 // 16


@pytest.mark.parametrize("busy", [True, False], ids=["busy-coalesces", "idle-commits-at-once"])
def test_a_busy_gateway_lets_one_commit_carry_records_from_several_loop_turns(
    tmp_path: Path, busy: bool
) -> None:
    async def run() -> Ledger:
        ledger = Ledger(tmp_path / "saltgate.db", busy=lambda: busy, max_delay_s=0.5)

        async def late(i: int) -> None:
            for _ in range(i):  # arrive i loop turns later
                await asyncio.sleep(0)
            await ledger.record(usage_record(i))

        await asyncio.gather(*(late(i) for i in range(10)))
        await ledger.aclose()
        return ledger

    st = asyncio.run(run()).stats()
    assert st.records == 10
    if busy:
        assert st.transactions == 1  # all ten waited for the same commit
    else:
        assert st.transactions >= 5  # each loop turn committed on its own


def test_an_idle_gateway_commits_without_waiting_for_another_loop_turn(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path, busy=lambda: False)
        turned: list[bool] = []
        asyncio.get_running_loop().call_soon(turned.append, True)
        await ledger.record(usage_record(1))
        assert turned == []  # committed and returned within this turn of the loop
        assert len(sqlite_rows(path)) == 1
        await ledger.aclose()

    asyncio.run(run())


def test_close_drains_and_refuses_new_records(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path)
        tasks = [asyncio.ensure_future(ledger.record(usage_record(i))) for i in range(50)]
        await asyncio.sleep(0)  # let every task enqueue
        ledger.close()  # blocks until the queue is committed
        assert len(sqlite_rows(path)) == 50
        await asyncio.gather(*tasks)
        with pytest.raises(LedgerError, match="closed"):
            await ledger.record(usage_record(99))
        ledger.close()  # idempotent

    asyncio.run(run())


def test_commit_failure_reaches_the_caller(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path)
        await ledger.record(usage_record(0))
        conn = sqlite3.connect(path)
        conn.execute("DROP TABLE usage")  # a real SQLite failure for the next commit
        conn.close()
        with pytest.raises(LedgerError, match="not committed: no such table: usage"):
            await ledger.record(usage_record(1))
        await ledger.aclose()

    asyncio.run(run())


def test_a_count_sqlite_cannot_hold_fails_its_batch_not_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path)
        with pytest.raises(LedgerError, match="not committed"):
            await ledger.record(usage_record(0)._replace(prompt_tokens=2**70))
        await ledger.record(usage_record(1))
        await ledger.aclose()

    asyncio.run(run())
    assert sqlite_rows(path) == [tuple(usage_record(1))]


def test_cancelled_waiter_does_not_break_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"

    async def run() -> None:
        ledger = Ledger(path)
        task = asyncio.ensure_future(ledger.record(usage_record(0)))
        await asyncio.sleep(0)
        task.cancel()
        await ledger.record(usage_record(1))
        await ledger.aclose()

    asyncio.run(run())
    assert len(sqlite_rows(path)) == 2  # a cancelled wait does not un-record


def test_sigkill_loses_no_acknowledged_record(tmp_path: Path) -> None:
    path = tmp_path / "saltgate.db"
    acked = acknowledged_before_sigkill([str(path), "64"], 5000)

    conn = sqlite3.connect(path)  # recovers the WAL left by the killed process
    stored = {k for (k,) in conn.execute("SELECT key_id FROM usage")}
    conn.close()
    missing = set(acked) - stored
    assert len(set(acked)) == len(acked) >= 5000
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {sorted(missing)[:3]}"
    # All 64 writers were acknowledged concurrently (the load was real).
    assert len({a.split("-")[0] for a in acked}) == 64


def _wal_frames_per_pass(tmp_path: Path, name: str, rewind: int | None) -> tuple[list[int], int]:
    """The frames in the WAL at each of the checkpoint thread's first 100 passes under
    steady commits, and the rewinds. Paced by the passes, not the clock: how many records
    fit in one pass depends on the machine's fsync and scheduler, not on the property."""
    path = tmp_path / name

    async def run() -> tuple[list[int], int]:
        ledger = Ledger(path, wal_rewind_frames=rewind, checkpoint_interval_s=0.002)
        deadline = time.monotonic() + 60
        frames: list[int] = []
        seen = records = 0
        while seen < 100:
            assert time.monotonic() < deadline, "the checkpoint thread made under 100 passes"
            await ledger.record(usage_record(records))
            records += 1
            if ledger.checkpoints > seen:
                seen = ledger.checkpoints
                frames.append(ledger.wal_frames)
        await ledger.aclose()
        return frames, ledger.rewinds

    return asyncio.run(run())


def test_the_wal_stays_bounded_under_steady_commits(tmp_path: Path) -> None:
    """Checkpoints alone (PASSIVE) never rewind a WAL that is always being appended to;
    the ledger rewinds it past a bound. Control: without the rewind it keeps growing.
    A writer preempted for a whole checkpoint lets PASSIVE catch up and the control
    shrink (seen only with more busy threads than cores): up to three pairs."""
    medians = []
    for attempt in range(3):
        unbounded, none = _wal_frames_per_pass(tmp_path, f"unbounded{attempt}.db", rewind=None)
        bounded, rewinds = _wal_frames_per_pass(tmp_path, f"bounded{attempt}.db", rewind=64)
        assert rewinds > 0 and none == 0
        medians.append((statistics.median(bounded), statistics.median(unbounded)))
        if medians[-1][0] < medians[-1][1] / 3:
            return
    pytest.fail(f"the WAL's median frames, (rewound, not rewound), in 3 pairs: {medians}")
