"""Regenerate tests/derivations/vectors_v1.json from the INDEPENDENT implementation (reference.py).

    .venv/bin/python -m tests.derivations.make_vectors

Run it only when the spec deliberately changes (and bump the version labels then):
the point of the file is that saltgate.derivations cannot drift from it silently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from . import reference as ref
from .cases import (
    CLUSTER_PAYLOADS,
    KV_BLOCK_HASHES,
    KV_REPLICA_NAMES,
    MASTER_KEYS,
    PREFIX_FIRST_DEPTHS,
    PREFIX_FLAT,
    RANKING_KEYS,
    RANKING_MEMBERS,
    ROUTE_BODIES,
    SALT_INPUTS,
    WINDOWS,
)

OUT = Path(__file__).with_name("vectors_v1.json")


def build() -> dict[str, Any]:
    vectors: dict[str, Any] = {
        "note": "spec v1 vectors computed by tests/derivations/reference.py (hashlib HMAC, "
        "hand-written HKDF, own canonical JSON), not by saltgate; regenerate with "
        "`python -m tests.derivations.make_vectors` only on a deliberate spec change.",
        "subkeys": [],
        "salts": [],
        "routes": [],
        "prefixes": [],
        "rankings": [],
        "kv": [],
        "cluster": [],
    }
    master = MASTER_KEYS[0]
    for key in MASTER_KEYS:
        sk = ref.subkeys(key)
        vectors["subkeys"].append(
            {"master_key": key.hex(), **{name: value.hex() for name, value in sk.items()}}
        )
    k = ref.subkeys(master)
    for tenant, epoch, secret in SALT_INPUTS:
        vectors["salts"].append(
            {
                "master_key": master.hex(),
                "tenant_id": tenant,
                "epoch": epoch,
                "user_cache_secret": secret,
                "cache_salt": ref.cache_salt(k["salt"], tenant, epoch, secret),
            }
        )
    salt = ref.cache_salt(k["salt"], "tenant-a", "0", None)
    for route, body in ROUTE_BODIES:
        case: dict[str, Any] = {"route": route, "body": body, "salt": salt, "windows": []}
        for w in WINDOWS:
            window = ref.window(body, route, w)
            case["windows"].append(
                {
                    "window_bytes": w,
                    # the full window for short ones, its SHA-256 otherwise (keeps the file small)
                    "window": None if window is None or len(window) > 256 else window.hex(),
                    "window_sha256": None if window is None else hashlib.sha256(window).hexdigest(),
                    "route_key": None
                    if window is None
                    else ref.route_key(k["route"], body["model"], salt, window).hex(),
                }
            )
        vectors["routes"].append(case)
    for first in PREFIX_FIRST_DEPTHS:
        digests = ref.prefix_digests(k["route"], "m", salt, PREFIX_FLAT, first)
        hexes = [d.hex() for d in digests]
        vectors["prefixes"].append(
            {"model": "m", "salt": salt, "first_depth": first, "digests": hexes}
        )
    for key in RANKING_KEYS:
        vectors["rankings"].append(
            {
                "route_key": key.hex(),
                # scores as C99 hex floats: exact, and parsed by float.fromhex / strtod
                "scores": {m: ref.rendezvous_score(key, m, w).hex() for m, w in RANKING_MEMBERS},
                "ranking": ref.rank(key, RANKING_MEMBERS),
            }
        )
    for key in MASTER_KEYS[:2]:
        k_kv = ref.subkeys(key)["kv_events"]
        vectors["kv"].append(
            {
                "master_key": key.hex(),
                # u64 values as 16 hex digits: JSON numbers past 2**53 do not survive everywhere
                "block_hashes": [
                    {"hash": f"{h:016x}", "keyed": f"{ref.kv_block_hash(k_kv, h):016x}"}
                    for h in KV_BLOCK_HASHES
                ],
                "replica_ids": {n: ref.kv_replica_id(k_kv, n) for n in KV_REPLICA_NAMES},
                "relay_public_key": ref.kv_relay_public_key(k_kv),
            }
        )
    for key in MASTER_KEYS[:2]:
        bus, stream = ref.cluster_bus(ref.subkeys(key)["route"])
        vectors["cluster"].append(
            {
                "master_key": key.hex(),
                "bus_key": bus.hex(),
                "stream": stream,
                "tags": {p.hex(): ref.cluster_tag(bus, p).hex() for p in CLUSTER_PAYLOADS},
            }
        )
    return vectors


def render(vectors: dict[str, Any]) -> str:
    """One vector per line: diffs stay readable, bodies stay compact."""

    def one(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))

    lines = ["{", f' "note": {one(vectors["note"])},']
    sections = ["subkeys", "salts", "routes", "prefixes", "rankings", "kv", "cluster"]
    for i, name in enumerate(sections):
        rows = ",\n  ".join(one(v) for v in vectors[name])
        end = "," if i < len(sections) - 1 else ""
        lines.append(f' "{name}": [\n  {rows}\n ]{end}')
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    OUT.write_text(render(build()), encoding="utf-8")
    print(f"wrote {OUT}")
