"""vLLM's prefix-block hashing, reproduced bit for bit (vllm/v1/core/kv_cache_utils.py).

A prompt is cut into blocks of ``block_size`` tokens; only FULL blocks are hashed. The hash
of block i chains from block i-1, so equal hashes mean equal prefixes::

    hash(i) = H((parent, tuple(block_token_ids), extra_keys))
    parent  = hash(i-1) as bytes, or NONE_HASH for block 0
    extra_keys = (("cache_salt", salt),) on block 0 when a salt is set, else None

``H`` serialises the object and takes SHA-256 of the bytes:

- ``sha256`` (vLLM's default): ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)``;
- ``sha256_cbor``: ``cbor2.dumps(obj, canonical=True)``.

``NONE_HASH = H(seed)`` where seed is the *string* ``"vllm-none-hash"`` or, when the vLLM
process runs with ``PYTHONHASHSEED`` set, that variable's string value (so
``PYTHONHASHSEED=0`` gives ``H("0")``). This module never reads the environment: callers
pass ``hash_seed`` (e.g. ``os.environ.get("PYTHONHASHSEED")``) to mirror a replica.

KV events carry a hash as an int: the low 64 bits of the big-endian digest
(:func:`event_hash`). Pinned by tests/sim/vectors/vllm_hash_vectors.json (vLLM 0.32.0).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from functools import lru_cache

import cbor2

__all__ = [
    "ALGORITHMS",
    "DEFAULT_HASH_SEED",
    "BlockHasher",
    "ExtraKeys",
    "block_hashes",
    "event_hash",
    "get_hasher",
    "none_hash",
    "salt_extra_keys",
]

ALGORITHMS = ("sha256", "sha256_cbor")
DEFAULT_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1

ExtraKeys = tuple[tuple[str, str], ...]
"""The extra keys this simulator produces: only the tagged cache salt."""


def _serialize_pickle(obj: object) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _serialize_cbor(obj: object) -> bytes:
    out: bytes = cbor2.dumps(obj, canonical=True)
    return out


_SERIALIZERS = {"sha256": _serialize_pickle, "sha256_cbor": _serialize_cbor}


def _check_algo(algo: str) -> None:
    if algo not in _SERIALIZERS:
        raise ValueError(
            f"unknown prefix-caching hash algorithm {algo!r}; "
            f"use one of {', '.join(ALGORITHMS)} (vLLM's --prefix-caching-hash-algo)"
        )


def _fresh_str(s: str) -> str:
    """A new str object equal to ``s``.

    pickle memoises objects by identity: if the salt were the very object ``"cache_salt"``
    (an interned literal) the pickle would contain a back-reference where vLLM's (whose salt
    comes from a JSON body, a distinct object) contains the string again.
    """
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass")


def salt_extra_keys(cache_salt: str | None) -> ExtraKeys | None:
    """Block 0's extra keys for ``cache_salt`` (tagged, as vLLM >= 0.32 hashes it)."""
    if cache_salt is None:
        return None
    return (("cache_salt", _fresh_str(cache_salt)),)


def event_hash(digest: bytes) -> int:
    """The int a KV event carries for ``digest``: its low 64 bits, read big-endian."""
    return int.from_bytes(digest, "big") & _U64


class BlockHasher:
    """Hashes blocks for one (algorithm, NONE_HASH seed) pair; cheap to keep around."""

    __slots__ = ("_serialize", "algo", "none_hash")

    def __init__(self, algo: str = "sha256", hash_seed: str | None = None) -> None:
        _check_algo(algo)
        self.algo = algo
        self._serialize = _SERIALIZERS[algo]
        seed = DEFAULT_HASH_SEED if hash_seed is None else hash_seed
        self.none_hash: bytes = self.digest(seed)

    def digest(self, obj: object) -> bytes:
        """H(obj): serialise, then SHA-256."""
        return hashlib.sha256(self._serialize(obj)).digest()

    def hash_block(
        self,
        parent: bytes | None,
        token_ids: Sequence[int],
        extra_keys: ExtraKeys | None = None,
    ) -> bytes:
        """The hash of one full block given its parent's hash (None for block 0)."""
        parent_bytes = self.none_hash if parent is None else parent
        return self.digest((parent_bytes, tuple(token_ids), extra_keys))

    def extend(
        self,
        hashes: list[bytes],
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes``.

        ``hashes`` must be the hashes of the first ``len(hashes)`` blocks of the same
        sequence; this lets a request hash decode-time blocks as they fill. Returns the
        newly appended hashes.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        start = len(hashes)
        num_full = len(token_ids) // block_size
        parent = hashes[-1] if hashes else None
        for i in range(start, num_full):
            extra = salt_extra_keys(cache_salt) if i == 0 else None
            parent = self.hash_block(
                parent, token_ids[i * block_size : (i + 1) * block_size], extra
            )
            hashes.append(parent)
        return hashes[start:]

    def block_hashes(
        self, token_ids: Sequence[int], block_size: int, cache_salt: str | None = None
    ) -> list[bytes]:
        """Hashes of every full block of ``token_ids``."""
        out: list[bytes] = []
        self.extend(out, token_ids, block_size, cache_salt)
        return out


@lru_cache(maxsize=16)
def get_hasher(algo: str = "sha256", hash_seed: str | None = None) -> BlockHasher:
    """A shared :class:`BlockHasher` (NONE_HASH is computed once per algo and seed)."""
    return BlockHasher(algo, hash_seed)


def none_hash(algo: str = "sha256", hash_seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: the parent of block 0."""
    return get_hasher(algo, hash_seed).none_hash


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    algo: str = "sha256",
    hash_seed: str | None = None,
) -> list[bytes]:
    """vLLM's block hashes (32-byte digests) of the full blocks of ``token_ids``."""
    return get_hasher(algo, hash_seed).block_hashes(token_ids, block_size, cache_salt)
