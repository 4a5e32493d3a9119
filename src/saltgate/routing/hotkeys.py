"""Per-key request rates with exponential decay, and the warm-set size they call for.

A key's rate is a decayed count: each request adds 1, and the count halves every
``half_life_s``. At a steady rate r the count settles at r * tau (tau = half_life / ln 2),
so count / tau estimates r without keeping timestamps. Memory is bounded: the least
recently seen keys are forgotten first (their decayed rate is the lowest anyway).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Final

DEFAULT_MAX_KEYS: Final = 65536


def warm_set_size(rate: float, per_replica_rate: float, replicas: int) -> int:
    """R = clamp(ceil(rate / per_replica_rate), 1, n): how many top-ranked replicas share a key."""
    if replicas <= 0:
        return 0
    wanted = math.ceil(rate / per_replica_rate) if rate > 0 else 1
    return max(1, min(wanted, replicas))


class HotKeys:
    """Decayed request counts per route key."""

    def __init__(self, half_life_s: float, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        if half_life_s <= 0:
            raise ValueError("half_life_s must be positive")
        if max_keys <= 0:
            raise ValueError("max_keys must be positive")
        self.tau = half_life_s / math.log(2)
        self.max_keys = max_keys
        self._counts: OrderedDict[bytes, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def _decayed(self, key: bytes, now: float) -> float:
        entry = self._counts.get(key)
        if entry is None:
            return 0.0
        count, at = entry
        return count * math.exp(-max(0.0, now - at) / self.tau)

    def observe(self, key: bytes, now: float) -> float:
        """Count one request for ``key`` at ``now`` (monotonic seconds); returns its rate."""
        count = self._decayed(key, now) + 1.0
        self._counts[key] = (count, now)
        self._counts.move_to_end(key)
        if len(self._counts) > self.max_keys:
            self._counts.popitem(last=False)
        return count / self.tau

    def add(self, key: bytes, now: float, count: float) -> None:
        """Count ``count`` requests that another gateway saw (routing/cluster.py)."""
        self._counts[key] = (self._decayed(key, now) + count, now)
        self._counts.move_to_end(key)
        if len(self._counts) > self.max_keys:
            self._counts.popitem(last=False)

    def rate(self, key: bytes, now: float) -> float:
        """Requests per second for ``key``, as of ``now``, without counting a request."""
        return self._decayed(key, now) / self.tau
