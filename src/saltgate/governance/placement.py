"""Which replicas may take a request now: the saturation gate's decision over the
router's usable replicas (docs/fairness.md).

Pure, like the rest of governance; its own module so that the compiled build compiles it
with the request path (buildinfo.py): it runs for every request the fair queue serves.
"""

from __future__ import annotations

from collections.abc import Sequence

from saltgate.governance.fairness import SaturationGate
from saltgate.governance.limits import BYTES_PER_TOKEN
from saltgate.routing import Plan, ReplicaState


def placeable(
    gate: SaturationGate, usable: Sequence[ReplicaState], plan: Plan
) -> list[ReplicaState]:
    """The replicas among ``usable`` (the router's, for the plan's model) that the gate
    lets take the request now, in their order: the router picks among them. Empty while
    every one is held back, so the request waits for its turn. Each replica's load is
    every gateway's: its requests in flight, and its prompt bytes not yet prefilled (at
    most, cluster-wide) and the request's own uncached ones, both as tokens."""
    return [
        s
        for s in usable
        if not gate.saturated(
            s.id,
            s.all_inflight,
            (s.prefill_at_most + s.remote_prefill) / BYTES_PER_TOKEN,
            plan.uncached_at_most(s.id) / BYTES_PER_TOKEN,
        )
    ]
