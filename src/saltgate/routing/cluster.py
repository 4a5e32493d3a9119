"""Routing state shared by the gateways of a cluster, sans-IO: what goes on the bus, and
what a gateway does with what arrives.

With N gateways behind a round-robin balancer each one sees 1/N of every conversation,
of every hot key and of every replica's backlog. Each gateway therefore sends the others,
in batches off the request path (gateway/cluster.py does the I/O):

- placements: the keyed prefix digests of each routed request, the replica it went to,
  the prompt's length and how long the placement stays valid (routing/affinity.py);
- route keys seen, with counts, so a hot key is hot on every gateway (routing/hotkeys.py);
- its own per-replica backlog: requests in flight and prompt bytes not yet prefilled
  (at most: a cached prefix counted only as far as a digest proves it);
- with [queue], the service its fair queue charged each tenant since its last batch
  (tenant id -> the counter's move: governance/fairness.py, `FairQueue.take_charged`).

and applies the others' to its router: placements into the affinity table (the newer of
two wins, so gateways converge), counts into the key rates, backlogs summed per replica
beside its own (`Router.set_remote_load`), service into its fair queue's counters
(`FairQueue.charge_elsewhere`: the counters are the fleet's). A gateway that goes silent
for ``backlog_ttl_s`` stops counting: its backlog is dropped, and if the bus itself is
down each gateway routes on its own state until it returns.

What a batch holds is only keyed digests (SHA-256 under K_route: docs/spec.md, 7), route
keys (HMAC under K_route), replica ids (their URLs), the sender's gateway id, tenant ids
(the ids metrics label by, never a name or a key) and numbers: no salt, prompt, token or
API key, and nothing a reader could test a guess against without the master key. Each
batch is tagged under K_bus (docs/spec.md, 11); batches that do not verify are dropped
and counted.
"""

from __future__ import annotations

import hmac
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, NamedTuple, Protocol
from urllib.parse import urlsplit

import msgpack

from saltgate.derivations.derive import CLUSTER_TAG_BYTES, ClusterKeys, PrefixDigest, RouteKey
from saltgate.routing.domain import ReplicaId
from saltgate.routing.router import Router
from saltgate.tables import check_keys, toml_string

# Version 2 adds the service charged per tenant; a batch without any is still written as
# version 1 (byte for byte what a version-1 gateway writes and reads), and both are read.
WIRE_VERSION: Final = 2
WIRE_VERSION_NO_SERVICE: Final = 1
DIGEST_BYTES: Final = 32
HEARTBEAT_S: Final = 0.5  # a silent gateway still sends its backlog this often
MAX_BATCH_PLACEMENTS: Final = 4096  # per batch; the rest wait for the next one
MAX_PENDING_PLACEMENTS: Final = 65_536  # kept while the bus is down; oldest dropped beyond
MAX_SENDERS: Final = 4096  # senders whose last sequence number is remembered
MAX_TENANT_ID: Final = 64  # characters: a tenant id is "tn_" and 16 hex digits

_GATEWAY_ID: Final = re.compile(r"[A-Za-z0-9._:-]{1,64}")
_KEYS: Final = frozenset(
    {"url", "password_file", "password_env", "gateway_id", "publish_interval_s", "backlog_ttl_s"}
)


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """A parsed ``[cluster]`` table (docs/deployment.md). The URL never holds a password:
    ``password_file`` (read at each connection, so a rotated file takes effect at the
    next one) or ``password_env`` does."""

    url: str
    gateway_id: str | None = None  # None: the host's name (a pod's, under Kubernetes)
    password_file: Path | None = None
    password_env: str | None = None
    publish_interval_s: float = 0.001  # at most one batch this often (sooner is not sent)
    backlog_ttl_s: float = 2.0

    @classmethod
    def from_table(cls, table: Mapping[str, Any], base: Path) -> ClusterSettings:
        """Validate ``[cluster]``; relative paths start at ``base``. ValueError("key: ...")."""
        check_keys(table, _KEYS)
        if "url" not in table:
            raise ValueError("url: missing")
        for key in ("url", "gateway_id", "password_file", "password_env"):
            if key in table and (not isinstance(table[key], str) or not table[key]):
                raise ValueError(f"{key}: expected a non-empty string")
        url = table["url"]
        _check_redis_url(url)
        gateway_id = table.get("gateway_id")
        if gateway_id is not None and not _GATEWAY_ID.fullmatch(gateway_id):
            raise ValueError(
                "gateway_id: 1-64 characters of letters, digits and . _ : - (it names this "
                "gateway on the bus)"
            )
        if "password_file" in table and "password_env" in table:
            raise ValueError("password_file: give password_file or password_env, not both")
        settings = cls(
            url,
            gateway_id,
            password_file=_path(table.get("password_file"), base),
            password_env=table.get("password_env"),
            **_positive_numbers(table, ("publish_interval_s", "backlog_ttl_s")),
        )
        if settings.backlog_ttl_s < 2 * HEARTBEAT_S:
            raise ValueError(
                f"backlog_ttl_s: must be at least {2 * HEARTBEAT_S} s (twice the heartbeat)"
            )
        return settings

    def toml(self) -> str:
        """These settings as a `[cluster]` table (paths absolute), for generated configs."""
        lines = [f"url = {toml_string(self.url)}"]
        if self.gateway_id is not None:
            lines.append(f"gateway_id = {toml_string(self.gateway_id)}")
        if self.password_file is not None:
            lines.append(f"password_file = {toml_string(str(self.password_file))}")
        if self.password_env is not None:
            lines.append(f"password_env = {toml_string(self.password_env)}")
        lines.append(f"publish_interval_s = {self.publish_interval_s!r}")
        lines.append(f"backlog_ttl_s = {self.backlog_ttl_s!r}")
        return "[cluster]\n" + "\n".join(lines) + "\n"


