"""Which replica served a prompt prefix recently: the router's memory of where caches are.

The window key (spec v1) ranks replicas the same way on every gateway, but it cannot
follow a conversation that started short (no key, least-loaded) or a key whose traffic
was spread. This table maps the keyed prefix digests of each routed request
(derivations.derive.NamespaceKeys.prefix_digests) to the replica it went to; a later
request that shares a deep prefix goes back there while that replica is within the load
cap. Bounded memory (least recently used entries go first) and a time-to-live, since
replicas evict too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from saltgate.derivations.derive import PrefixDigest
from saltgate.routing.domain import ReplicaId

DEFAULT_MAX_ENTRIES: Final = 200_000


class PrefixAffinity:
    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._owner: OrderedDict[PrefixDigest, tuple[ReplicaId, float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def owners(
        self, digests: Sequence[PrefixDigest], now: float
    ) -> list[tuple[ReplicaId, int, int]]:
        """(replica, index of the deepest digest it holds, length of the prompt that left
        it there) for the replicas that recently served these prefixes, deepest first,
        each replica once."""
        found: list[tuple[ReplicaId, int, int]] = []
        seen: set[ReplicaId] = set()
        for index in range(len(digests) - 1, -1, -1):
            entry = self._owner.get(digests[index])
            if entry is None:
                continue
            replica_id, at, length = entry
            if now - at > self.ttl_s:
                del self._owner[digests[index]]
            elif replica_id not in seen:
                seen.add(replica_id)
                found.append((replica_id, index, length))
        return found

    def record(
        self,
        digests: Sequence[PrefixDigest],
        replica_id: ReplicaId,
        now: float,
        prompt_bytes: int = 0,
    ) -> None:
        """`replica_id` now holds (or is computing) every one of these prefixes, of a
        prompt of ``prompt_bytes``."""
        owner = self._owner
        for digest in digests:
            owner[digest] = (replica_id, now, prompt_bytes)
            owner.move_to_end(digest)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)

    def learn(
        self, digests: Sequence[PrefixDigest], replica_id: ReplicaId, at: float, prompt_bytes: int
    ) -> None:
        """Another gateway's placement made at ``at``: it replaces only older entries, so
        two gateways that placed one prefix at nearly the same time both end up keeping
        the later placement."""
        owner = self._owner
        for digest in digests:
            entry = owner.get(digest)
            if entry is None or entry[1] <= at:
                owner[digest] = (replica_id, at, prompt_bytes)
                owner.move_to_end(digest)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
