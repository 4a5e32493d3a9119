"""The KV-event relay: vLLM's events in, sanitised events out, to authenticated consumers only.

vLLM publishes what enters and leaves its prefix cache, and with it the salt (in clear text in
``extra_keys``) and the prompt's token ids. Anyone who reads that stream learns every
tenant's namespace and prompts. The relay subscribes to each replica's stream (both of vLLM's
encodings, via :func:`~saltgate.kvevents.wire.decode_batch`) and republishes each batch
sanitised (kvevents/sanitize.py: keyed block hashes, no token ids, no salt, no LoRA identity),
with the replica named by an opaque id as the ZMQ topic.

Downstream it speaks vLLM's framing, ``[topic, seq (8 bytes BE), msgpack payload]``, with one
sequence number across all replicas, and keeps the last ``replay_window`` messages: a consumer
that (re)connects asks the replay socket for everything from the first seq it lacks and so
misses nothing still in the window. Both sockets use ZMQ CURVE: the server key pair is derived
from K_kv (every relay of a cluster has the same public key), and a ZAP handler admits only the
client public keys on the allow-list; anyone else completes no handshake and receives nothing.

Upstream, a gap in a replica's sequence numbers (or the relay's own late start) is filled from
the replica's replay endpoint when one is configured, the way a consumer fills its own
(kvevents/subscriber.py). One thread owns every socket.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import zmq
import zmq.auth.thread
import zmq.utils.monitor
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from zmq.utils import z85

from saltgate.derivations.labels import KV_CURVE_LABEL
from saltgate.kvevents.sanitize import opaque_replica_id, sanitize_batch
from saltgate.kvevents.sequence import ReplayWindow, SeqCursor
from saltgate.kvevents.settings import CurveKeyPair, KvRelaySettings, KvUpstream
from saltgate.kvevents.subscriber import REPLAY_TIMEOUT_S, ReplayOutcome, request_replay
from saltgate.kvevents.wire import (
    REPLAY_END_SEQ,
    WireError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    parse_frames,
)

log = logging.getLogger(__name__)

ZAP_DOMAIN: Final = "saltgate-kv-relay"
_POLL_MS = 100
_DRAIN_MAX = 256
_REFUSALS: Final[dict[int, str]] = {
    # a client without CURVE (its greeting names another mechanism)
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    # a CURVE client whose key the ZAP handler did not admit
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "key",
}


def relay_server_keys(k_kv: bytes) -> CurveKeyPair:
    """The relay's CURVE key pair, derived from K_kv so every relay of a cluster shares it:
    the X25519 secret is HKDF-SHA256(K_kv, info KV_CURVE_LABEL), in Z85."""
    secret = HKDF(algorithm=SHA256(), length=32, salt=None, info=KV_CURVE_LABEL).derive(k_kv)
    secret_z85 = z85.encode(secret).decode("ascii")
    public = zmq.curve_public(secret_z85.encode("ascii")).decode("ascii")
    return CurveKeyPair(public=public, secret=secret_z85)


@dataclass(slots=True)
class RelayStats:
    """Counters for logs and tests (numbers only: no event content)."""

    received: int = 0
    published: int = 0
    malformed: int = 0
    replayed_upstream: int = 0
    missed_upstream: int = 0
    refused: dict[tuple[str, str], int] = field(default_factory=dict)
    """Handshakes the relay refused, by (socket: "publish" or "replay", reason: "protocol"
    or "key"): the relay's own record that a stranger knocked and was turned away."""


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
        self._monitors: dict[zmq.Socket[bytes], str] = {}
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

    def _watch_refusals(self, sock: zmq.Socket[bytes], name: str) -> None:
        """Attach a monitor for refused handshakes before the socket binds, so none is missed."""
        events = 0
        for event in _REFUSALS:
            events |= event
        self._monitors[sock.get_monitor_socket(events)] = name

    def _open(self) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; the relay cannot authenticate")
        self._auth = zmq.auth.thread.ThreadAuthenticator(self._downstream_ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, _AllowList(self.settings.client_keys))
        self._pub = self._curve_server(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
        self._watch_refusals(self._pub, "publish")
        self._pub.bind(self.settings.publish_endpoint)
        self._router = self._curve_server(zmq.ROUTER)
        self._router.setsockopt(zmq.SNDHWM, self.settings.replay_window + 2)
        self._watch_refusals(self._router, "replay")
        self._router.bind(self.settings.replay_endpoint)
        for spec in self._specs:
            self._upstreams.append(self._open_upstream(spec))

    def _upstream_socket(self, kind: int, spec: KvUpstream) -> zmq.Socket[bytes]:
        """A socket to a replica's stream; with ``curve_server_key`` a CURVE client that
        completes a handshake only with the holder of that key (a forwarder beside vLLM,
        docs/kv-relay.md), presenting the relay's own key pair, which such a forwarder can
        allow-list: it is the public key consumers pin (`describe`)."""
        sock = self._upstream_ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if spec.curve_server_key is not None:
            sock.curve_serverkey = spec.curve_server_key.encode("ascii")
            sock.curve_publickey = self.server_keys.public.encode("ascii")
            sock.curve_secretkey = self.server_keys.secret.encode("ascii")
        return sock

    def _open_upstream(self, spec: KvUpstream) -> _Upstream:
        topic = opaque_replica_id(self._k_kv, spec.name or spec.endpoint)
        sub = self._upstream_socket(zmq.SUB, spec)
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
        sock = self._upstream_socket(zmq.DEALER, upstream.spec)
        sock.connect(upstream.spec.replay_endpoint)
        upstream.replay = sock

    # -- the relay thread

    def _run(self) -> None:
        assert self._router is not None
        poller = zmq.Poller()
        for upstream in self._upstreams:
            poller.register(upstream.sub, zmq.POLLIN)
        poller.register(self._router, zmq.POLLIN)
        for monitor in self._monitors:
            poller.register(monitor, zmq.POLLIN)
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
                for monitor, name in self._monitors.items():
                    if monitor in ready:
                        self._count_refusal(monitor, name)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.warning("kv relay: socket error %s; continuing", exc.errno)

    def _count_refusal(self, monitor: zmq.Socket[bytes], name: str) -> None:
        event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        reason = _REFUSALS.get(event)
        if reason is not None:
            cell = (name, reason)
            self.stats.refused[cell] = self.stats.refused.get(cell, 0) + 1
            log.debug("kv relay: refused a %s handshake (%s)", name, reason)

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
        missed = upstream.cursor.admit_live(seq, lambda: self._fill(upstream))
        if missed is not None:
            self.stats.missed_upstream += missed
            self._take(upstream, seq, payload)

    def _fill(self, upstream: _Upstream) -> None:
        """Ask the replica's replay socket for everything from the next expected seq."""
        if upstream.replay is None:
            return

        def replayed(_topic: bytes, seq: int, payload: bytes) -> None:
            missed = upstream.cursor.admit_replayed(seq)
            if missed is not None:  # missed > 0: the replica's buffer no longer reaches back
                self.stats.missed_upstream += missed
                self.stats.replayed_upstream += 1
                self._take(upstream, seq, payload)

        outcome = request_replay(
            upstream.replay, upstream.cursor.next_seq, REPLAY_TIMEOUT_S, replayed, self._malformed
        )
        if outcome is ReplayOutcome.TIMED_OUT:
            self._open_replay(upstream)

    def _malformed(self) -> None:
        self.stats.malformed += 1

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
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._monitors.clear()
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
            self._thread.join(timeout=REPLAY_TIMEOUT_S + 2)
            self._thread = None
        self._close_sockets()

    def __enter__(self) -> KvRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
