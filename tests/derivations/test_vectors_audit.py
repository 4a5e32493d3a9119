"""The audit log's key and keyed chain (docs/spec.md section 13) pinned against the
independent implementation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from saltgate.derivations.derive import derive_audit_key
from saltgate.store.audit import canonical, entry_hash

from . import make_audit_vectors

pytestmark = pytest.mark.unit

VECTORS: dict[str, Any] = json.loads(
    Path(__file__).with_name("vectors_audit_v1.json").read_text(encoding="utf-8")
)


def test_stored_audit_keys() -> None:
    for v in VECTORS["keys"]:
        assert derive_audit_key(bytes.fromhex(v["master_key"])).hex() == v["k_audit"]


def test_stored_chain() -> None:
    key = derive_audit_key(bytes.fromhex(VECTORS["chain_master_key"]))
    prev = bytes(32)
    for v in VECTORS["chain"]:
        fields = tuple(v["fields"])
        assert canonical(list(fields)) == v["fields_json"]
        assert prev.hex() == v["prev_hash"]
        prev = entry_hash(prev, fields, key)
        assert prev.hex() == v["entry_hash"]
        assert entry_hash(bytes.fromhex(v["prev_hash"]), fields) != prev  # unkeyed differs


def test_stored_vectors_are_the_reference_s() -> None:
    assert make_audit_vectors.build() == VECTORS


def test_the_key_is_not_another_sub_key_and_needs_a_real_master_key() -> None:
    from saltgate.derivations import derive_subkeys

    master = bytes(range(32))
    subkeys = derive_subkeys(master)
    assert derive_audit_key(master) not in (subkeys.salt, subkeys.route, subkeys.kv_events)
    with pytest.raises(ValueError, match="at least"):
        derive_audit_key(b"short")
