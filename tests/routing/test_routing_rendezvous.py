"""Weighted rendezvous ranking: weights, determinism, order independence, minimal movement."""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter

import pytest

from saltgate.routing import Member, ReplicaId, hrw_score, rank

pytestmark = pytest.mark.unit


def keys(count: int, seed: str = "k") -> list[bytes]:
    return [hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(count)]


def top(key: bytes, members: list[Member]) -> str:
    return rank(key, members)[0].id


def test_each_replica_ranks_first_for_its_share_of_the_weight() -> None:
    members = [
        Member(ReplicaId("a"), 1.0),
        Member(ReplicaId("b"), 2.0),
        Member(ReplicaId("c"), 3.0),
        Member(ReplicaId("d"), 4.0),
    ]
    n = 20000
    counts = Counter(top(k, members) for k in keys(n))
    for m in members:
        # Binomial sd <= 0.0035 here; 0.015 is > 4 sd, and a weight-blind hash (0.25) fails.
        assert abs(counts[m.id] / n - m.weight / 10.0) < 0.015, counts


def test_ranking_ignores_the_order_replicas_are_listed_in() -> None:
    members = [Member(ReplicaId(f"http://10.0.0.{i}:8000"), 1.0 + i % 3) for i in range(5)]
    for key in keys(50):
        expected = [m.id for m in rank(key, members)]
        for perm in itertools.islice(itertools.permutations(members), 0, 120, 7):
            assert [m.id for m in rank(key, list(perm))] == expected


def weight_for_score(key: bytes, member_id: str, score: float) -> float | None:
    """A weight giving ``member_id`` exactly ``score`` for ``key`` (the score is the weight
    over a per-member constant, so stepping the weight by ulps reaches it), or None."""
    weight = score / hrw_score(key, Member(ReplicaId(member_id)))
    for _ in range(64):
        got = hrw_score(key, Member(ReplicaId(member_id), weight))
        if got == score:
            return weight
        weight = math.nextafter(weight, math.inf if got < score else -math.inf)
    return None


def test_equal_scores_are_ordered_by_id() -> None:
    # Real ties, not a patched score (the compiled build would not see a patch): weights
    # that give three members exactly the same score for this key.
    key = b"k0"
    score = hrw_score(key, Member(ReplicaId("a")))
    weight_b, weight_c = weight_for_score(key, "b", score), weight_for_score(key, "c", score)
    assert weight_b is not None and weight_c is not None
    members = [
        Member(ReplicaId("c"), weight_c),
        Member(ReplicaId("a")),
        Member(ReplicaId("b"), weight_b),
    ]
    assert {hrw_score(key, m) for m in members} == {score}
    assert [m.id for m in rank(key, members)] == ["a", "b", "c"]
    assert [m.id for m in rank(key, members[::-1])] == ["a", "b", "c"]


def test_removing_one_of_n_moves_only_its_keys_about_one_in_n() -> None:
    n = 10
    members = [Member(ReplicaId(f"r{i}")) for i in range(n)]
    sample = keys(20000)
    before = {k: top(k, members) for k in sample}
    gone = "r3"
    after = {k: top(k, [m for m in members if m.id != gone]) for k in sample}
    moved = [k for k in sample if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)  # nobody else's keys move
    assert all(after[k] == before[k] for k in sample if before[k] != gone)
    assert abs(len(moved) / len(sample) - 1 / n) < 0.01
    # Adding a replica takes about 1/(n+1) of the keys, all of them to the new one.
    grown = {k: top(k, [*members, Member(ReplicaId("r10"))]) for k in sample}
    moved = [k for k in sample if grown[k] != before[k]]
    assert all(grown[k] == "r10" for k in moved)
    assert abs(len(moved) / len(sample) - 1 / (n + 1)) < 0.01


def test_weights_must_be_positive_and_finite() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight"):
            Member(ReplicaId("r"), bad)
