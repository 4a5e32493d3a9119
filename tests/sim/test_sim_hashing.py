"""saltgate.sim.hashing against every vector vLLM itself produced (hash_vectors.json)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from saltgate.sim import block_hashes, event_hash, get_hasher, none_hash, salt_extra_keys
from saltgate.sim.hashing import BlockHasher

pytestmark = pytest.mark.unit

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).parent / "vectors" / "vllm_hash_vectors.json").read_text(encoding="utf-8")
)
ALGO_CASES = [
    (algo, case) for algo, spec in VECTORS["algorithms"].items() for case in spec["cases"]
]
LIVE_CASES = VECTORS["live_server_crosscheck_block_size_32"]["cases"]


def test_vectors_cover_both_algorithms() -> None:
    assert set(VECTORS["algorithms"]) == {"sha256", "sha256_cbor"}
    assert len(ALGO_CASES) >= 12


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_none_hash_default_seed(algo: str) -> None:
    assert none_hash(algo).hex() == VECTORS["algorithms"][algo]["none_hash_hex"]


def test_none_hash_with_pythonhashseed_0() -> None:
    assert none_hash("sha256", "0").hex() == VECTORS["sha256_none_hash_hex_if_PYTHONHASHSEED_0"]
    assert none_hash("sha256", "0") != none_hash("sha256")


@pytest.mark.parametrize(
    ("algo", "case"), ALGO_CASES, ids=[f"{a}-{c['name']}" for a, c in ALGO_CASES]
)
def test_block_hashes_match_vllm(algo: str, case: dict[str, Any]) -> None:
    hashes = block_hashes(case["token_ids"], VECTORS["block_size"], case["cache_salt"], algo)
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    assert [event_hash(h) for h in hashes] == case["block_hashes_event_int64"]
    # Only full blocks are hashed.
    assert len(hashes) == len(case["token_ids"]) // VECTORS["block_size"]


@pytest.mark.parametrize("case", LIVE_CASES, ids=[c["name"] for c in LIVE_CASES])
def test_live_server_crosscheck(case: dict[str, Any]) -> None:
    hashes = block_hashes(
        case["token_ids"], case["block_size"], case["cache_salt"], case["hash_fn"]
    )
    assert [h.hex() for h in hashes] == case["block_hashes_hex"]
    ints = [event_hash(h) for h in hashes]
    assert ints == case["block_hashes_event_int64"]
    assert ints == case["observed_BlockStored_event"]["block_hashes"]


def test_event_hash_is_low_64_bits_big_endian() -> None:
    digest = bytes(range(32))
    assert event_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert event_hash(b"\xff" * 32) == 2**64 - 1


def test_unknown_algo_raises() -> None:
    with pytest.raises(ValueError, match="sha256_cbor"):
        block_hashes([1, 2, 3, 4], 2, algo="md5")
    with pytest.raises(ValueError, match="unknown"):
        BlockHasher("xxhash")


def test_bad_block_size_raises() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


def test_incremental_extend_equals_batch() -> None:
    hasher = get_hasher("sha256")
    tokens = list(range(100, 180))
    whole = hasher.block_hashes(tokens, 16, "s1")
    grown: list[bytes] = []
    for end in range(0, len(tokens) + 1, 5):
        hasher.extend(grown, tokens[:end], 16, "s1")
    assert grown == whole
    # The chain: each block's hash is H(parent, tokens, extra) with the salt on block 0 only.
    assert hasher.hash_block(None, tokens[:16], salt_extra_keys("s1")) == whole[0]
    assert hasher.hash_block(whole[0], tokens[16:32]) == whole[1]


def test_salt_changes_every_block_and_only_via_block_0() -> None:
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, "tenantA")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert block_hashes(tokens, 16, "tenantA") == salted


def test_salt_equal_to_tag_pickles_like_a_fresh_string() -> None:
    """pickle memoises by identity; a salt that IS the interned tag must not change the bytes."""
    hasher = get_hasher("sha256")
    fresh = "".join(["cache", "_salt"])  # a distinct object, as a JSON body gives vLLM
    obj = (hasher.none_hash, tuple(range(16)), (("cache_salt", fresh),))
    expected = hasher.digest(obj)
    assert pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL).count(b"cache_salt") == 2
    assert block_hashes(list(range(16)), 16, "cache_salt") == [expected]
