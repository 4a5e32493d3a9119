"""The gateway's replicas: connection pools and probes around the sans-IO router.

The router (saltgate.routing) decides; this module does the I/O it needs: a pooled
connection per replica, /health, /v1/models and /metrics probes every
``probe_interval_s``, and a replica set that can change while requests are in flight
(`reload`): a removed replica's pool closes once its last request has finished.

A replica serves the models its last good /v1/models probe listed, or those pinned in its
``[[replicas]] models``: pinned wins (the operator's word; a probe that disagrees is
logged once per change), and the router learns either (`Router.set_models`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import orjson

from saltgate.config import ConfigError, ReplicaConfig
from saltgate.http.client import UpstreamError, UpstreamPool, UpstreamResponse
from saltgate.http.tls import client_context, tls_failure
from saltgate.routing import (
    RUNNING_METRIC,
    Member,
    Plan,
    ReplicaId,
    ReplicaState,
    Router,
    parse_gauge,
    parse_largest_step,
    parse_waiting,
)

log = logging.getLogger(__name__)

# What a replica answers a request whose API key it does not take (vLLM: 401).
CREDENTIALS_REFUSED: Final = frozenset({401, 403})


def _refusal_cause(index: int, status: int, where: str) -> str:
    """The operator's line: which replica refused, and what to check (never the key)."""
    return (
        f"it refuses the gateway's API key ({where} answered {status}): check api_key_file "
        f"or api_key_env of [[replicas]] {index} against the replica's --api-key"
    )


RETIRE_POLL_S = 0.1


@dataclass(slots=True, eq=False)
class Replica:
    config: ReplicaConfig
    pool: UpstreamPool
    prefix: bytes
    # What its last good /v1/models probe listed (public fields only: `_model_entries`).
    models: list[dict[str, Any]] = field(default_factory=list)
    probed: bool = False  # a /v1/models probe has answered: `models` is known
    # The probe's list that disagreed with the pinned one, last logged (logged once).
    mismatch: frozenset[str] | None = None
    # 401 or 403 while it refuses the gateway's API key (its probe or a request saw it).
    refused: int | None = None
    # The replica's identity in the ranking: its URL, the same on every gateway.
    id: ReplicaId = field(init=False)
    label: str = field(init=False)  # its URL in metric labels and logs (`replica_label`)
    auth: list[tuple[bytes, bytes]] = field(init=False, repr=False)  # with its backend key

    def __post_init__(self) -> None:
        self.id = ReplicaId(self.config.url)
        self.label = replica_label(self.config.url)
        self.configure(self.config)

    def configure(self, config: ReplicaConfig) -> None:
        """Take a reloaded configuration of the same URL (its backend key may change)."""
        self.config = config
        key = config.api_key
        self.auth = [(b"authorization", b"Bearer " + key.encode())] if key else []

    @property
    def learnt(self) -> frozenset[str]:
        """The model ids its last good probe listed."""
        return frozenset(str(m["id"]) for m in self.models)

    @property
    def served(self) -> frozenset[str] | None:
        """The models requests may be sent here for: pinned, else learnt; None while
        neither is known (no probe has reached it yet)."""
        pinned = self.config.models
        if pinned is not None:
            return frozenset(pinned)
        return self.learnt if self.probed else None


class Attempt:
    """One exchange with one replica, from `ReplicaSet.acquire` to `close`.

    It tells the router how the exchange went: the response arrived (`responded`), the
    first output came so the prompt is prefilled (`first_output`), the exchange broke
    (`failed`), and the replica is free of it (`close`, idempotent, handing back whatever
    prefill estimate is still counted). Every ending closes it, so in-flight counts and
    prefill backlog return to zero.
    """

    __slots__ = ("_at_most", "_closed", "_prefill", "_router", "_set", "replica")

    def __init__(
        self,
        replicas: ReplicaSet,
        replica: Replica,
        prefill: float,  # likely and at most: what `Router.started` counted
        at_most: float,
    ) -> None:
        self._set = replicas
        self._router = replicas.router
        self.replica = replica
        self._prefill = prefill
        self._at_most = at_most
        self._closed = False

    def responded(self) -> None:
        self._router.responded(self.replica.id)

    def first_output(self) -> None:
        if self._at_most:
            self._router.prefilled(self.replica.id, self._prefill, self._at_most)
            self._prefill = self._at_most = 0.0
            self._freed()  # its prefill no longer counts against the gate's budget

    def failed(self) -> None:
        self._router.failed(self.replica.id, time.monotonic())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._router.finished(self.replica.id, self._prefill, self._at_most)
            self._prefill = self._at_most = 0.0
            self._freed()

    def _freed(self) -> None:
        replicas = self._set
        for listener in replicas.listeners:
            listener.freed(replicas)


