"""The KV-event relay: vLLM's events in, sanitised events out, to authenticated consumers only.

vLLM publishes what enters and leaves its prefix cache, and with it the salt (in clear text in
``extra_keys``) and the prompt's token ids. Anyone who reads that stream learns every
tenant's namespace and prompts. The relay subscribes to each replica's stream (both of vLLM's
encodings, via :func:`~saltgate.kvevents.wire.decode_batch`) and republishes each batch with:

- block hashes (and parent hashes) replaced by ``HMAC-SHA256(K_kv, "saltgate/v1/kv-block" ||
  u64be(hash))`` cut to 64 bits: stored and removed events still pair up, the same prefix on
  two replicas still matches, and only holders of the master key can link a hash to a prompt;
- no token ids, no extra keys (the salt), no LoRA id or name;
- the replica named by an opaque id (an HMAC of its event endpoint) as the ZMQ topic.

Downstream it speaks vLLM's framing, ``[topic, seq (8 bytes BE), msgpack payload]``, with one
sequence number across all replicas, and keeps the last ``replay_window`` messages: a consumer
that (re)connects asks the replay socket for everything from the first seq it lacks and so
misses nothing still in the window. Both sockets use ZMQ CURVE: the server key pair is derived
from K_kv (every relay of a cluster has the same public key), and a ZAP handler admits only the
client public keys on the allow-list; anyone else completes no handshake and receives nothing.

Upstream, a gap in a replica's sequence numbers (or the relay's own late start) is filled from
the replica's replay endpoint when one is configured. Layout: the decisions (sanitising, ids,
sequence bookkeeping, the replay window) are pure; :class:`KvRelay` (one thread owning every
socket) and :class:`RelaySubscriber` (the consumer side) do the I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Final

import zmq
import zmq.auth.thread
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

from saltgate.kvevents.wire import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    parse_frames,
    parse_replay_frames,
    replay_request,
)
from saltgate.spec.encoding import lp

__all__ = [
    "CurveKeyPair",
    "KvRelay",
    "KvRelaySettings",
    "KvUpstream",
    "RelaySubscriber",
    "RelayedBatch",
    "ReplayWindow",
    "SeqCursor",
    "SeqVerdict",
    "keyed_block_hash",
    "opaque_replica_id",
    "parse_client_key",
    "relay_server_keys",
    "sanitize_batch",
    "sanitize_event",
]

log = logging.getLogger(__name__)

KV_BLOCK_DOMAIN: Final = b"saltgate/v1/kv-block"
KV_REPLICA_DOMAIN: Final = b"saltgate/v1/kv-replica"
KV_CURVE_LABEL: Final = b"saltgate/v1/kv-relay-curve"
ZAP_DOMAIN: Final = "saltgate-kv-relay"
DEFAULT_REPLAY_WINDOW: Final = 10_000
_Z85_KEY = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_POLL_MS = 100
_DRAIN_MAX = 256
_REPLAY_TIMEOUT_S = 2.0

# ---------------------------------------------------------------------------- pure core


def keyed_block_hash(k_kv: bytes, block_hash: int) -> int:
    """The hash consumers see for vLLM's ``block_hash``: a keyed HMAC cut to 64 bits."""
    mac = hmac.new(k_kv, KV_BLOCK_DOMAIN + block_hash.to_bytes(8, "big"), hashlib.sha256)
    return int.from_bytes(mac.digest()[:8], "big")


def opaque_replica_id(k_kv: bytes, name: str) -> str:
    """A stable name for a replica that reveals neither its address nor its order."""
    mac = hmac.new(k_kv, KV_REPLICA_DOMAIN + lp(name.encode("utf-8")), hashlib.sha256)
    return "replica-" + mac.hexdigest()[:16]