def _positive_numbers(table: Mapping[str, Any], keys: Sequence[str]) -> dict[str, float]:
    numbers: dict[str, float] = {}
    for key in keys:
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key}: expected a number")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key}: must be a positive number")
            numbers[key] = float(value)
    return numbers


def _path(value: str | None, base: Path) -> Path | None:
    if value is None:
        return None
    path = Path(value)
    return path if path.is_absolute() else base / path


def _check_redis_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(
            "url: expected redis://[user@]host:port[/db] or rediss:// (TLS), "
            f"got scheme {parts.scheme or '(none)'}"
        )
    if not parts.hostname:
        raise ValueError("url: names no host")
    userinfo, at, _ = parts.netloc.rpartition("@")
    if (at and ":" in userinfo) or "password=" in parts.query:
        raise ValueError(
            "url: do not put the password in the URL; use password_file or password_env "
            "(the URL with its password is not shown)"
        )


# -- the wire ------------------------------------------------------------------------------


class Placement(NamedTuple):
    """One routed request: its prefix digests (shallow first), where it went, its prompt's
    length in bytes and the seconds it stays valid."""

    digests: tuple[PrefixDigest, ...]
    replica: ReplicaId
    prompt_bytes: int
    ttl_s: float


class Backlog(NamedTuple):
    """One gateway's own load on one replica."""

    replica: ReplicaId
    inflight: int
    prefill: float


@dataclass(frozen=True, slots=True)
class Batch:
    sender: str
    seq: int
    placements: tuple[Placement, ...] = ()
    keys: tuple[tuple[RouteKey, int], ...] = ()
    backlog: tuple[Backlog, ...] = ()
    service: tuple[tuple[str, float], ...] = ()  # (tenant id, counter move) since the last


class BadBatch(ValueError):
    """A bus message that does not verify or does not parse (never applied)."""


def encode_batch(keys: ClusterKeys, batch: Batch) -> bytes:
    """msgpack ``[version, sender, seq, replicas, placements, keys, backlog, service]`` +
    tag, where replicas lists each replica id once and the others refer to it by index:
    placements ``[replica, prompt_bytes, ttl_ms, digests concatenated]``, keys
    ``[route_key, count]``, backlog ``[replica, inflight, prefill_bytes]``, service
    ``[tenant_id, amount]``. Without service: version 1, which ends at backlog."""
    index: dict[str, int] = {}

    def ref(replica: str) -> int:
        return index.setdefault(replica, len(index))

    placements = [
        [ref(p.replica), p.prompt_bytes, round(p.ttl_s * 1000), b"".join(p.digests)]
        for p in batch.placements
    ]
    backlog = [[ref(b.replica), b.inflight, round(b.prefill)] for b in batch.backlog]
    doc: list[Any] = [
        WIRE_VERSION if batch.service else WIRE_VERSION_NO_SERVICE,
        batch.sender,
        batch.seq,
        list(index),
        placements,
        [[k, n] for k, n in batch.keys],
        backlog,
    ]
    if batch.service:
        doc.append([[tenant, float(amount)] for tenant, amount in batch.service])
    payload: bytes = msgpack.packb(doc)
    return payload + keys.tag(payload)


