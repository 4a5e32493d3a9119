"""Cache-aware, tenant-safe routing: a sans-IO core the gateway feeds with events.

Pure: imports nothing that performs I/O (docs/routing.md).
"""

from saltgate.routing.canary import CanaryRun, Outcome, Verdict, judge, new_run
from saltgate.routing.domain import POLICIES, Policy, ReplicaId
from saltgate.routing.health import (
    RUNNING_METRIC,
    Breaker,
    BreakerState,
    Overload,
    Probe,
    parse_gauge,
    parse_largest_step,
    parse_waiting,
)
from saltgate.routing.hotkeys import HotKeys, warm_set_size
from saltgate.routing.rendezvous import Member, hrw_score, rank
from saltgate.routing.router import Plan, Prefixes, Router, RouterConfig
from saltgate.routing.state import ReplicaState

__all__ = [
    "POLICIES",
    "RUNNING_METRIC",
    "Breaker",
    "BreakerState",
    "CanaryRun",
    "HotKeys",
    "Member",
    "Outcome",
    "Overload",
    "Plan",
    "Policy",
    "Prefixes",
    "Probe",
    "ReplicaId",
    "ReplicaState",
    "Router",
    "RouterConfig",
    "Verdict",
    "hrw_score",
    "judge",
    "new_run",
    "parse_gauge",
    "parse_largest_step",
    "parse_waiting",
    "rank",
    "warm_set_size",
]
