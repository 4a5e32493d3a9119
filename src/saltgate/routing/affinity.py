"""Which replica served a prompt prefix recently: the router's memory of where caches are.

The window key (spec v1) ranks replicas the same way on every gateway, but it cannot
follow a conversation that started short (no key, least-loaded) or a key whose traffic
was spread. This table maps the keyed prefix digests of each routed request
(spec.derive.prefix_digests) to the replica it went to; a later request that shares a
deep prefix goes back there while that replica is within the load cap. Bounded memory
(least recently used entries go first) and a time-to-live, since replicas evict too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

DEFAULT_MAX_ENTRIES: Final = 200_000


class PrefixAffinity:
    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def owners(self, digests: Sequence[bytes], now: float) -> list[str]:
        """Replicas that recently served these prefixes, deepest prefix first, no repeats."""
        found: list[str] = []
        for digest in reversed(digests):
            entry = self._owner.get(digest)
            if entry is None:
                continue
            replica_id, at = entry
            if now - at > self.ttl_s:
                del self._owner[digest]
            elif replica_id not in found:
                found.append(replica_id)
        return found

    def record(self, digests: Sequence[bytes], replica_id: str, now: float) -> None:
        """`replica_id` now holds (or is computing) every one of these prefixes."""
        owner = self._owner
        for digest in digests:
            owner[digest] = (replica_id, now)
            owner.move_to_end(digest)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
