"""The baseline policies that the replay benchmark measures saltgate's own policy against.

They live apart from router.py so that what saltgate decides reads on its own. Each one
leaves out something on purpose:
- ``round_robin``: the next usable replica in turn; ignores the prompt and the load.
- ``least_loaded``: the usable replica with the least load; ignores the prompt.
- ``consistent_hash``: plain rendezvous over SHA-256 of the route window (no secret), as
  a cache-aware router without one would; no hot-key spreading, no load or overload
  awareness. Keyless requests go to the least-loaded replica.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import Final

from saltgate.derivations.derive import RouteKey
from saltgate.routing.domain import Policy
from saltgate.routing.state import ReplicaState


def baseline_key(policy: Policy, window: bytes) -> RouteKey | None:
    """A baseline's routing key for a prompt's route window: consistent_hash's unkeyed
    digest, or none."""
    if policy is Policy.CONSISTENT_HASH:
        return RouteKey(hashlib.sha256(window).digest())
    return None


def baseline_pick(
    policy: Policy,
    key: RouteKey | None,
    rotation: Callable[[], list[ReplicaState]],
    ranked: Callable[[RouteKey], list[ReplicaState]],
) -> ReplicaState:
    """The replica a baseline picks; ``rotation``: the usable replicas, one further along
    at each call; ``ranked``: the usable replicas by rendezvous rank for a key."""
    if policy is Policy.ROUND_ROBIN:
        return rotation()[0]
    if key is None or policy is Policy.LEAST_LOADED:
        return min(rotation(), key=_load)
    return ranked(key)[0]


_load: Final = operator.attrgetter("load")