def decode_batch(keys: ClusterKeys, data: bytes) -> Batch:
    """The batch in ``data``, its tag checked first (constant time); BadBatch otherwise."""
    if len(data) <= CLUSTER_TAG_BYTES:
        raise BadBatch("too short")
    payload, tag = data[:-CLUSTER_TAG_BYTES], data[-CLUSTER_TAG_BYTES:]
    if not hmac.compare_digest(keys.tag(payload), tag):
        raise BadBatch("tag does not verify (another cluster's, or forged)")
    try:
        doc = msgpack.unpackb(payload, use_list=True, raw=False, strict_map_key=True)
        if not isinstance(doc, list) or not doc:
            raise BadBatch("not a list")
        version = doc[0]
        if version == WIRE_VERSION_NO_SERVICE:
            _, sender, seq, replicas, placements, route_keys, backlog = doc
            service = []
        elif version == WIRE_VERSION:
            _, sender, seq, replicas, placements, route_keys, backlog, service = doc
        else:
            raise BadBatch(
                f"wire version {version!r}, expected {WIRE_VERSION_NO_SERVICE} or {WIRE_VERSION}"
            )
        if not (isinstance(sender, str) and isinstance(seq, int)):
            raise BadBatch("bad sender or sequence number")
        if not all(isinstance(r, str) for r in replicas):
            raise BadBatch("bad replica list")
        return Batch(
            sender,
            seq,
            tuple(_placement(p, replicas) for p in placements),
            tuple(_key(k) for k in route_keys),
            tuple(
                Backlog(ReplicaId(replicas[r]), _count(n), float(_count(b))) for r, n, b in backlog
            ),
            tuple(_service(s) for s in service),
        )
    except BadBatch:
        raise
    except (ValueError, TypeError, IndexError, msgpack.ExtraData) as exc:
        raise BadBatch(f"malformed: {type(exc).__name__}") from None


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadBatch("a count is not a non-negative integer")
    return value


def _placement(item: Any, replicas: Sequence[str]) -> Placement:
    replica, prompt_bytes, ttl_ms, joined = item
    if not isinstance(joined, bytes) or not joined or len(joined) % DIGEST_BYTES:
        raise BadBatch("digests are not whole 32-byte digests")
    digests = tuple(
        PrefixDigest(joined[i : i + DIGEST_BYTES]) for i in range(0, len(joined), DIGEST_BYTES)
    )
    return Placement(
        digests, ReplicaId(replicas[replica]), _count(prompt_bytes), _count(ttl_ms) / 1000.0
    )


def _service(item: Any) -> tuple[str, float]:
    tenant, amount = item
    if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_ID:
        raise BadBatch("a tenant id is not a short string")
    if isinstance(amount, bool) or not isinstance(amount, int | float):
        raise BadBatch("a service amount is not a number")
    if not math.isfinite(amount):
        raise BadBatch("a service amount is not finite")
    return tenant, float(amount)


def _key(item: Any) -> tuple[RouteKey, int]:
    key, count = item
    if not isinstance(key, bytes) or len(key) != DIGEST_BYTES:
        raise BadBatch("a route key is not 32 bytes")
    return RouteKey(key), _count(count)


# -- one gateway's side ------------------------------------------------------------------


class FairCounters(Protocol):
    """The fair queue's side of the bus (governance/fairness.py `FairQueue`)."""

    def take_charged(self) -> dict[str, float]: ...

    def charge_elsewhere(self, tenant: str, amount: float) -> None: ...


@dataclass(slots=True)
class _Peer:
    heard_at: float
    backlog: dict[str, Backlog] = field(default_factory=dict)


