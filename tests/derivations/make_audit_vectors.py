"""Regenerate tests/derivations/vectors_audit_v1.json from the INDEPENDENT implementation.

    .venv/bin/python -m tests.derivations.make_audit_vectors

Only on a deliberate spec change (docs/spec.md section 13): the file pins K_audit and
the keyed audit chain.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import reference as ref
from .cases import MASTER_KEYS

OUT = Path(__file__).with_name("vectors_audit_v1.json")

# Entries of one chain (seq through request_id): a CLI change, an API change with its
# request id, JSON before/after with quotes and a non-ASCII name, a token's revocation.
ENTRIES: list[list[Any]] = [
    [1, 1733390000.25, "cli:ops", "tenant.created", "tenant", "tn_0a1b", "tn_0a1b", None,
     '{"id":"tn_0a1b","name":"acme"}', None],
    [2, 1733390001.0, "adm_1cf395cd6024", "api_key.created", "api_key", "key_77", "tn_0a1b",
     None, '{"id":"key_77","tenant_id":"tn_0a1b"}', "req_5f2c"],
    [3, 1733390002.123456, "adm_1cf395cd6024", "tenant.updated", "tenant", "tn_0a1b",
     "tn_0a1b", '{"name":"acme"}', '{"name":"acm\\u00e9 \\"q\\"\\n"}', "req_5f2d"],
    [4, 1733390003.5, "cli:r\u00e9my", "admin_token.revoked", "admin_token", "adm_d3e8",
     None, '{"revoked_at":null}', '{"revoked_at":1733390003.5}', None],
]  # fmt: skip


def build() -> dict[str, Any]:
    keys = [{"master_key": m.hex(), "k_audit": ref.audit_key(m).hex()} for m in MASTER_KEYS]
    k_audit = ref.audit_key(MASTER_KEYS[0])
    prev = bytes(32)
    chain = []
    for fields in ENTRIES:
        own = ref.audit_entry_hash(k_audit, prev, fields)
        chain.append(
            {
                "fields": fields,
                "fields_json": ref.audit_fields_json(fields).decode("ascii"),
                "prev_hash": prev.hex(),
                "entry_hash": own.hex(),
            }
        )
        prev = own
    return {
        "note": "spec v1 audit key and keyed chain (docs/spec.md 13) computed by "
        "tests/derivations/reference.py, not by saltgate; regenerate with "
        "`python -m tests.derivations.make_audit_vectors` only on a deliberate spec change.",
        "keys": keys,
        "chain_master_key": MASTER_KEYS[0].hex(),
        "chain": chain,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
