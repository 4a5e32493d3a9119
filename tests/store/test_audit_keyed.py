"""The audit chain keyed with K_audit (issue 41): someone with write access to the
database but not the master key can no longer delete an entry and re-hash the rest
unseen, and `verify --expect SEQ:HASH` finds entries cut from the end.

Each attack is also run on a chain written without the key (as saltgate 0.1 wrote every
chain): there it goes unseen, which shows the test would see the protection missing.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest
from tests.support.gateways import SALTGATE

from saltgate.config import create_master_key
from saltgate.store.audit import (
    entry_hash,
    expected_head,
    head_problem,
    list_entries,
    verify_chain,
)
from saltgate.store.errors import StoreError
from saltgate.store.tenants import TenantStore


def changes(state: Path, names: list[str]) -> None:
    with TenantStore.from_state_dir(state) as store:
        for name in names:
            store.create_tenant(name)


def rewrite_without(state: Path, seq: int) -> None:
    """The review's attack: past the triggers, delete entry `seq`, renumber the later
    ones and recompute their hashes, with what the database holds (no key)."""
    conn = sqlite3.connect(state / "saltgate.db")
    try:
        conn.execute("DROP TRIGGER audit_log_no_update")
        conn.execute("DROP TRIGGER audit_log_no_delete")
        rows = conn.execute("SELECT * FROM audit_log WHERE seq > ? ORDER BY seq", (seq,))
        later = [list(r) for r in rows]
        conn.execute("DELETE FROM audit_log WHERE seq >= ?", (seq,))
        prev = conn.execute("SELECT entry_hash FROM audit_log WHERE seq = ?", (seq - 1,))
        prev_hash = bytes(prev.fetchone()[0])
        for row in later:
            fields = (row[0] - 1, *row[1:10])
            own = entry_hash(prev_hash, fields)
            conn.execute(
                "INSERT INTO audit_log VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (*fields, prev_hash, own),
            )
            prev_hash = own
        conn.commit()
    finally:
        conn.close()


def cut_tail(state: Path, after: int) -> None:
    conn = sqlite3.connect(state / "saltgate.db")
    try:
        conn.execute("DROP TRIGGER audit_log_no_delete")
        conn.execute("DELETE FROM audit_log WHERE seq > ?", (after,))
        conn.commit()
    finally:
        conn.close()


def verify(state: Path) -> tuple[bool, str, int | None]:
    with TenantStore.from_state_dir(state) as store:
        check = verify_chain(store.db)
    return check.ok, check.reason, check.keyed_from


@pytest.mark.unit
def test_an_entry_deleted_and_the_rest_rehashed_breaks_a_keyed_chain(tmp_path: Path) -> None:
    keyed, legacy = tmp_path / "keyed", tmp_path / "legacy"
    for state in (keyed, legacy):
        state.mkdir()
    create_master_key(keyed / "master.key")
    for state in (keyed, legacy):
        changes(state, ["a", "b", "c", "d"])
        assert verify(state)[0]
        rewrite_without(state, 2)
    # The control: without the key (today's chains) the rewrite passes as intact.
    assert verify(legacy) == (True, "", None)
    ok, reason, _ = verify(keyed)
    assert not ok and "not keyed, after keyed entries from 1" in reason


@pytest.mark.unit
def test_a_legacy_chain_is_keyed_from_the_first_change_with_the_key(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    changes(state, ["a", "b"])  # saltgate 0.1: no master key beside the store
    assert verify(state) == (True, "", None)
    create_master_key(state / "master.key")
    changes(state, ["c", "d"])
    assert verify(state) == (True, "", 3)  # entries 1-2 as they were, keyed from 3
    # A store opened without the master key refuses to append, rather than break it.
    (state / "master.key").rename(tmp_path / "elsewhere.key")
    with pytest.raises(StoreError, match="keyed with the master key"):
        changes(state, ["e"])
    ok, reason, _ = verify(state)
    assert not ok and "verify with the master key" in reason  # keyed: unverifiable so
    (tmp_path / "elsewhere.key").rename(state / "master.key")
    changes(state, ["e", "f"])
    assert verify(state) == (True, "", 3)
    # Keyed entries rewritten as plain ones (the attacker's only choice) are refused.
    rewrite_without(state, 4)
    ok, reason, _ = verify(state)
    assert not ok and "not keyed, after keyed entries from 3" in reason


@pytest.mark.unit
def test_expect_finds_a_cut_tail_and_a_rewritten_head(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    create_master_key(state / "master.key")
    changes(state, ["a", "b", "c"])
    with TenantStore.from_state_dir(state) as store:
        check = verify_chain(store.db)
        assert check.head is not None
        head = check.head
        assert head_problem(store.db, check, head) is None  # the control
    cut_tail(state, 2)
    assert verify(state)[0]  # the chain alone cannot see it
    with TenantStore.from_state_dir(state) as store:
        problem = head_problem(store.db, verify_chain(store.db), head)
        assert problem is not None and "cut from the end" in problem
        older = (2, list_entries(store.db, after_seq=1, limit=1)[0].entry_hash)
        assert head_problem(store.db, verify_chain(store.db), older) is None
        other = head_problem(store.db, verify_chain(store.db), (2, bytes(32)))
        assert other is not None and "another hash" in other
    for bad in ("3", "0:" + "00" * 32, "3:abcd", "x:" + "00" * 32):
        with pytest.raises(ValueError, match="SEQ:HASH"):
            expected_head(bad)


def test_the_cli_prints_the_head_and_checks_it(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    create_master_key(state / "master.key")
    changes(state, ["a", "b", "c"])

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [str(SALTGATE), "audit-log", "verify", "--state-dir", str(state), *extra]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    first = run()
    assert first.returncode == 0, first.stderr
    assert "3 entries, keyed from entry 1; head 3:" in first.stdout
    head = first.stdout.rsplit("head ", 1)[1].strip()
    assert run("--expect", head).returncode == 0  # the control
    cut_tail(state, 2)
    cut = run("--expect", head)
    assert cut.returncode == 1 and "entry 3 is missing" in cut.stderr
    assert run().returncode == 0  # without the kept head the cut is not seen
    assert run("--expect", "3").returncode == 1
