"""The gateway's HTTP edge: authenticate, apply the request policy, salt, forward, meter.

Everything that decides is pure and lives elsewhere (policy/, spec/, gateway/usage.py);
this module only strings the steps together around the two I/O ends: the client
connection and the upstream pool. A response is delivered only after its usage record
is committed (for streams: the closing `data: [DONE]` waits for the commit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import orjson

from saltgate.config import GatewayConfig
from saltgate.gateway.ehbp import plaintext_secret_refused
from saltgate.gateway.metrics import Metrics
from saltgate.gateway.replicas import Replica, ReplicaSet
from saltgate.gateway.usage import SseUsageScanner, Usage, usage_from_body
from saltgate.http import HttpServer, Request, Response, UpstreamError
from saltgate.http.client import UpstreamResponse
from saltgate.policy.errors import ApiError
from saltgate.policy.headers import forward_request_headers, scrub_response_headers
from saltgate.policy.request import Inspected, inspect, parse_json_object, prepare, resolve_route
from saltgate.routing import Plan
from saltgate.spec.derive import SubKeys, cache_salt
from saltgate.store.ledger import Ledger, UsageRecord
from saltgate.store.tenants import KeyIndex, Principal

log = logging.getLogger(__name__)

JSON = [(b"content-type", b"application/json")]
DONE = b"data: [DONE]\n\n"
TENANT_SALT_CACHE = 65_536  # tenants x epochs remembered; cleared when full
CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended


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
        keys: KeyIndex,
        ledger: Ledger,
        replicas: ReplicaSet,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.subkeys = subkeys
        self.keys = keys
        self.ledger = ledger
        self.replicas = replicas
        self.metrics = metrics or Metrics()
        self.http = HttpServer(
            self.handle, max_body_bytes=config.max_body_bytes, error_response=error_response
        )
        self._tenant_salts: dict[tuple[str, int], str] = {}
        self._routes: dict[tuple[bytes, bytes], str] = {}
        self._request_labels: dict[tuple[bytes, int], tuple[tuple[str, str], ...]] = {}
        self._describe_metrics()

    def _describe_metrics(self) -> None:
        m = self.metrics
        m.describe("saltgate_requests_total", "counter", "Requests by method and status.")
        m.describe("saltgate_tokens_total", "counter", "Tokens metered, by kind.")
        m.describe("saltgate_upstream_failures_total", "counter", "Failed upstream exchanges.")
        m.gauge(
            "saltgate_replica_inflight",
            "Requests in flight per replica (index in the configuration).",
            lambda: [
                ((("replica", str(i)),), float(self.replicas.router.inflight(r.id)))
                for i, r, _ in self.replicas.available()
            ],
        )
        m.gauge(
            "saltgate_replica_healthy",
            "1 if the replica passes its health checks and its breaker is not open.",
            lambda: [((("replica", str(i)),), float(ok)) for i, _, ok in self.replicas.available()],
        )

    # -- the request path ----------------------------------------------------------------
    async def handle(self, request: Request, body_encrypted: bool = False) -> Response:
        started = time.monotonic()
        try:
            response = await self._handle(request, started, body_encrypted)
        except ApiError as error:
            response = api_error_response(error)
        key = (request.method, response.status)
        labels = self._request_labels.get(key)
        if labels is None:  # bounded: llhttp knows a fixed set of methods
            labels = (("method", request.method.decode()), ("status", str(response.status)))
            self._request_labels[key] = labels
        self.metrics.inc("saltgate_requests_total", labels)
        return response

    async def _handle(self, request: Request, started: float, body_encrypted: bool) -> Response:
        route = self._routes.get((request.method, request.path))
        if route is None:
            route = resolve_route(request.method, request.path)
            self._routes[(request.method, request.path)] = route  # bounded: allowed routes only
        if route == "/health":
            return Response(200, list(JSON), b'{"status":"ok"}')
        principal = self._authenticate(request)
        if route == "/v1/models":
            return Response(
                200, list(JSON), orjson.dumps({"object": "list", "data": self.replicas.models()})
            )
        body = parse_json_object(request.body, self.config.max_body_bytes)
        inspected = inspect(route, body)
        if (
            inspected.user_cache_secret
            and not body_encrypted
            and self.config.require_encrypted_secret
        ):
            raise plaintext_secret_refused()
        salt = self._salt(principal, inspected.user_cache_secret) if self.config.salting else None
        payload = prepare(body, inspected, salt)
        plan = self.replicas.plan(
            route, body, inspected.model, salt, remember=inspected.user_cache_secret is None
        )
        return await self._forward(request, principal, inspected, payload, started, plan=plan)

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
        header = request.header(b"authorization")
        if header is None:
            raise ApiError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                type="authentication_error",
                code="missing_api_key",
            )
        scheme, _, token = header.partition(b" ")
        principal = None
        if scheme.lower() == b"bearer" and token:
            try:
                principal = self.keys.authenticate(token.strip().decode("ascii"))
            except UnicodeDecodeError:
                principal = None
        if principal is None:
            raise ApiError(
                401,
                "Invalid or revoked API key.",
                type="authentication_error",
                code="invalid_api_key",
            )
        return principal

    async def _forward(
        self,
        request: Request,
        principal: Principal,
        inspected: Inspected,
        payload: bytes,
        started: float,
        *,
        plan: Plan,
    ) -> Response:
        headers = forward_request_headers(request.headers)
        tried: set[str] = set()  # a failure before the first byte moves on down the ranking
        while True:
            replica = self.replicas.pick(plan, tried)
            if replica is None:
                raise ApiError(
                    503,
                    "No replica is available to serve this request; try again shortly.",
                    type="service_unavailable",
                    code="no_replica",
                )
            prefill = self.replicas.started(replica, plan)
            try:
                upstream = await replica.pool.request(
                    b"POST", replica.prefix + request.path, headers + replica.auth, payload
                )
                self.replicas.responded(replica)
                break
            except UpstreamError as exc:
                self.replicas.failed(replica)
                self.replicas.finished(replica, prefill)
                self.metrics.inc("saltgate_upstream_failures_total")
                tried.add(replica.id)
                if not exc.before_response:
                    raise ApiError(
                        502, "The replica failed while answering; retry the request."
                    ) from None
            except BaseException:
                self.replicas.finished(replica, prefill)
                raise
        record = _Metering(self, principal, inspected.model, started)
        response_headers = scrub_response_headers(upstream.headers)
        content_type = upstream.header(b"content-type") or b""
        if upstream.status == 200 and content_type.startswith(b"text/event-stream"):
            stream = self._relay_stream(
                upstream, replica, prefill, record, inspected.client_wants_usage
            )
            return Response(200, response_headers, stream=stream)
        try:
            body = await upstream.read()
        except UpstreamError:
            self.replicas.failed(replica)
            await record.commit(Usage(), 502)
            raise ApiError(502, "The replica failed while answering; retry the request.") from None
        finally:
            self.replicas.finished(replica, prefill)
        usage = usage_from_body(body) if upstream.status == 200 else None
        await record.commit(usage or Usage(), upstream.status)
        return Response(upstream.status, response_headers, body)

    async def _relay_stream(
        self,
        upstream: UpstreamResponse,
        replica: Replica,
        prefill: float,
        record: _Metering,
        client_wants_usage: bool,
    ) -> AsyncIterator[bytes]:
        """Pass the stream through; its first chunk tells the router the prefill is done."""
        scanner = SseUsageScanner(drop_usage_event=not client_wants_usage)
        status = CLIENT_CLOSED
        held = b""
        try:
            async for chunk in upstream.chunks():
                if prefill:
                    self.replicas.prefilled(replica, prefill)
                    prefill = 0.0
                out = scanner.feed(chunk)
                if out.endswith(DONE):
                    out, held = out[: -len(DONE)], DONE
                if out:
                    yield out
            held += scanner.flush()
            status = 200
        except UpstreamError:
            status = 502
            self.replicas.failed(replica)
            error = ApiError(502, "The replica failed during the stream; retry the request.")
            held = b"data: " + error.body() + b"\n\n"
        finally:
            self.replicas.finished(replica, prefill)
            upstream.release()
            if status == CLIENT_CLOSED:
                # The client is gone and this generator is being torn down: record what was
                # used without awaiting here, so the record is not lost with the task.
                asyncio.get_running_loop().create_task(
                    record.commit(scanner.usage or Usage(), status)
                )
        await record.commit(scanner.usage or Usage(), status)
        if held:
            yield held


_PROMPT = (("kind", "prompt"),)
_CACHED = (("kind", "cached"),)
_COMPLETION = (("kind", "completion"),)


class _Metering:
    """One request's usage record; `commit` returns once it is durable in the ledger."""

    __slots__ = ("gateway", "model", "principal", "started")

    def __init__(self, gateway: Gateway, principal: Principal, model: str, started: float) -> None:
        self.gateway = gateway
        self.principal = principal
        self.model = model
        self.started = started

    async def commit(self, usage: Usage, status: int) -> None:
        p = self.principal
        await self.gateway.ledger.record(
            UsageRecord(
                ts=time.time(),
                tenant_id=p.tenant_id,
                key_id=p.key_id,
                model=self.model,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=usage.cached_tokens,
                completion_tokens=usage.completion_tokens,
                status=status,
            )
        )
        m = self.gateway.metrics
        tokens = m.series("saltgate_tokens_total")
        tokens[_PROMPT] += usage.prompt_tokens
        tokens[_CACHED] += usage.cached_tokens
        tokens[_COMPLETION] += usage.completion_tokens
        m.observe_latency((), time.monotonic() - self.started)