class ReplicaListener(Protocol):
    """What the replica set tells as it happens: the cluster bus (gateway/cluster.py)
    publishes the router's load on it, the fair queue (gateway/fairshare.py) hands out
    the places it frees. Given to the set when it is built (serving/run.py)."""

    def acquired(self) -> None:
        """A request took a place on a replica."""

    def freed(self, replicas: ReplicaSet) -> None:
        """A place may have freed: a request left a replica, or its prompt is prefilled."""

    def queue_seen(
        self,
        replicas: ReplicaSet,
        replica: ReplicaId,
        *,
        inflight: int,
        waiting: float | None,
        running: float | None,
        step: int | None,
    ) -> None:
        """A probe read a replica's queue: every gateway's requests in flight there, its
        waiting and running counts and the largest engine step it ran (None: not
        reported; waiting None: it reports no queue)."""


class ReplicaSet:
    def __init__(
        self,
        configs: tuple[ReplicaConfig, ...],
        *,
        timeout: float,
        router: Router,
        listeners: Sequence[ReplicaListener] = (),
    ) -> None:
        self.router = router
        self.timeout = timeout
        self.listeners = tuple(listeners)
        self._replicas: dict[str, Replica] = {}
        self._probe_task: asyncio.Task[None] | None = None
        # What reload starts (retirements, first probes), cancelled by close.
        self._retiring: set[asyncio.Task[Any]] = set()
        self.reload(configs)

    @property
    def replicas(self) -> list[Replica]:
        """In configuration order."""
        return list(self._replicas.values())

    # -- membership ------------------------------------------------------------------------
    def reload(self, configs: tuple[ReplicaConfig, ...]) -> list[asyncio.Task[Any]]:
        """Switch to a new replica list without a restart; replicas that stay keep their
        pools, load and health, and removed ones finish what they are serving. Once the
        probes run, an added replica is probed at once: it takes requests only for the
        models it is known to serve. Returns those first probes (none before probing
        starts): whoever announces the reload awaits them, so that a replica list
        replaced whole is serving again when the reload is said done.

        TLS files are read again (a rotated certificate is taken on the next connection),
        all of them before anything changes: ConfigError if one cannot be used."""
        contexts = [tls_context(cfg, i) for i, cfg in enumerate(configs)]
        replicas: dict[str, Replica] = {}
        for index, (cfg, tls) in enumerate(zip(configs, contexts, strict=True)):
            replica = self._replicas.get(cfg.url)
            if replica is None:
                host, port, prefix = cfg.authority
                pool = UpstreamPool(
                    host, port, tls=tls, response_timeout=self.timeout, read_timeout=self.timeout
                )
                replica = Replica(cfg, pool, prefix.encode())
                _warn_plaintext(cfg, index)
            replica.pool.tls = tls
            replica.configure(cfg)
            replicas[cfg.url] = replica
        self.router.set_members(Member(ReplicaId(cfg.url), cfg.weight) for cfg in configs)
        for replica in replicas.values():
            self.router.set_models(replica.id, replica.served)
        removed = [r for url, r in self._replicas.items() if url not in replicas]
        added = [r for url, r in replicas.items() if url not in self._replicas]
        self._replicas = replicas
        for replica in removed:
            self._background(self._retire(replica))
        if self._probe_task is None:
            return []
        return [self._background(self.probe(replica)) for replica in added]

    def _background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return task

    async def _retire(self, replica: Replica) -> None:
        deadline = time.monotonic() + self.timeout
        failure: BaseException | None = None
        try:
            while self.router.inflight(replica.id) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(RETIRE_POLL_S)
        except BaseException as exc:
            failure = exc  # closed below, outside the handler (buildinfo.py)
        await replica.pool.close()
        if failure is not None:
            raise failure

    # -- decisions and the events that feed them -----------------------------------------
    def plan(
        self, route: str, body: Mapping[str, Any], model: str, salt: str | None, *, remember: bool
    ) -> Plan:
        """The router's plan for a request, now (`Router.plan_request`)."""
        return self.router.plan_request(
            route, body, model, salt, time.monotonic(), remember=remember
        )

    def acquire(
        self,
        plan: Plan,
        tried: Collection[ReplicaId],
        usable: Sequence[ReplicaState] | None = None,
    ) -> Attempt | None:
        """The replica to try next for ``plan`` (skipping ``tried``), counted as busy with
        the request until the attempt is closed; None when no replica is available.
        ``usable``: the router's usable replicas for it, when the caller has them."""
        replica_id = self.router.pick(plan, time.monotonic(), tried, usable)
        return None if replica_id is None else self.attempt_on(plan, replica_id)

    def attempt_on(self, plan: Plan, replica_id: ReplicaId) -> Attempt | None:
        """``plan``'s attempt on a replica chosen elsewhere (Envoy retried down the EPP's
        list), counted as `acquire` counts its pick; None if the replica is gone."""
        if replica_id not in self._replicas:
            return None
        router = self.router
        now = time.monotonic()
        prefill = float(plan.uncached_bytes(replica_id))
        at_most = float(plan.uncached_at_most(replica_id))
        router.started(replica_id, now, prefill, at_most)
        for listener in self.listeners:
            listener.acquired()
        return Attempt(self, self._replicas[replica_id], prefill, at_most)

    def available(self) -> list[tuple[int, Replica, bool]]:
        """(index in the configuration, replica, may be picked now) for the metrics."""
        now = time.monotonic()
        return [
            (i, r, self._state(r).health.available(now))
            for i, r in enumerate(self._replicas.values())
        ]

    def down_reason(self, replica: Replica) -> str | None:
        """Why the replica may not be picked, as /ready names it (no URL, no key); None if
        it may be, or if only its breaker holds it back for now."""
        health = self._state(replica).health
        if replica.refused is not None:
            return "credentials_refused"
        if health.isolation.failed:
            return "isolation_canary_failed"
        return None if health.probe.up else "probe_failed"

    def _state(self, replica: Replica) -> ReplicaState:
        state = self.router.state(replica.id)
        assert state is not None, "the router and the replica set list the same replicas"
        return state

    def models(self, allowed: frozenset[str] | None = None) -> list[dict[str, Any]]:
        """What `GET /v1/models` lists: the models the available replicas serve (only
        those in ``allowed``, unless it is None), each once."""
        seen: dict[str, dict[str, Any]] = {}
        for _, replica, ok in self.available():
            if not ok:
                continue
            learnt = {str(m["id"]): m for m in replica.models}
            for name in sorted(replica.served or ()):
                if allowed is None or name in allowed:
                    seen.setdefault(name, learnt.get(name) or _model_entry(name, 0))
        return list(seen.values())

    # -- probes ----------------------------------------------------------------------------
    async def probe(self, replica: Replica) -> bool:
        try:
            why = await asyncio.wait_for(self._probe(replica), self.router.config.probe_timeout_s)
        except TimeoutError:
            why = f"no answer within {self.router.config.probe_timeout_s:g} s"
        except UpstreamError as exc:
            why = str(exc)
        ok = why is None
        state = self.router.state(replica.id)
        if state is None:
            return ok  # removed while the probe ran
        was_up = state.health.probe.up
        self.router.probed(replica.id, ok)
        if replica.refused is not None:
            self.router.credentials_refused(replica.id)
        if state.health.probe.up != was_up:
            index = self.replicas.index(replica)
            if ok:
                log.warning("replica %d (%s) is back", index, replica.id)
            else:
                log.warning("replica %d (%s) is down: its probes fail (%s)", index, replica.id, why)
        return ok

    async def _probe(self, replica: Replica) -> str | None:
        """None when the replica is healthy, else what was wrong (for the operator)."""
        resp = await replica.pool.request(b"GET", replica.prefix + b"/health", replica.auth)
        await resp.read()
        if resp.status != 200:
            return f"/health answered {resp.status}"
        # vLLM's /health takes no key; /v1/models does, so a wrong key shows here.
        resp = await replica.pool.request(b"GET", replica.prefix + b"/v1/models", replica.auth)
        body = await resp.read()
        replica.refused = resp.status if resp.status in CREDENTIALS_REFUSED else None
        if replica.refused is not None:
            return _refusal_cause(self.replicas.index(replica), replica.refused, "/v1/models")
        if resp.status == 200:
            self._learn_models(replica, _model_entries(body))
        resp = await replica.pool.request(b"GET", replica.prefix + b"/metrics", replica.auth)
        body = await resp.read()
        waiting = parse_waiting(body) if resp.status == 200 else None
        self.router.observed_queue(replica.id, waiting)
        step = parse_largest_step(body) if resp.status == 200 and self.listeners else None
        if waiting is not None:
            running = parse_gauge(body, RUNNING_METRIC)
            state = self.router.state(replica.id)
            if state is not None:
                self._tell_queue(replica.id, state.all_inflight, waiting, running, step)
        else:
            self._tell_queue(replica.id, 0, None, None, step)
        return None

    def _tell_queue(
        self,
        replica: ReplicaId,
        inflight: int,
        waiting: float | None,
        running: float | None,
        step: int | None,
    ) -> None:
        """Give the listeners what a probe read. A failure is the listener's, not the
        replica's: logged, and the probe (and the probe loop) goes on."""
        for listener in self.listeners:
            try:
                listener.queue_seen(
                    self, replica, inflight=inflight, waiting=waiting, running=running, step=step
                )
            except Exception:
                log.exception("%r failed on a probe of %s; probing goes on", listener, replica)

    def _learn_models(self, replica: Replica, entries: list[dict[str, Any]]) -> None:
        """Take what the replica's /v1/models lists: its requests follow it (a replica
        restarted with another model), unless the operator pinned its models."""
        if self._replicas.get(replica.config.url) is not replica:
            return  # removed while its probe ran
        before = replica.served
        replica.models = entries
        replica.probed = True
        learnt = replica.learnt
        index = self.replicas.index(replica)
        pinned = replica.config.models
        if pinned is not None:
            mismatch = learnt if learnt != frozenset(pinned) else None
            if mismatch is not None and mismatch != replica.mismatch:
                log.warning(
                    "replica %d lists models %s but is pinned to %s: the pinned list is used",
                    index,
                    sorted(learnt),
                    sorted(pinned),
                )
            replica.mismatch = mismatch
        elif learnt != before:  # news when it changes, not when first learnt
            log.log(
                logging.WARNING if before else logging.INFO,
                "replica %d serves models %s",
                index,
                sorted(learnt),
            )
        self.router.set_models(replica.id, replica.served)

    async def credentials_refused(self, replica: Replica, answer: UpstreamResponse) -> None:
        """A request's answer was 401 or 403: the replica refuses the gateway's API key, not
        the tenant's (the gateway authenticated the tenant). Its answer is dropped (the
        tenant gets the gateway's own), and the replica is down at once, said once."""
        with contextlib.suppress(UpstreamError):
            await answer.read()  # the connection goes back to the pool clean
        self.refused(replica, answer.status)

    def refused(self, replica: Replica, status: int) -> None:
        """The replica answered a request 401 or 403 (`credentials_refused`; saltgate/epp,
        whose Envoy carried the answer): down at once, said once."""
        state = self.router.state(replica.id)
        was_up = state is not None and state.health.probe.up
        replica.refused = status
        self.router.credentials_refused(replica.id)
        if was_up and replica in self.replicas:
            index = self.replicas.index(replica)
            log.warning(
                "replica %d (%s) is down: %s",
                index,
                replica.id,
                _refusal_cause(index, status, "a request"),
            )

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    def start_probing(self) -> None:
        interval = self.router.config.probe_interval_s

        async def loop() -> None:
            # Never ends on an exception: a replica killed after it must still be seen down.
            while True:
                await asyncio.sleep(interval)
                failed = None
                try:
                    await self.probe_all()
                except Exception as exc:
                    failed = exc  # logged outside the handler (buildinfo.py)
                if failed is not None:
                    log.error("a probe round failed (%r); the next runs as planned", failed)

        self._probe_task = asyncio.get_running_loop().create_task(loop())

    async def close(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()
        await asyncio.gather(*retiring, return_exceptions=True)
        for replica in self._replicas.values():
            await replica.pool.close()


def replica_label(url: str) -> str:
    """A replica's URL as a metric label and in logs: stable, without any user:password."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _warn_plaintext(config: ReplicaConfig, index: int) -> None:
    """Said once per replica, when it joins: what allow_plaintext_upstream lets through."""
    host, port, _ = config.authority
    if config.plaintext_remote:
        log.warning(
            "replica %d (%s:%d) is reached over plain http across the network: prompts, "
            "cache salts and its API key cross in clear (allow_plaintext_upstream = true)",
            index,
            host,
            port,
        )
    if config.kv_plaintext_remote:
        log.warning(
            "replica %d (%s:%d): its KV events cross the network without CURVE: cache "
            "salts and token ids in clear (allow_plaintext_upstream = true)",
            index,
            host,
            port,
        )


def tls_context(config: ReplicaConfig, index: int) -> ssl.SSLContext | None:
    """The client context of an https:// replica (its CA bundle, else the system's; its
    client certificate for mutual TLS), None for http://; ConfigError names the file."""
    if not config.tls:
        return None
    try:
        return client_context(config.tls_ca_file, config.tls_cert_file, config.tls_key_file)
    except OSError as exc:  # ssl.SSLError included
        if isinstance(exc, ssl.SSLError):
            reason = tls_failure(exc)
        else:
            reason = exc.strerror or exc.__class__.__name__
        raise ConfigError(
            f"replicas[{index}]: cannot use its TLS files ({reason}): a PEM CA bundle in "
            "tls_ca_file, a PEM certificate and its unencrypted key in tls_cert_file and "
            "tls_key_file"
        ) from None


def _model_entries(body: bytes) -> list[dict[str, Any]]:
    """Model ids and public fields only: nothing that would name the replica."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return []
    return [
        _model_entry(m["id"], m.get("created", 0))
        for m in data
        if isinstance(m, dict) and isinstance(m.get("id"), str)
    ]


def _model_entry(name: str, created: object) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "saltgate"}
