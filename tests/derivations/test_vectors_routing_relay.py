"""Spec v1 beyond salts and route keys: prefix digests, the replica ranking, the KV
relay's keyed hashes, replica ids and CURVE key, and the cluster bus's key, stream name
and tag. Pinned like the rest: against the independent implementation (reference.py) and
against the stored vectors, so a changed label or step fails here."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from tests.support.leaks import leaks

from saltgate.derivations import derive_subkeys
from saltgate.derivations.derive import NamespaceKeys, cluster_keys
from saltgate.kvevents.relay import relay_server_keys
from saltgate.kvevents.sanitize import keyed_block_hash, opaque_replica_id
from saltgate.routing.domain import ReplicaId
from saltgate.routing.rendezvous import Member, hrw_score, rank

from . import reference as ref
from .cases import CLUSTER_PAYLOADS, MASTER_KEYS, PREFIX_FLAT, RANKING_MEMBERS

pytestmark = pytest.mark.unit

VECTORS: dict[str, Any] = json.loads(
    Path(__file__).with_name("vectors_v1.json").read_text(encoding="utf-8")
)
MEMBERS = [Member(ReplicaId(mid), w) for mid, w in RANKING_MEMBERS]


# -- the reference itself is right ------------------------------------------------------


def test_reference_x25519_matches_rfc7748() -> None:
    # RFC 7748 section 6.1: Alice's key pair.
    alice = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    public = ref.x25519(alice, (9).to_bytes(32, "little"))
    assert public.hex() == "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    # Section 5.2, first vector: an arbitrary u-coordinate.
    k = bytes.fromhex("a546e36bf0527c9d3b16154b82465edd62144c0ac1fc5a18506a2244ba449ac4")
    u = bytes.fromhex("e6db6867583030db3594c1a424b15f7c726624ec26b3353b10a903a6d0ab1c4c")
    assert ref.x25519(k, u).hex() == (
        "c3da55379de9c6908e94ea4df28d084f32eccf03491c71f754b4075577a28552"
    )


def test_reference_z85_matches_zeromq_rfc32() -> None:
    assert ref.z85(bytes.fromhex("864FD26FB559F75B")) == "HelloWorld"


# -- package == independent implementation ----------------------------------------------


def test_rendezvous_scores_and_ranking_match_reference() -> None:
    rng = random.Random(11)
    for _ in range(300):
        key = rng.randbytes(32)
        weights = [rng.choice([1.0, 0.25, 3.0, 1e-3]) for _ in range(rng.randint(1, 6))]
        members = [
            Member(ReplicaId(f"http://10.0.{rng.randint(0, 9)}.{i}:8000"), w)
            for i, w in enumerate(weights)
        ]
        for m in members:
            assert hrw_score(key, m) == ref.rendezvous_score(key, m.id, m.weight)
        expected = ref.rank(key, [(m.id, m.weight) for m in members])
        assert [m.id for m in rank(key, members)] == expected


def test_prefix_digests_match_reference() -> None:
    k_route = derive_subkeys(MASTER_KEYS[1]).route
    keys = NamespaceKeys(k_route, "model-ü", "sg1_salt")
    for first in (1, 7, 100, 1024, len(PREFIX_FLAT), len(PREFIX_FLAT) + 1):
        got = keys.prefix_digests(PREFIX_FLAT, first)
        assert got == ref.prefix_digests(k_route, "model-ü", "sg1_salt", PREFIX_FLAT, first)
    assert len(keys.prefix_digests(PREFIX_FLAT, 1024)) >= 2  # more than one depth checked


def test_kv_relay_derivations_match_reference() -> None:
    rng = random.Random(5)
    for master in MASTER_KEYS:
        k_kv = derive_subkeys(master).kv_events
        assert relay_server_keys(k_kv).public == ref.kv_relay_public_key(k_kv)
        for h in [0, 2**64 - 1, *(rng.getrandbits(64) for _ in range(200))]:
            assert keyed_block_hash(k_kv, h) == ref.kv_block_hash(k_kv, h)
        for name in ("tcp://10.0.0.5:5557", "", "ipc:///tmp/ü", "x" * 300):
            assert opaque_replica_id(k_kv, name) == ref.kv_replica_id(k_kv, name)


# -- package == stored vectors -----------------------------------------------------------


def test_stored_prefix_digests() -> None:
    k_route = derive_subkeys(MASTER_KEYS[0]).route
    assert VECTORS["prefixes"]
    for v in VECTORS["prefixes"]:
        digests = NamespaceKeys(k_route, v["model"], v["salt"]).prefix_digests(
            PREFIX_FLAT, v["first_depth"]
        )
        assert [d.hex() for d in digests] == v["digests"]


def test_stored_rankings() -> None:
    assert len(VECTORS["rankings"]) >= 4
    for v in VECTORS["rankings"]:
        key = bytes.fromhex(v["route_key"])
        scores = {m.id: hrw_score(key, m) for m in MEMBERS}
        assert scores == {m: float.fromhex(x) for m, x in v["scores"].items()}
        assert [m.id for m in rank(key, MEMBERS)] == v["ranking"]
        assert [m.id for m in rank(key, reversed(MEMBERS))] == v["ranking"]  # order-free


@pytest.mark.parametrize("index", range(2))
def test_stored_kv_relay_vectors(index: int) -> None:
    v = VECTORS["kv"][index]
    k_kv = derive_subkeys(bytes.fromhex(v["master_key"])).kv_events
    for pair in v["block_hashes"]:
        assert f"{keyed_block_hash(k_kv, int(pair['hash'], 16)):016x}" == pair["keyed"]
    for name, rid in v["replica_ids"].items():
        assert opaque_replica_id(k_kv, name) == rid
    assert relay_server_keys(k_kv).public == v["relay_public_key"]


def test_cluster_bus_derivations_match_reference() -> None:
    for master in MASTER_KEYS:
        keys = cluster_keys(derive_subkeys(master).route)
        bus, stream = ref.cluster_bus(derive_subkeys(master).route)
        assert (keys.bus, keys.stream) == (bus, stream)
        for payload in CLUSTER_PAYLOADS:
            assert keys.tag(payload) == ref.cluster_tag(bus, payload)


@pytest.mark.parametrize("index", range(2))
def test_stored_cluster_vectors(index: int) -> None:
    v = VECTORS["cluster"][index]
    keys = cluster_keys(derive_subkeys(bytes.fromhex(v["master_key"])).route)
    assert keys.bus.hex() == v["bus_key"] and keys.stream == v["stream"]
    for payload, tag in v["tags"].items():
        assert keys.tag(bytes.fromhex(payload)).hex() == tag
    assert not leaks(repr(keys), bus_key=keys.bus)
