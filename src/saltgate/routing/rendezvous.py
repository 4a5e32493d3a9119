"""Weighted rendezvous (highest random weight) ranking of replicas for a route key.

Every replica gets a score from a hash of (key, replica id); the ranking is the replicas
by descending score. Removing a replica moves only the keys it ranked first (about 1/n of
them), adding one takes about 1/(n+1), and every gateway computes the same ranking from
the same members (the score is spec v1: docs/spec.md, "Replica ranking"). Weights follow
the logarithmic method: score = weight / -ln(u) with u uniform in (0, 1), so a replica
ranks first for a share of keys equal to its share of the total weight. The key is the
secret route key, so no client can aim at a replica.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

from saltgate.derivations.encoding import lp
from saltgate.derivations.labels import RENDEZVOUS_DOMAIN
from saltgate.routing.domain import ReplicaId

_U_BITS = 52  # (2x + 1) / 2**53 is exact in a double and strictly inside (0, 1)


@dataclass(frozen=True, slots=True)
class Member:
    """A replica as the ranking sees it: a stable identity and a capacity weight."""

    id: ReplicaId
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight > 0 or math.isinf(self.weight):
            raise ValueError(f"replica weight must be a positive finite number, got {self.weight}")


def hrw_score(key: bytes, member: Member) -> float:
    """The member's weighted score for ``key``; higher ranks first."""
    digest = hashlib.sha256(RENDEZVOUS_DOMAIN + lp(key) + lp(member.id.encode("utf-8"))).digest()
    # The midpoint of one of 2**52 equal cells: u is never 0 or 1, so ln(u) is finite and < 0.
    x = int.from_bytes(digest[:8], "big") >> (64 - _U_BITS)
    u = (2 * x + 1) / 2.0 ** (_U_BITS + 1)
    return member.weight / -math.log(u)


def rank(key: bytes, members: Iterable[Member]) -> list[Member]:
    """Members by descending score; equal scores fall back to the id, so ties are decided
    the same way on every gateway and whatever order the replicas are listed in."""
    return sorted(members, key=lambda m: (-hrw_score(key, m), m.id))
