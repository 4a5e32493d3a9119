"""What the router knows about one replica: its member entry, health and load.

Apart from router.py because the baseline policies (baselines.py) read it too.
"""

from __future__ import annotations

from saltgate.routing.health import ReplicaHealth
from saltgate.routing.rendezvous import Member


class ReplicaState:
    """What the router knows about one replica. ``load`` is an attribute kept current as
    requests start and finish: every decision reads it several times per replica."""

    __slots__ = (
        "_inflight",
        "_remote_inflight",
        "health",
        "id",
        "load",
        "member",
        "models",
        "prefill",
        "prefill_at_most",
        "remote_prefill",
    )

    def __init__(self, member: Member, health: ReplicaHealth) -> None:
        self.id = member.id
        self.member = member
        self.health = health
        self._inflight = 0
        self._remote_inflight = 0  # the other gateways' (cluster bus), 0 without one
        self.load = 0.0  # in-flight requests (all gateways') per unit of capacity weight
        # Prompt bytes sent here and not yet prefilled: likely (routing weighs it) and at
        # most (a cached prefix counted only as far as proven: the saturation gate's budget).
        self.prefill = 0.0
        self.prefill_at_most = 0.0
        self.remote_prefill = 0.0  # ... by the other gateways of the cluster
        # The model names it serves (`Router.set_models`); None (unknown) until it is told.
        self.models: frozenset[str] | None = None

    def __repr__(self) -> str:
        return f"ReplicaState({self.id!r}, inflight={self._inflight}, prefill={self.prefill:.0f})"

    @property
    def inflight(self) -> int:
        """This gateway's requests in flight on the replica."""
        return self._inflight

    @inflight.setter
    def inflight(self, value: int) -> None:
        self._inflight = value
        self.load = (value + self._remote_inflight) / self.member.weight

    @property
    def all_inflight(self) -> int:
        """Every gateway's requests in flight on the replica (this one's and the bus's)."""
        return self._inflight + self._remote_inflight

    def set_remote(self, inflight: int, prefill: float) -> None:
        """The other gateways' load on this replica, as the cluster bus last told it."""
        self._remote_inflight = inflight
        self.remote_prefill = prefill
        self.load = (self._inflight + inflight) / self.member.weight

    def set_member(self, member: Member) -> None:
        """The same replica with a (possibly) new weight."""
        self.member = member
        self.load = (self._inflight + self._remote_inflight) / member.weight
