"""Per-key rates with decay and the warm-set size."""

from __future__ import annotations

import pytest

from saltgate.routing import HotKeys, warm_set_size

pytestmark = pytest.mark.unit


def test_a_steady_rate_is_estimated() -> None:
    hot = HotKeys(half_life_s=2.0)
    rate = 0.0
    for i in range(400):  # 10 requests/s for 40 s: 20 half-lives, the estimate has settled
        rate = hot.observe(b"k", i / 10)
    assert 9.0 < rate < 11.0
    assert hot.rate(b"other", 40.0) == 0.0


def test_the_rate_halves_every_half_life_without_requests() -> None:
    hot = HotKeys(half_life_s=2.0)
    for i in range(400):
        hot.observe(b"k", i / 10)
    at = 39.9
    assert hot.rate(b"k", at + 2.0) == pytest.approx(hot.rate(b"k", at) / 2)
    assert hot.rate(b"k", at + 20.0) < 0.01


def test_memory_is_bounded_by_forgetting_the_least_recently_seen() -> None:
    hot = HotKeys(half_life_s=1.0, max_keys=3)
    for i, key in enumerate((b"a", b"b", b"c", b"a", b"d")):
        hot.observe(key, float(i))
    assert len(hot) == 3
    assert hot.rate(b"b", 5.0) == 0.0  # b was the least recently seen
    assert hot.rate(b"a", 5.0) > 0.0


@pytest.mark.parametrize(
    ("rate", "per_replica", "n", "expected"),
    [(0.0, 4.0, 5, 1), (3.9, 4.0, 5, 1), (4.1, 4.0, 5, 2), (12.0, 4.0, 5, 3), (100.0, 4.0, 5, 5)],
)
def test_warm_set_is_clamped_ceil_of_rate_over_per_replica_rate(
    rate: float, per_replica: float, n: int, expected: int
) -> None:
    assert warm_set_size(rate, per_replica, n) == expected