def sanitize_event(k_kv: bytes, event: KVEvent) -> KVEvent:
    """Keep what a cache-aware consumer needs; drop tokens, salt and LoRA identity."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return BlockStored(
            block_hashes=tuple(keyed_block_hash(k_kv, h) for h in event.block_hashes),
            parent_block_hash=None if parent is None else keyed_block_hash(k_kv, parent),
            token_ids=(),
            block_size=event.block_size,
            medium=event.medium,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        )
    if isinstance(event, BlockRemoved):
        return replace(
            event, block_hashes=tuple(keyed_block_hash(k_kv, h) for h in event.block_hashes)
        )
    return AllBlocksCleared()


def sanitize_batch(k_kv: bytes, batch: EventBatch) -> EventBatch:
    """One upstream batch, sanitised event by event (timestamp and DP rank are kept)."""
    return replace(batch, events=tuple(sanitize_event(k_kv, e) for e in batch.events))


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    """A CURVE key pair in Z85 text (40 characters each)."""

    public: str
    secret: str = field(repr=False)


def relay_server_keys(k_kv: bytes) -> CurveKeyPair:
    """The relay's CURVE key pair, derived from K_kv so every relay of a cluster shares it."""
    secret = HKDF(algorithm=SHA256(), length=32, salt=None, info=KV_CURVE_LABEL).derive(k_kv)
    secret_z85 = z85.encode(secret).decode("ascii")
    public = zmq.curve_public(secret_z85.encode("ascii")).decode("ascii")
    return CurveKeyPair(public=public, secret=secret_z85)


def parse_client_key(text: str) -> str:
    """A consumer's public key as given in the allow-list; ValueError says what is wrong."""
    key = text.strip()
    if not _Z85_KEY.fullmatch(key):
        raise ValueError(
            "a CURVE public key is 40 Z85 characters (python -c 'import zmq; "
            "print(zmq.curve_keypair()[0].decode())' makes one)"
        )
    return key


class SeqVerdict(Enum):
    """Where a sequence number falls relative to the next one expected."""

    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"


@dataclass(slots=True)
class SeqCursor:
    """Tracks one stream's sequence numbers (a replica's, or the relay's for a consumer).

    Messages come live (PUB/SUB) and from replay, which may overlap. A publisher's live
    numbers only grow, so a live number at or below the last live one means it restarted
    (its numbers begin again at 0); a number below the expected one is otherwise a
    duplicate that replay already delivered.
    """

    next_seq: int = 0
    last_live: int = -1
    restarts: int = 0

    def live(self, seq: int) -> SeqVerdict:
        """Classify (and remember) a number from the live stream."""
        if seq <= self.last_live:
            self.next_seq = 0
            self.restarts += 1
        self.last_live = seq
        return self.replayed(seq)

    def replayed(self, seq: int) -> SeqVerdict:
        """Classify a number from a replay answer."""
        if seq == self.next_seq:
            return SeqVerdict.NEXT
        return SeqVerdict.GAP if seq > self.next_seq else SeqVerdict.DUPLICATE

    def advance(self, seq: int) -> None:
        self.next_seq = seq + 1


@dataclass(frozen=True, slots=True)
class WindowEntry:
    seq: int
    topic: bytes
    payload: bytes


class ReplayWindow:
    """The last ``size`` republished messages, numbered from 0, for consumers to catch up."""

    def __init__(self, size: int = DEFAULT_REPLAY_WINDOW) -> None:
        if size <= 0:
            raise ValueError(f"replay_window must be positive, got {size}")
        self._entries: deque[WindowEntry] = deque(maxlen=size)
        self.next_seq = 0

    def append(self, topic: bytes, payload: bytes) -> int:
        seq = self.next_seq
        self._entries.append(WindowEntry(seq, topic, payload))
        self.next_seq = seq + 1
        return seq

    def since(self, start_seq: int) -> list[WindowEntry]:
        return [e for e in self._entries if e.seq >= start_seq]


