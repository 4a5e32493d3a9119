"""Cache-aware, tenant-safe routing: a sans-IO core the gateway feeds with events.

Pure: imports nothing that performs I/O (docs/routing.md).
"""

from saltgate.routing.health import Breaker, BreakerState, Overload, Probe, parse_waiting
from saltgate.routing.hotkeys import HotKeys, warm_set_size
from saltgate.routing.rendezvous import Member, hrw_score, rank
from saltgate.routing.router import POLICIES, Plan, Prefixes, ReplicaState, Router, RouterConfig

__all__ = [
    "POLICIES",
    "Breaker",
    "BreakerState",
    "HotKeys",
    "Member",
    "Overload",
    "Plan",
    "Prefixes",
    "Probe",
    "ReplicaState",
    "Router",
    "RouterConfig",
    "hrw_score",
    "parse_waiting",
    "rank",
    "warm_set_size",
]
