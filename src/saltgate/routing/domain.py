"""The routing domain's names: which policy routes, and which replica is meant.

A replica is named by its URL, the same on every gateway of a cluster; a route key and a
prefix digest are secret-keyed bytes minted by the derivations (`RouteKey`,
`PrefixDigest` in derivations/derive.py). Naming them keeps a URL, a key and a digest
from standing in for each other in a signature.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, NewType

ReplicaId = NewType("ReplicaId", str)


class Policy(StrEnum):
    """``[router] policy``: saltgate's own (router.py), or a baseline (baselines.py) the
    replay benchmark measures it against."""

    SALTGATE = "saltgate"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    CONSISTENT_HASH = "consistent_hash"


POLICIES: Final = tuple(p.value for p in Policy)