class ClusterState:
    """The shared part of one gateway's router: batches out, batches in.

    ``sender`` names this process on the bus (the gateway id and a random suffix drawn at
    start: a worker, or a restarted gateway, is a peer of its own, even where every
    container's process id is 1). The caller supplies the clock. ``fair``: the fair
    queue's counters to share ([queue]); None: no service sent, and what others send is
    not applied (each gateway then orders its queue by its own service alone).
    """

    def __init__(
        self,
        router: Router,
        keys: ClusterKeys,
        sender: str,
        *,
        backlog_ttl_s: float = 2.0,
        fair: FairCounters | None = None,
    ) -> None:
        self.router = router
        self.keys = keys
        self.sender = sender
        self.fair = fair
        self.backlog_ttl_s = backlog_ttl_s
        self._seq = 0
        self._peers: dict[str, _Peer] = {}
        self._heard: dict[str, int] = {}  # sender -> the highest sequence number applied
        self._last_backlog: tuple[Backlog, ...] = ()
        self._last_sent = -math.inf
        self.received = 0  # batches applied
        self.rejected = 0  # batches that did not verify or parse
        router.start_sharing()

    # -- out ---------------------------------------------------------------------------------
    def outgoing(self, now: float) -> bytes | None:
        """The next batch to publish, or None when there is nothing new to say (placements,
        keys, a changed backlog, or a heartbeat due)."""
        router = self.router
        placements, shared_keys, own = router.take_shared(MAX_BATCH_PLACEMENTS)
        keys = tuple(shared_keys)
        backlog = tuple(Backlog(*row) for row in own)
        service = tuple(self.fair.take_charged().items()) if self.fair is not None else ()
        if (
            not placements
            and not keys
            and not service
            and backlog == self._last_backlog
            and now - self._last_sent < HEARTBEAT_S
        ):
            return None
        ttl = router.config.affinity_ttl_s
        self._seq += 1
        self._last_backlog = backlog
        self._last_sent = now
        batch = Batch(
            self.sender,
            self._seq,
            tuple(
                Placement(digests, replica, length, max(0.0, ttl - (now - at)))
                for digests, replica, length, at in placements
            ),
            keys,
            backlog,
            service,
        )
        return encode_batch(self.keys, batch)

    def trim_pending(self) -> int:
        """While the bus is down: keep at most MAX_PENDING_PLACEMENTS placements to send
        when it returns (the oldest go first); returns how many were dropped."""
        return self.router.drop_shared(MAX_PENDING_PLACEMENTS)

    # -- in ----------------------------------------------------------------------------------
    def incoming(self, data: bytes, now: float, age_s: float = 0.0) -> Batch | None:
        """Apply a batch read from the bus ``age_s`` after it was written; returns it, or
        None for this process's own batches and for batches that do not verify."""
        try:
            batch = decode_batch(self.keys, data)
        except BadBatch:
            self.rejected += 1
            return None
        if batch.sender == self.sender:
            return None
        self.received += 1
        if len(self._heard) >= MAX_SENDERS and batch.sender not in self._heard:
            self._heard.clear()  # restarted processes' ids, mostly: start over
        self._heard[batch.sender] = max(batch.seq, self._heard.get(batch.sender, 0))
        router = self.router
        for p in batch.placements:
            remaining = p.ttl_s - age_s
            if remaining > 0:
                router.learn_placement(p.digests, p.replica, p.prompt_bytes, now, remaining)
        if age_s < self.backlog_ttl_s:
            for key, count in batch.keys:
                router.observe_remote_key(key, count, now)
            peer = self._peers.get(batch.sender)
            if peer is None:
                peer = self._peers[batch.sender] = _Peer(now - age_s)
            peer.heard_at = max(peer.heard_at, now - age_s)
            peer.backlog = {b.replica: b for b in batch.backlog}
            self._apply_backlog()
        fair = self.fair
        if fair is not None:  # service is history, not load: applied whatever its age
            for tenant, amount in batch.service:
                fair.charge_elsewhere(tenant, amount)
        return batch

    def expire(self, now: float) -> int:
        """Forget the backlog of peers silent for ``backlog_ttl_s``; how many are left."""
        ttl = self.backlog_ttl_s
        silent = [s for s, p in self._peers.items() if now - p.heard_at > ttl]
        for sender in silent:
            del self._peers[sender]
        if silent:
            self._apply_backlog()
        return len(self._peers)

    def forget_peers(self) -> None:
        """The bus is gone: route on this gateway's own state alone."""
        self._peers.clear()
        self._apply_backlog()

    @property
    def peers(self) -> int:
        return len(self._peers)

    @property
    def sent(self) -> int:
        """The sequence number of the last batch `outgoing` made."""
        return self._seq

    def heard(self, sender: str) -> int:
        """The highest sequence number applied from ``sender`` (0: none)."""
        return self._heard.get(sender, 0)

    def _apply_backlog(self) -> None:
        totals: dict[ReplicaId, list[float]] = {}
        for peer in self._peers.values():
            for b in peer.backlog.values():
                entry = totals.setdefault(b.replica, [0.0, 0.0])
                entry[0] += b.inflight
                entry[1] += b.prefill
        self.router.set_remote_load(
            {replica: (int(n), prefill) for replica, (n, prefill) in totals.items()}
        )