@dataclass(frozen=True, slots=True)
class KvUpstream:
    """One replica's event stream, as the relay reaches it.

    The relay CONNECTS its SUB socket to ``endpoint`` (vLLM bound it: ``tcp://*:5557`` or
    ``ipc://...``), unless ``bind`` is set: then the relay binds there and vLLM, configured
    with the relay's address, connects. ``replay_endpoint`` is vLLM's replay ROUTER, used to
    fill gaps. ``name`` (default: the endpoint) is what the opaque replica id is made from.
    """

    endpoint: str
    replay_endpoint: str | None = None
    bind: bool = False
    name: str | None = None


@dataclass(frozen=True, slots=True)
class KvRelaySettings:
    """Where the relay publishes, who may read, and how much it keeps for replay."""

    publish_endpoint: str
    replay_endpoint: str
    client_keys: tuple[str, ...]
    replay_window: int = DEFAULT_REPLAY_WINDOW
    hwm: int = 100_000

    @classmethod
    def from_table(cls, table: Mapping[str, Any], base: Path) -> KvRelaySettings:
        """The ``[kv_relay]`` section of the config file; ValueError names the bad key."""
        unknown = set(table) - {
            "publish_endpoint",
            "replay_endpoint",
            "client_keys",
            "client_keys_file",
            "replay_window",
        }
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        endpoints = []
        for key in ("publish_endpoint", "replay_endpoint"):
            value = table.get(key)
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f'{key}: expected a ZMQ endpoint such as "tcp://127.0.0.1:5600"')
            endpoints.append(value)
        keys = table.get("client_keys", [])
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise ValueError("client_keys: expected a list of Z85 public keys")
        if "client_keys_file" in table:
            name = table["client_keys_file"]
            if not isinstance(name, str):
                raise ValueError("client_keys_file: expected a path")
            path = Path(name) if Path(name).is_absolute() else base / name
            try:
                lines = path.read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"client_keys_file: cannot read {path}: {exc.strerror}") from None
            keys = keys + [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        parsed = []
        for i, key in enumerate(keys):
            try:
                parsed.append(parse_client_key(key))
            except ValueError as exc:
                raise ValueError(f"client_keys[{i}]: {exc}") from None
        if not parsed:
            raise ValueError("client_keys: list at least one consumer's public key")
        window = table.get("replay_window", DEFAULT_REPLAY_WINDOW)
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            raise ValueError("replay_window: expected a positive number of messages")
        return cls(endpoints[0], endpoints[1], tuple(parsed), window)


@dataclass(frozen=True, slots=True)
class RelayedBatch:
    """One sanitised message as a consumer receives it."""

    replica_id: str
    seq: int
    batch: EventBatch


@dataclass(slots=True)
class RelayStats:
    """Counters for logs and tests (numbers only: no event content)."""

    received: int = 0
    published: int = 0
    malformed: int = 0
    replayed_upstream: int = 0
    missed_upstream: int = 0


# ---------------------------------------------------------------------------- I/O shell


class _AllowList:
    """pyzmq's ZAP credentials provider: admit exactly the listed client keys."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = frozenset(k.encode("ascii") for k in keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == ZAP_DOMAIN and key in self._keys


@dataclass(slots=True, eq=False)
class _Upstream:
    spec: KvUpstream
    topic: bytes
    sub: zmq.Socket[bytes]
    cursor: SeqCursor = field(default_factory=SeqCursor)
    replay: zmq.Socket[bytes] | None = None


class KvRelay:
    """Subscribes to replicas, republishes sanitised events; one thread owns every socket.

    ``start()`` binds and connects on the caller's thread (so a busy port raises there),
    then hands the sockets to the relay thread. ``set_upstreams`` changes the replicas it
    follows while it runs (the gateway's SIGHUP reload). ``close()`` stops it.
    """

    def __init__(
        self, upstreams: Sequence[KvUpstream], k_kv: bytes, settings: KvRelaySettings
    ) -> None:
        if not upstreams:
            raise ValueError("the KV-event relay needs at least one upstream event endpoint")
        if not settings.client_keys:
            raise ValueError("the KV-event relay needs at least one allowed client key")
        self._k_kv = k_kv
        self.settings = settings
        self.server_keys = relay_server_keys(k_kv)
        self.window = ReplayWindow(settings.replay_window)
        self.stats = RelayStats()
        self._specs = tuple(upstreams)
        self._upstream_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._downstream_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._upstreams: list[_Upstream] = []
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._new_specs: queue.SimpleQueue[tuple[KvUpstream, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the relay has asked every replica for what it missed before starting."""
        return self._ready.wait(timeout_s)

    @property
    def replica_ids(self) -> dict[str, str]:
        """Upstream endpoint -> the opaque id consumers see as the topic."""
        return {
            s.endpoint: opaque_replica_id(self._k_kv, s.name or s.endpoint) for s in self._specs
        }

    @property
    def publish_endpoint(self) -> str:
        assert self._pub is not None, "start() first"
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str:
        assert self._router is not None, "start() first"
        return self._router.getsockopt_string(zmq.LAST_ENDPOINT)

    def describe(self) -> str:
        """One line for the operator: where consumers connect and the key they pin."""
        return (
            f"kv relay on {self.publish_endpoint} (replay {self.replay_endpoint}), "
            f"{len(self._specs)} upstreams, server key {self.server_keys.public}"
        )

    def start(self) -> None:
        """Bind and connect (a busy address raises OSError here), then start the thread."""
        try:
            self._open()
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(exc.errno, f"KV-event relay: {exc.strerror}") from None
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kv-relay", daemon=True)
        self._thread.start()

    def _curve_server(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._downstream_ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_server = True
        sock.curve_secretkey = self.server_keys.secret.encode("ascii")
        sock.curve_publickey = self.server_keys.public.encode("ascii")
        sock.zap_domain = ZAP_DOMAIN.encode("ascii")
        return sock

    def _open(self) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; the relay cannot authenticate")
        self._auth = zmq.auth.thread.ThreadAuthenticator(self._downstream_ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(self.settings.client_keys))
        self._pub = self._curve_server(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        self._pub.bind(self.settings.publish_endpoint)
        self._router = self._curve_server(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, self.settings.replay_window + 2)
        self._router.bind(self.settings.replay_endpoint)
        for spec in self._specs:
            self._upstreams.append(self._open_upstream(spec))

    def _open_upstream(self, spec: KvUpstream) -> _Upstream:
        topic = opaque_replica_id(self._k_kv, spec.name or spec.endpoint)
        sub = self._upstream_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.settings.hwm)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        upstream = _Upstream(spec, topic.encode("ascii"), sub)
        try:
            if spec.bind:
                sub.bind(spec.endpoint)
            else:
                sub.connect(spec.endpoint)
            if spec.replay_endpoint is not None:
                self._open_replay(upstream)
        except BaseException:
            self._close_upstream(upstream)
            raise
        return upstream

    @staticmethod
    def _close_upstream(upstream: _Upstream) -> None:
        upstream.sub.close(linger=0)
        if upstream.replay is not None:
            upstream.replay.close(linger=0)

    def set_upstreams(self, upstreams: Sequence[KvUpstream]) -> None:
        """Follow these replicas from now on: new ones are subscribed (and asked for what
        they already sent), removed ones dropped, the others keep their place in the
        stream. Thread-safe; the relay thread applies it within one poll interval."""
        specs = tuple(upstreams)
        if self._thread is None:
            self._specs = specs
        else:
            self._new_specs.put(specs)

    def _apply_new_specs(self, poller: zmq.Poller) -> None:
        """On the relay thread: switch to the newest list handed to `set_upstreams`."""
        specs: tuple[KvUpstream, ...] | None = None
        while not self._new_specs.empty():
            specs = self._new_specs.get_nowait()
        if specs is None:
            return
        kept: list[_Upstream] = []
        for upstream in self._upstreams:
            if upstream.spec in specs:
                kept.append(upstream)
            else:
                poller.unregister(upstream.sub)
                self._close_upstream(upstream)
        have = {u.spec for u in kept}
        for spec in specs:
            if spec in have:
                continue
            try:
                upstream = self._open_upstream(spec)
            except zmq.ZMQError as exc:
                log.warning("kv relay: cannot follow a new upstream (%s); skipped", exc.strerror)
                continue
            poller.register(upstream.sub, zmq.POLLIN)
            kept.append(upstream)
            self._fill(upstream)
        self._upstreams = kept
        self._specs = tuple(u.spec for u in kept)

    def _open_replay(self, upstream: _Upstream) -> None:
        assert upstream.spec.replay_endpoint is not None
        if upstream.replay is not None:
            upstream.replay.close(linger=0)
        sock = self._upstream_ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(upstream.spec.replay_endpoint)
        upstream.replay = sock

    # -- the relay thread

    def _run(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        for upstream in self._upstreams:
            poller.register(upstream.sub, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        for upstream in self._upstreams:  # a late start: fetch what the replica already sent
            self._fill(upstream)
        self._ready.set()
        while not self._stop.is_set():
            try:
                self._apply_new_specs(poller)
                ready = dict(poller.poll(_POLL_MS))
                for upstream in self._upstreams:
                    if upstream.sub in ready:
                        self._drain(upstream)
                if self._router in ready:
                    self._serve_replay()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("kv relay: socket error %s; continuing", exc.errno)

    def _drain(self, upstream: _Upstream) -> None:
        for _ in range(_DRAIN_MAX):
            try:
                frames = upstream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.stats.received += 1
            try:
                _, seq, payload = parse_frames(frames)
            except WireError:
                self.stats.malformed += 1
                continue
            self._live(upstream, seq, payload)

    def _live(self, upstream: _Upstream, seq: int, payload: bytes) -> None:
        verdict = upstream.cursor.live(seq)
        if verdict is SeqVerdict.DUPLICATE:
            return
        if verdict is SeqVerdict.GAP:
            self._fill(upstream)
            if upstream.cursor.next_seq > seq:
                return  # the replay delivered it
            self.stats.missed_upstream += seq - upstream.cursor.next_seq
        self._take(upstream, seq, payload)

    def _fill(self, upstream: _Upstream) -> None:
        """Ask the replica's replay socket for everything from the next expected seq."""
        sock = upstream.replay
        if sock is None:
            return
        try:
            sock.send_multipart([b"", replay_request(upstream.cursor.next_seq)], zmq.NOBLOCK)
        except zmq.Again:
            return  # not connected (the replica is down): nothing to fill from now
        deadline = time.monotonic() + _REPLAY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if not sock.poll(int(left * 1000) + 1):
                break
            try:
                reply = parse_replay_frames(sock.recv_multipart())
            except WireError:
                self.stats.malformed += 1
                continue
            if reply is None:
                return
            _, seq, payload = reply
            verdict = upstream.cursor.replayed(seq)
            if verdict is SeqVerdict.GAP:  # the replica's buffer no longer reaches back
                self.stats.missed_upstream += seq - upstream.cursor.next_seq
            if verdict is not SeqVerdict.DUPLICATE:
                self.stats.replayed_upstream += 1
                self._take(upstream, seq, payload)
        # No end marker in time: drop this socket so late replies cannot be misread.
        self._open_replay(upstream)

    def _take(self, upstream: _Upstream, seq: int, payload: bytes) -> None:
        upstream.cursor.advance(seq)
        try:
            batch = decode_batch(payload)
        except WireError:
            self.stats.malformed += 1
            return
        clean = encode_batch(sanitize_batch(self._k_kv, batch))
        out_seq = self.window.append(upstream.topic, clean)
        assert self._pub is not None
        self._pub.send_multipart([upstream.topic, encode_seq(out_seq), clean])
        self.stats.published += 1

    def _serve_replay(self) -> None:
        assert self._router is not None
        for _ in range(_DRAIN_MAX):
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue  # not a replay request
            ident, start = frames[0], decode_seq(frames[2])
            for entry in self.window.since(start):
                self._router.send_multipart(
                    [ident, b"", entry.topic, encode_seq(entry.seq), entry.payload]
                )
            self._router.send_multipart([ident, b"", b"", REPLAY_END_SEQ, b""])

    # -- shutdown

    def _close_sockets(self) -> None:
        for upstream in self._upstreams:
            self._close_upstream(upstream)
        self._upstreams.clear()
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._upstream_ctx.term()
        self._downstream_ctx.term()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_REPLAY_TIMEOUT_S + 2)
            self._thread = None
        self._close_sockets()

    def __enter__(self) -> KvRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RelaySubscriber:
    """A consumer of the relay: CURVE-authenticated, gap-free through the replay socket.

    ``start_seq`` is the first relay sequence number wanted (0: everything still in the
    window); call :meth:`catch_up` after connecting, then :meth:`receive` in a loop.
    """

    def __init__(
        self,
        publish_endpoint: str,
        replay_endpoint: str,
        server_public_key: str,
        client_keys: CurveKeyPair,
        *,
        start_seq: int = 0,
    ) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._server_key = server_public_key
        self._client_keys = client_keys
        self._replay_endpoint = replay_endpoint
        self.cursor = SeqCursor(start_seq)
        self._sub = self._curve_client(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(publish_endpoint)
        self._replay = self._open_replay()

    def _curve_client(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = self._server_key.encode("ascii")
        sock.curve_publickey = self._client_keys.public.encode("ascii")
        sock.curve_secretkey = self._client_keys.secret.encode("ascii")
        return sock

    def _open_replay(self) -> zmq.Socket[bytes]:
        sock = self._curve_client(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        return sock

    @staticmethod
    def _relayed(topic: bytes, seq: int, payload: bytes) -> RelayedBatch | None:
        try:
            return RelayedBatch(topic.decode("ascii"), seq, decode_batch(payload))
        except (WireError, UnicodeDecodeError):
            return None

    def catch_up(self, timeout_s: float = _REPLAY_TIMEOUT_S) -> list[RelayedBatch]:
        """Everything in the relay's window from the next wanted seq on (empty on timeout)."""
        out: list[RelayedBatch] = []
        try:
            self._replay.send_multipart([b"", replay_request(self.cursor.next_seq)], zmq.NOBLOCK)
        except zmq.Again:
            return out  # no connection (or the relay refused this key)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._replay.poll(int(left * 1000) + 1):
                break
            try:
                reply = parse_replay_frames(self._replay.recv_multipart())
            except WireError:
                continue
            if reply is None:
                return out
            topic, seq, payload = reply
            if self.cursor.replayed(seq) is SeqVerdict.DUPLICATE:
                continue
            self.cursor.advance(seq)
            relayed = self._relayed(topic, seq, payload)
            if relayed is not None:
                out.append(relayed)
        self._replay.close(linger=0)  # no end marker: never read its late replies as fresh
        self._replay = self._open_replay()
        return out

    def receive(self, timeout_s: float) -> list[RelayedBatch]:
        """Waits up to ``timeout_s`` for live messages; fills any gap from the replay window."""
        out: list[RelayedBatch] = []
        if not self._sub.poll(int(timeout_s * 1000)):
            return out
        while True:
            try:
                topic, seq, payload = parse_frames(self._sub.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return out
            except WireError:
                continue
            verdict = self.cursor.live(seq)
            if verdict is SeqVerdict.DUPLICATE:
                continue
            if verdict is SeqVerdict.GAP:
                out.extend(self.catch_up())
                if self.cursor.next_seq > seq:
                    continue  # the replay delivered it
            self.cursor.advance(seq)
            relayed = self._relayed(topic, seq, payload)
            if relayed is not None:
                out.append(relayed)

    def close(self) -> None:
        self._sub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> RelaySubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
