"""The gateway's request path: authenticate, apply the request policy, salt, forward, meter.

Everything that decides is pure and lives elsewhere (policy/, derivations/, routing/,
gateway/usage.py); this module only strings the steps together between the two I/O
ends: the HTTP server that calls `Gateway.handle` (built around it by serving/run.py,
behind the EHBP edge when that is on) and the upstream pool. A response is delivered
only after its usage record is committed (for streams: the closing `data: [DONE]` waits
for the commit). The gateway owns what it holds: `reload` and `aclose` are its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import orjson

from saltgate import __version__
from saltgate.admin.usage import usage_completions
from saltgate.buildinfo import COMPILED, build_kind
from saltgate.config import GatewayConfig
from saltgate.derivations.derive import SubKeys, cache_salt
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.canary import IsolationCanary
from saltgate.gateway.cluster import ClusterBus
from saltgate.gateway.context import RequestContext, Tracer
from saltgate.gateway.ehbp import plaintext_secret_refused
from saltgate.gateway.exchange import Exchange, Meter
from saltgate.gateway.governor import Governance, Pass
from saltgate.gateway.media import MediaFetcher
from saltgate.gateway.metrics import Labels, Metrics
from saltgate.gateway.readiness import ReplicaView, readiness
from saltgate.gateway.replicas import ReplicaSet
from saltgate.gateway.responses import BY_ID, ResponseOwners, by_id, unknown_response
from saltgate.http import Client, Headers, Request, Response
from saltgate.policy.errors import (
    ApiError,
    gateway_draining,
    missing_parameter,
    model_not_found,
)
from saltgate.policy.fields import band_priority
from saltgate.policy.forwarded import client_address
from saltgate.policy.headers import credential, forward_request_headers, scrub_response_headers
from saltgate.policy.request import (
    ANTHROPIC_ROUTES,
    ROUTE_HEALTH,
    ROUTE_READY,
    ROUTE_USAGE,
    Body,
    Inspected,
    inspect,
    parse_body,
    prepare,
    resolve_route,
)
from saltgate.routing import Plan, ReplicaId
from saltgate.store.errors import StoreUnavailableError
from saltgate.store.ledger import UsageLedger
from saltgate.store.tenants import KeySource, Principal
from saltgate.store.usage_rollups import UsageReader

log = logging.getLogger(__name__)

JSON = [(b"content-type", b"application/json")]
TENANT_SALT_CACHE = 65_536  # tenants x epochs remembered; cleared when full


@dataclasses.dataclass(slots=True)
class Admitted:
    """A request the policy let through (`Gateway.admit`): whose it is, what it asks,
    the router's plan, the body to forward (salted, client salts stripped), the replicas
    not to try, and its pass through governance (None: no limits, no queue)."""

    principal: Principal
    inspected: Inspected
    plan: Plan
    payload: bytes
    avoid: list[ReplicaId]
    pass_: Pass | None

    @property
    def limit_headers(self) -> Headers | None:
        """The rate-limit headers for its answer (None: it has no limits)."""
        return None if self.pass_ is None else self.pass_.headers


def error_response(status: int, message: str) -> Response:
    """The HTTP layer's own errors (malformed HTTP, body over the cap) in OpenAI's shape."""
    return api_error_response(ApiError(status, message))


def api_error_response(error: ApiError) -> Response:
    return Response(error.status, [*JSON, *error.headers], error.body())


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        subkeys: SubKeys,
        keys: KeySource,
        ledger: UsageLedger,
        replicas: ReplicaSet,
        metrics: Metrics,
        access_log: AccessLog | None = None,
        store_down_for: Callable[[], float] | None = None,
        tracer: Tracer | None = None,
        meter: Meter,
        governance: Governance,
        cluster: ClusterBus | None = None,
        usage: UsageReader | None = None,
    ) -> None:
        """The parts are built and wired by serving/run.py (`open_gateway`): ``meter``,
        ``governance`` (limits and the fair queue) and ``cluster``, the bus ([cluster],
        started by start_gateway or start_epp, closed by `aclose`; None: none); queue and
        bus listen to ``replicas``."""
        self.config = config
        self.usage = usage  # GET /v1/usage reads the rollups through it
        self.subkeys = subkeys
        self.keys = keys
        self.ledger = ledger
        self.replicas = replicas
        self.metrics = metrics
        self.meter = meter
        self.governance = governance
        self.cluster = cluster
        # [canary]: the isolation canary (gateway/canary.py), started by serving/run.py.
        self.canary = (
            IsolationCanary(config.canary, replicas, self.metrics)
            if config.canary.enabled
            else None
        )
        self._log = access_log or AccessLog(None)
        # Seconds the store has been out of reach (GatewayStore.unreachable_for), for /ready.
        self._store_down_for = store_down_for or (lambda: 0.0)
        self.tracer = tracer  # [tracing]: a span per request (gateway/tracing.py)
        # [media] remote = "fetch": remote media fetched here and inlined (gateway/media.py)
        self.media = MediaFetcher(config.media, self.metrics) if config.media.fetch else None
        # [responses] store: who owns each response the replicas keep (gateway/responses.py)
        self.owners = ResponseOwners(config.store_settings) if config.responses_store else None
        self._tenant_salts: dict[tuple[str, int], str] = {}
        self.draining = False  # SIGTERM: /ready says no while what is in flight finishes
        self._routes: dict[tuple[bytes, bytes], str] = {}
        self._request_labels: dict[tuple[bytes, int], tuple[tuple[str, str], ...]] = {}
        self._describe_metrics()

    def _describe_metrics(self) -> None:
        m = self.metrics
        m.describe("saltgate_requests_total", "counter", "Requests by method and status.")
        # Replicas are labelled by URL (without userinfo), which stays theirs across a
        # reload; their index in the list would shift.
        m.gauge(
            "saltgate_replica_inflight",
            "Requests in flight per replica (its URL).",
            lambda: [
                (
                    (("replica", r.label),),
                    float(self.replicas.router.inflight(r.id)),
                )
                for _, r, _ in self.replicas.available()
            ],
        )
        m.gauge(
            "saltgate_replica_healthy",
            "1 if the replica passes its health checks and its breaker is not open.",
            lambda: [
                ((("replica", r.label),), float(ok)) for _, r, ok in self.replicas.available()
            ],
        )
        m.gauge(
            "saltgate_limits_share",
            "The processes every tenant's and key's limits are split between when they "
            "cannot be counted in one place (no [cluster] Redis or supervisor, or it does "
            "not answer), each enforcing limit / share ([limits] share x --workers).",
            lambda: [((), float(self.governance.admission.share))],
        )
        if self.governance.admission.shared is not None:
            m.gauge(
                "saltgate_limits_shared_up",
                "1 while limits are checked in one count: [cluster]'s Redis for the whole "
                "fleet, or the supervisor for the workers of one host; 0 while it is "
                "unreachable and this process enforces limit / saltgate_limits_share.",
                lambda: [((), float(self.governance.admission.shared_up))],
            )
        m.gauge(
            "saltgate_plaintext_upstream_replicas",
            "Replicas reached in clear across a network (allow_plaintext_upstream), by link: "
            "http (prompts, salts, API key) or kv_events (salts, token ids). 0 is the goal.",
            self._plaintext_links,
        )
        build = (
            ("version", __version__),
            ("build", "compiled" if build_kind() == COMPILED else "pure"),
        )
        m.gauge(
            "saltgate_build_info",
            "Always 1; its labels say which saltgate runs: the version, and the build "
            "(compiled or pure Python).",
            lambda: [(build, 1.0)],
        )

    def _plaintext_links(self) -> list[tuple[Labels, float]]:
        configs = [r.config for r in self.replicas.replicas]
        return [
            ((("link", "http"),), float(sum(c.plaintext_remote for c in configs))),
            ((("link", "kv_events"),), float(sum(c.kv_plaintext_remote for c in configs))),
        ]

    # -- lifecycle -------------------------------------------------------------------------
    def reload(self, config: GatewayConfig) -> list[asyncio.Task[Any]]:
        """Take a new [[replicas]] list without a restart (SIGHUP); other settings wait
        for the next start. Returns the added replicas' first probes (`ReplicaSet.reload`)."""
        probes = self.replicas.reload(config.replicas)
        self.governance.forget(self.replicas)
        self.config = dataclasses.replace(self.config, replicas=config.replicas)
        return probes

    def cut_answers(self) -> int:
        """The drain grace ran out: end every answer a replica is still giving (each
        stream with an error event in its route's shape, its delivered tokens recorded);
        how many there were."""
        answering = list(self.meter.answering)
        for exchange in answering:
            exchange.cut()
        if answering:
            log.warning(
                "drain grace of %g s over: %d answers still open end with an error event",
                self.config.drain_grace_s,
                len(answering),
            )
        return len(answering)

    async def aclose(self) -> None:
        """Close what the gateway holds, once its server hands it no more requests."""
        if self.cluster is not None:
            await self.cluster.close()
        if self.canary is not None:
            await self.canary.close()
        await self.replicas.close()
        await self.ledger.aclose()
        if self.media is not None:
            self.media.close()
        if self.owners is not None:
            await self.owners.aclose()
        self._log.close()
        await self.keys.aclose()
        if self.usage is not None:
            await self.usage.aclose()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # exports the last spans
        shared = self.governance.admission.shared
        if shared is not None:
            await shared.aclose()

    def reopen_log(self) -> bool:
        """Reopen the access log file (SIGHUP, log rotation); False when it is no file or
        cannot be reopened (said in the log; lines keep going to the old file)."""
        try:
            return self._log.reopen()
        except OSError as exc:
            log.warning(
                "cannot reopen the access log %s (%s); still writing to the old file",
                self._log.path,
                exc.strerror,
            )
            return False

    def readiness(self, model: str | None = None) -> tuple[bool, dict[str, Any]]:
        """What /ready answers (gateway/readiness.py), from the router's health."""
        views = [
            ReplicaView(ok, tuple(sorted(r.served or ())), self.replicas.down_reason(r))
            for _, r, ok in self.replicas.available()
        ]
        return readiness(
            self._store_down_for(),
            self.config.store_outage_grace_s,
            views,
            model,
            draining=self.draining,
        )

    # -- the request path ----------------------------------------------------------------
    async def handle(self, request: Request, body_encrypted: bool = False) -> Response:
        """A request's response; ``body_encrypted``: the EHBP edge opened its body."""
        context = self.begin(request)
        try:
            response = await self._handle(request, context, body_encrypted)
        except ApiError as error:
            response = api_error_response(error)
        response.headers.append((b"x-request-id", context.request_id.encode()))
        if response.stream is None:  # a stream ends with its exchange
            context.end(response.status)
        self.counted(request.method, response.status)
        return response

    def counted(self, method: bytes, status: int) -> None:
        """A request answered with ``status``, in saltgate_requests_total."""
        key = (method, status)
        labels = self._request_labels.get(key)
        if labels is None:  # bounded: llhttp knows a fixed set of methods
            labels = (("method", method.decode()), ("status", str(status)))
            self._request_labels[key] = labels
        self.metrics.inc("saltgate_requests_total", labels)

    def begin(self, request: Request) -> RequestContext:
        """A request's context: its id, client address, access-log line and span."""
        context = RequestContext(
            self._log, request.method, request.header(b"x-request-id"), time.monotonic()
        )
        context.client_addr = client_address(
            request.client.peer, request.headers, self.config.trusted_proxies
        )
        if self.tracer is not None:
            context.span = self.tracer.request(request.method, request.headers)
        return context

    async def _handle(
        self, request: Request, context: RequestContext, body_encrypted: bool
    ) -> Response:
        admitted = await self.admit(request, context, body_encrypted)
        if isinstance(admitted, Response):
            return admitted
        response = await self.exchange(admitted, context, request.client).forward(
            self.replicas,
            admitted.plan,
            request.path,
            forward_request_headers(request.headers, context.request_id),
            admitted.payload,
            client_wants_usage=admitted.inspected.client_wants_usage,
            avoid=admitted.avoid,
        )
        if admitted.limit_headers:
            response.headers += admitted.limit_headers
        return response

    async def admit(
        self, request: Request, context: RequestContext, body_encrypted: bool = False
    ) -> Admitted | Response:
        """The request policy, whole: the answer when the gateway answers it itself
        (health, models, usage, ...), else the request admitted for a replica, salted and
        planned. Refusals raise `ApiError`. The gateway's own path and the EPP's
        (saltgate/epp) both come through here."""
        route = self._routes.get((request.method, request.path))
        if route is None and self.owners is not None:
            found = by_id(request.method, request.path)
            if found is not None:
                return await self._by_id(request, *found)
        if route is None:
            route = resolve_route(request.method, request.path)
            self._routes[(request.method, request.path)] = route  # bounded: allowed routes only
        context.route = route
        if route == ROUTE_HEALTH:
            return Response(200, list(JSON), b'{"status":"ok"}')
        if route == ROUTE_READY:
            models = parse_qs(request.query.decode("utf-8", "replace")).get("model")
            ready, answer = self.readiness(models[-1] if models else None)
            return Response(200 if ready else 503, list(JSON), orjson.dumps(answer))
        if self.draining:  # on a connection open at SIGTERM (serving/run.py)
            raise gateway_draining(anthropic=route in ANTHROPIC_ROUTES)
        principal = self._authenticate(request)
        context.tenant_id = principal.tenant_id
        if route == "/v1/models":
            listed = self.replicas.models(principal.models)
            return Response(200, list(JSON), orjson.dumps({"object": "list", "data": listed}))
        if route == ROUTE_USAGE:
            return await self._usage(request, principal)
        body = parse_body(request.body, self.config.max_body_bytes)
        owners = self.owners
        inspected = inspect(
            route, body.obj, allow_remote=self.media is not None, keeps_responses=owners is not None
        )
        context.model = inspected.model
        self._check_model(route, inspected.model, principal)
        if (
            inspected.user_cache_secret
            and not body_encrypted
            and self.config.require_encrypted_secret
        ):
            raise plaintext_secret_refused()
        salt = self._salt(principal, inspected.user_cache_secret) if self.config.salting else None
        scheduled = self.config.replica_priority_scheduling
        ranked = band_priority(principal.priority) if scheduled else None
        avoid = await self._holding(inspected.previous_response_id, principal)
        plan = self.replicas.plan(
            route, body.obj, inspected.model, salt, remember=inspected.user_cache_secret is None
        )
        # No limits and no queue: no pass, and nothing of governance on this path.
        pass_ = await self.governance.enter(
            principal, route, inspected.model, len(request.body), inspected.max_tokens
        )
        if self.media is not None and inspected.content_rewrite:  # fetched once admitted
            body = await self._inline_media(route, body, principal, pass_)
        payload = prepare(body, inspected, salt, ranked)
        return Admitted(principal, inspected, plan, payload, avoid, pass_)

    def exchange(self, admitted: Admitted, context: RequestContext, client: Client) -> Exchange:
        """The exchange that carries an admitted request to its one usage record."""
        owners = self.owners
        return Exchange(
            self.meter,
            admitted.principal,
            context,
            client,
            pass_=admitted.pass_,
            keep=None if owners is None else owners.record,
        )

    async def _holding(self, previous: str | None, principal: Principal) -> list[ReplicaId]:
        """For a request continuing a response ([responses] store): every replica but the
        one holding it, which is the tenant's, else the answer for an unknown id."""
        if previous is None or self.owners is None:
            return []
        holder = await self.owners.replica_of(previous, principal.tenant_id)
        if holder is None:
            raise unknown_response(previous)
        ids = [r.id for r in self.replicas.replicas]
        if holder not in ids:
            raise ApiError(
                503,
                "The replica that holds this response is no longer served; start a new "
                "conversation.",
                type="service_unavailable",
                code="response_replica_gone",
            )
        return [i for i in ids if i != holder]

    async def _by_id(self, request: Request, ident: str, cancel: bool) -> Response:
        """GET or DELETE /v1/responses/{id}, POST .../cancel ([responses] store): forwarded
        to the replica holding it when it is the caller's, else the unknown-id answer."""
        assert self.owners is not None
        principal = self._authenticate(request)
        holder = await self.owners.replica_of(ident, principal.tenant_id)
        replica = next((r for r in self.replicas.replicas if r.id == holder), None)
        if holder is None or replica is None:
            raise unknown_response(ident)
        path = BY_ID + ident.encode() + (b"/cancel" if cancel else b"")
        upstream = await replica.pool.request(request.method, replica.prefix + path, replica.auth)
        body = await upstream.read()
        if request.method == b"DELETE" and upstream.status == 200:
            await self.owners.forget(ident)
        return Response(upstream.status, scrub_response_headers(upstream.headers), body)

    async def _inline_media(
        self,
        route: str,
        body: Body,
        principal: Principal,
        pass_: Pass | None,
    ) -> Body:
        """``body`` with its remote media fetched and inlined; a refusal frees what the
        admission reserved (no replica will be asked)."""
        assert self.media is not None
        failure: BaseException | None = None
        try:
            return await self.media.inline(route, body, principal.tenant_id)
        except BaseException as exc:
            failure = exc  # settled and raised outside the handler (buildinfo.py)
        if pass_ is not None:
            pass_.settle(None, None)
        raise failure

    async def _usage(self, request: Request, principal: Principal) -> Response:
        """The key's tenant's usage, in the admin API's shape; never another tenant's."""
        if self.usage is None:
            raise ApiError(404, "Usage is not served by this gateway.")
        query = parse_qs(request.query.decode("utf-8", "replace"), keep_blank_values=True)
        status, document = await usage_completions(
            self.usage, {name: values[-1] for name, values in query.items()}, principal.tenant_id
        )
        return Response(status, list(JSON), orjson.dumps(document))

    def _check_model(self, route: str, model: str, principal: Principal) -> None:
        """404 for a model no replica serves or one the tenant may not use, alike; a model
        whose replicas are all down passes, to be answered 503 (no replica)."""
        allowed = principal.models
        if not model:  # /tokenize, /detokenize: the replica's default model
            if allowed is not None:
                raise missing_parameter("model", "one of the models this API key may use")
            return
        if not self.replicas.router.serves(model) or (allowed is not None and model not in allowed):
            raise model_not_found(model, anthropic=route in ANTHROPIC_ROUTES)

    def _salt(self, principal: Principal, user_cache_secret: str | None) -> str:
        """The request's cache salt; tenant-wide salts are remembered (one HMAC per tenant
        and epoch), user salts are not, so no user secret is kept past its request."""
        if user_cache_secret:
            return cache_salt(
                self.subkeys.salt, principal.tenant_id, str(principal.epoch), user_cache_secret
            )
        key = (principal.tenant_id, principal.epoch)
        salt = self._tenant_salts.get(key)
        if salt is None:
            if len(self._tenant_salts) >= TENANT_SALT_CACHE:
                self._tenant_salts.clear()
            salt = cache_salt(self.subkeys.salt, principal.tenant_id, str(principal.epoch), None)
            self._tenant_salts[key] = salt
        return salt

    def _authenticate(self, request: Request) -> Principal:
        """The tenant of the request's API key, sent as `Authorization: Bearer <key>` (the
        OpenAI clients) or `x-api-key: <key>` (the Anthropic ones): one key, once."""
        token = credential(request.headers)
        principal = None
        if token is not None:
            try:
                principal = self.keys.authenticate(token.decode("ascii"))
            except UnicodeDecodeError:
                principal = None
            except StoreUnavailableError as exc:
                raise ApiError(
                    503, str(exc), type="service_unavailable", code="store_unavailable"
                ) from None
        if principal is None:
            raise ApiError(
                401,
                "Invalid or revoked API key.",
                type="authentication_error",
                code="invalid_api_key",
            )
        return principal
