"""The ext_proc server: one gRPC stream per HTTP request Envoy carries (docs/epp.md).

A thin shell: the request policy is `Gateway.admit` (the gateway's own, whole), the
replica is the gateway's router's pick (`ReplicaSet.acquire`), and the ending is the
gateway's `Exchange` (one usage record, limits settled, router told). What is here only
translates between Envoy's messages and those: the request's headers and buffered body
in; the salted body, the forwarded headers, `x-gateway-destination-endpoint` and the
`envoy.lb` fallback list out (or an ImmediateResponse with the gateway's answer); then
the replica's response headers scrubbed and its streamed body metered chunk by chunk.
The chunk that ends the response is answered only once its record is committed.
An EHBP request is opened first by the gateway's own `EhbpOpener` (gateway/ehbp.py), and
every answer to it, the replica's chunks and the EPP's own, is sealed as the gateway's
edge seals it, one frame per chunk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from saltgate.config import GatewayConfig, parse_authority
from saltgate.ehbp.frames import Keyring, ResponseSealer
from saltgate.epp import GRPC_OPTIONS
from saltgate.epp.envoy import (
    ANSWER_DETAILS,
    DESTINATION,
    EXT_PROC,
    LB_NAMESPACE,
    UPSTREAM_ADDRESS,
    VIA_UPSTREAM,
    message_timeout_s,
)
from saltgate.epp.metrics import MetricsListener, metrics_tls, start_metrics_listener
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.context import RequestContext
from saltgate.gateway.ehbp import EhbpOpener
from saltgate.gateway.exchange import (
    CLIENT_CLOSED,
    DONE,
    NOT_SERVED,
    Exchange,
    no_replica,
)
from saltgate.gateway.metrics import duration_buckets
from saltgate.gateway.replicas import CREDENTIALS_REFUSED, Attempt
from saltgate.gateway.server import Admitted, Gateway, api_error_response
from saltgate.gateway.usage import SseUsageScanner, Usage, delivered_usage, usage_from_body
from saltgate.governance.limits import prompt_estimate
from saltgate.http import Client, Headers, Request, Response
from saltgate.policy.errors import ApiError
from saltgate.policy.fields import scrub_answer, scrub_events
from saltgate.policy.headers import forward_request_headers, scrub_response_headers
from saltgate.routing import Plan, ReplicaId
from saltgate.runtime import listen_error
from saltgate.serving.run import ehbp_keyring, open_gateway

log = logging.getLogger(__name__)

SERVICE: Final = "envoy.service.ext_proc.v3.ExternalProcessor"
_STREAMS: Final = "saltgate_epp_streams_total"
_STREAM_ERRORS: Final = "saltgate_epp_stream_errors_total"
_ACTIVE: Final = "saltgate_epp_streams_active"
_DECISION: Final = "saltgate_epp_decision_seconds"
_REQUEST_PHASE: Final = frozenset({"request_headers", "request_body"})
_METHODS: Final = frozenset(
    {b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE"}
)
_CANCELLED: Final = (("kind", "cancelled"),)
_FAILED: Final = (("kind", "failed"),)
_SSE: Final = b"text/event-stream"
_CONTINUE_AND_REPLACE: Final = ext.CommonResponse.ResponseStatus.CONTINUE_AND_REPLACE
_OVERWRITE: Final = base_pb2.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


@functools.lru_cache(maxsize=1024)
def endpoint(url: str) -> str:
    """A replica's `ip:port` (from its URL), as the GIE protocol names endpoints: once per
    URL, not per replica of every request's list."""
    host, port, _ = parse_authority(url)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _headers(message: ext.HttpHeaders) -> Headers:
    return [
        (h.key.lower().encode(), h.raw_value or h.value.encode()) for h in message.headers.headers
    ]


def _attribute(message: ext.ProcessingRequest, name: str) -> str:
    """One of the attributes Envoy sends with a message (the shipped configuration's
    `response_attributes`), "" when absent."""
    sent = message.attributes.get(EXT_PROC)
    value = sent.fields.get(name) if sent is not None else None
    return value.string_value if value is not None else ""


def _request(headers: Headers, body: bytes) -> Request:
    """The saltgate request Envoy describes with its pseudo-headers."""
    pseudo = {k: v for k, v in headers if k.startswith(b":")}
    path, _, query = pseudo.get(b":path", b"/").partition(b"?")
    plain = [(k, v) for k, v in headers if not k.startswith(b":")]
    return Request(pseudo.get(b":method", b"GET"), path, query, plain, body, Client())


def _mutation(incoming: Headers, outgoing: Headers) -> ext.HeaderMutation:
    """Headers set to ``outgoing``: every other incoming one (but pseudo-headers and host,
    which Envoy owns) removed."""
    kept = {k for k, _ in outgoing}
    return ext.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k.decode(), raw_value=v), append_action=_OVERWRITE
            )
            for k, v in outgoing
        ],
        remove_headers=sorted(
            {
                k.decode()
                for k, _ in incoming
                if k not in kept and not k.startswith(b":") and k != b"host"
            }
        ),
    )


def immediate(response: Response) -> ext.ProcessingResponse:
    """The gateway's own answer (an error in OpenAI's shape, /health, /v1/models, ...)
    as Envoy's ImmediateResponse: Envoy sends it and asks no replica."""
    return ext.ProcessingResponse(
        immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=response.status),
            headers=_mutation([], response.headers),
            body=response.body,
        )
    )


def destination(
    incoming: Headers,
    forwarded: Headers,
    payload: bytes,
    ranked: Sequence[str],
    *,
    headers_phase: bool,
) -> ext.ProcessingResponse:
    """The request on its way to ``ranked[0]``: headers, salted body, the GIE header and
    the `envoy.lb` dynamic metadata with the ordered list (the rest are fallbacks)."""
    outgoing = [
        *forwarded,
        (b"content-length", str(len(payload)).encode()),
        (DESTINATION.encode(), ranked[0].encode()),
    ]
    common = ext.CommonResponse(
        header_mutation=_mutation(incoming, outgoing),
        body_mutation=ext.BodyMutation(body=payload),
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: ",".join(ranked)}})
    if headers_phase:
        common.status = _CONTINUE_AND_REPLACE
        return ext.ProcessingResponse(
            request_headers=ext.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return ext.ProcessingResponse(
        request_body=ext.BodyResponse(response=common), dynamic_metadata=metadata
    )


class _Conversation:
    """One HTTP request's stream of ext_proc messages, from its headers to its record."""

    def __init__(self, gateway: Gateway, ehbp: EhbpOpener | None) -> None:
        self.gateway = gateway
        self.ehbp = ehbp
        # An EHBP request's: the response nonce header and the sealer of every answer
        self.nonce: tuple[bytes, bytes] | None = None
        self.sealer: ResponseSealer | None = None
        self.body_bytes = 0  # the forwarded body's, for a stream cut short's estimate
        self.headers: Headers = []
        self.context: RequestContext | None = None
        self.exchange: Exchange | None = None
        self.attempt: Attempt | None = None
        self.plan: Plan | None = None
        self.ranked: list[tuple[str, ReplicaId]] = []  # the list Envoy walks: (ip:port, id)
        self.client_wants_usage = False
        self.added: Headers = []  # for the client: the gateway's request id, limit headers
        self.status = 0  # the replica's, once its headers came
        self.scanner: SseUsageScanner | None = None
        self.held = b""  # a stream's closing [DONE], until its record is committed
        self.whole = bytearray()  # a whole answer, gathered to meter and scrub it
        self.ended = False

    async def answer(self, message: ext.ProcessingRequest) -> ext.ProcessingResponse:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(message.request_headers)
            if not message.request_headers.end_of_stream:
                return ext.ProcessingResponse(request_headers=ext.HeadersResponse())
            return await self._request(b"", headers_phase=True)
        if kind == "request_body":
            return await self._request(message.request_body.body, headers_phase=False)
        if kind == "response_headers":
            return await self._response_headers(message)
        if kind == "response_body":
            body = message.response_body
            return await self._response_body(body.body, body.end_of_stream)
        # trailers are not asked for (the shipped configuration skips them)
        return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())

    # -- the request: the gateway's policy, then the router's pick ------------------------
    async def _request(self, body: bytes, *, headers_phase: bool) -> ext.ProcessingResponse:
        gateway = self.gateway
        request = _request(self.headers, body)
        encrypted = False
        if self.ehbp is not None:  # as the gateway's edge: before the gateway sees it
            opened = self.ehbp.key_config(request) or self.ehbp.open(request)
            if isinstance(opened, Response):  # the key config, or an envelope refused
                self.ended = True
                return immediate(opened)
            if opened is not None:
                request, encrypted = opened.request, True
                self.nonce, self.sealer = opened.sealer()
        context = self.context = gateway.begin(request)
        try:
            admitted = await gateway.admit(request, context, encrypted)
            if isinstance(admitted, Response):
                return self._answered(context, admitted)
            return await self._send(request, context, admitted, headers_phase)
        except ApiError as error:
            return self._answered(context, api_error_response(error))

    def _answered(self, context: RequestContext, response: Response) -> ext.ProcessingResponse:
        response.headers.append((b"x-request-id", context.request_id.encode()))
        context.end(response.status)
        self.ended = True
        self._counted(response.status)
        return self._immediate(response)

    def _immediate(self, response: Response) -> ext.ProcessingResponse:
        """`immediate`, sealed for an EHBP request (the gateway's edge seals its own
        answers too)."""
        if self.sealer is None or self.nonce is None:
            return immediate(response)
        headers = [(n, v) for n, v in response.headers if n != b"content-length"]
        sealed = self.sealer.seal(response.body)
        return immediate(Response(response.status, [*headers, self.nonce], sealed))

    def _counted(self, status: int) -> None:
        """The client's answer in saltgate_requests_total, as the gateway counts it; a
        method outside the standard ones as OTHER (Envoy passes any token through, and a
        client must not add series by inventing them)."""
        method = next((v for k, v in self.headers if k == b":method"), b"GET")
        self.gateway.counted(method if method in _METHODS else b"OTHER", status)

    async def _send(
        self, request: Request, context: RequestContext, admitted: Admitted, headers_phase: bool
    ) -> ext.ProcessingResponse:
        gateway = self.gateway
        exchange = gateway.exchange(admitted, context, request.client)
        replicas, plan = gateway.replicas, admitted.plan
        attempt = await exchange.relay(replicas, plan, admitted.avoid, len(admitted.payload))
        if attempt is None:
            exchange.unserved()
            raise no_replica()
        self.exchange, self.attempt, self.plan = exchange, attempt, plan
        self.ranked = self._ranked(admitted, attempt.replica.id)
        self.added = [
            *(admitted.limit_headers or ()),
            (b"x-request-id", context.request_id.encode()),
        ]
        self.client_wants_usage = admitted.inspected.client_wants_usage
        self.body_bytes = len(admitted.payload)
        forwarded = forward_request_headers(request.headers, context.request_id)
        return destination(
            self.headers,
            forwarded + attempt.replica.auth,
            admitted.payload,
            [name for name, _ in self.ranked],
            headers_phase=headers_phase,
        )

    def _ranked(self, admitted: Admitted, first: ReplicaId) -> list[tuple[str, ReplicaId]]:
        """The picked replica, then the others in the router's retry order (its
        rendezvous ranking for the request, else the least loaded first): the endpoint
        names of the `envoy.lb` list, with their replicas."""
        replicas = self.gateway.replicas
        router = replicas.router
        plan, now = admitted.plan, time.monotonic()
        if plan.key is not None:
            order = router.ranking(plan.key, now, plan.model)
        else:
            order = [s.id for s in sorted(router.usable(plan.model, now), key=lambda s: s.load)]
        avoid = set(admitted.avoid)
        by_id = {r.id: r for r in replicas.replicas}
        ids = [first, *(i for i in order if i != first and i not in avoid)]
        return [(endpoint(by_id[i].config.url), i) for i in ids if i in by_id]

    def _answering(self, message: ext.ProcessingRequest) -> Attempt | None:
        """The attempt of the replica whose answer Envoy relays, after telling the router
        of the ones it could not reach first (it walks the list on connection failures);
        None when Envoy answers itself (no replica of the list could be reached, or none
        was tried: Envoy's own circuit breakers)."""
        exchange, attempt, plan = self.exchange, self.attempt, self.plan
        assert exchange is not None and attempt is not None and plan is not None
        served = _attribute(message, UPSTREAM_ADDRESS)
        names = [name for name, _ in self.ranked]
        tried = names.index(served) + 1 if served in names else 1
        answered = _attribute(message, ANSWER_DETAILS) == VIA_UPSTREAM
        unreached = self.ranked[1 : tried - 1 if answered else tried]
        router, now = self.gateway.replicas.router, time.monotonic()
        for _, replica_id in unreached:
            router.failed(replica_id, now)
        if not answered:
            if served:  # it tried the pick at least; else it tried none (its own limits)
                exchange.failed()
            return None
        if tried == 1:
            return attempt
        moved = self.gateway.replicas.attempt_on(plan, self.ranked[tried - 1][1])
        if moved is None:  # the replica was removed (SIGHUP) meanwhile: keep the first
            return attempt
        exchange.moved(moved)
        self.attempt = moved
        return moved

    # -- the response: scrubbed, metered, released after its record -----------------------
    async def _response_headers(self, request: ext.ProcessingRequest) -> ext.ProcessingResponse:
        message = request.response_headers
        incoming = _headers(message)
        status = dict(incoming).get(b":status", b"0")
        self.status = int(status) if status.isdigit() else 0
        plain = [(k, v) for k, v in incoming if not k.startswith(b":")]
        exchange = self.exchange
        attempt = self.attempt
        if attempt is not None and exchange is not None:
            attempt = self._answering(request)
            if attempt is None:  # Envoy's own answer: the gateway's, as when all failed
                await self._end(NOT_SERVED, None)
                return self._refused()
        if attempt is not None and exchange is not None and self.status in CREDENTIALS_REFUSED:
            # The replica refuses the gateway's key, not the tenant's: never relayed; the
            # replica is down, and the tenant gets the gateway's answer for no replica.
            self.gateway.replicas.refused(attempt.replica, self.status)
            exchange.failed()
            await self._end(NOT_SERVED, None)
            return self._refused()
        if attempt is not None:
            attempt.responded()
        if exchange is not None:
            content_type = dict(plain).get(b"content-type", b"")
            if self.status == 200 and content_type.startswith(_SSE):
                self.scanner = SseUsageScanner(drop_usage_event=not self.client_wants_usage)
            if message.end_of_stream:
                await self._end(self.status, None)
        self._counted(self.status)
        # The body may change (salts, answer fields): Envoy frames what it sends.
        outgoing = scrub_response_headers(plain) + self.added
        if self.nonce is not None:  # an EHBP request's answer: sealed (_body)
            outgoing.append(self.nonce)
        mutation = _mutation(plain, outgoing)
        if b"content-length" in dict(plain):
            mutation.remove_headers.append("content-length")
        return ext.ProcessingResponse(
            response_headers=ext.HeadersResponse(
                response=ext.CommonResponse(header_mutation=mutation)
            )
        )

    def _refused(self) -> ext.ProcessingResponse:
        """The gateway's 503 `no_replica` instead of the response Envoy has."""
        refusal = api_error_response(no_replica())
        refusal.headers += self.added
        self._counted(refusal.status)
        return self._immediate(refusal)

    async def _response_body(self, chunk: bytes, last: bool) -> ext.ProcessingResponse:
        exchange = self.exchange
        if exchange is None or self.ended:
            return self._body(chunk)
        scanner = self.scanner
        if scanner is None:  # a whole answer: metered and scrubbed once it is all here
            self.whole += chunk
            if not last:
                return self._body(b"")
            body = bytes(self.whole)
            if self.status == 200:
                await exchange.keep(body)  # [responses] store: whose it is, where it is
            await self._end(self.status, usage_from_body(body) if self.status == 200 else None)
            return self._body(scrub_answer(body))
        if chunk:
            exchange.output(chunk)
        out = self.held + scrub_events(scanner.feed(chunk))
        self.held = b""
        if out:
            await exchange.keep(out)
        if last:
            out += scrub_events(scanner.flush())
            await self._end(200, scanner.usage)  # committed before the end is released
            return self._body(out)
        if out.endswith(DONE):
            out, self.held = out[: -len(DONE)], DONE
        return self._body(out)

    def _body(self, data: bytes) -> ext.ProcessingResponse:
        """The chunk Envoy relays in place of the replica's: sealed as one EHBP frame for
        an encrypted request (nothing for nothing)."""
        return _body(data if self.sealer is None else self.sealer.seal(data))

    async def _end(self, status: int, usage: Usage | None) -> None:
        exchange = self.exchange
        if exchange is not None and not self.ended:
            self.ended = True
            await exchange.end(status, usage)

    @property
    def unended(self) -> bool:
        """Whether a request went to a replica and its exchange has not ended."""
        return self.exchange is not None and not self.ended

    async def close(self) -> None:
        """The stream ended before its response's end: the client left, and Envoy reset
        the replica's stream (vLLM aborts the request). Recorded 499 as the gateway records
        a client gone, with what the stream showed, else what was relayed, estimated as the
        drain does. The replica is not blamed: a replica Envoy could not reach, or one that
        broke, comes as Envoy's own answer through the response headers (`_answering`)."""
        if self.exchange is None or self.ended:
            return
        scanner, route = self.scanner, self.context.route if self.context else ""
        usage = None
        if scanner is not None:
            usage = delivered_usage(route, scanner, prompt_estimate(self.body_bytes))
        await self._end(CLIENT_CLOSED, usage)


def _body(data: bytes) -> ext.ProcessingResponse:
    mutation = ext.BodyMutation(body=data) if data else ext.BodyMutation(clear_body=True)
    return ext.ProcessingResponse(
        response_body=ext.BodyResponse(response=ext.CommonResponse(body_mutation=mutation))
    )


class ExternalProcessor(ext_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(self, gateway: Gateway, ehbp: EhbpOpener | None) -> None:
        self.gateway = gateway
        self.ehbp = ehbp
        self.active = 0
        m = gateway.metrics
        m.describe(_STREAMS, "counter", "ext_proc streams Envoy opened, one per HTTP request.")
        m.describe(
            _STREAM_ERRORS,
            "counter",
            "ext_proc streams ended by an error, by kind: cancelled (Envoy reset the stream: "
            "its client left, or it gave up waiting) or failed (the EPP raised: Envoy "
            "answered 5xx).",
        )
        m.gauge(_ACTIVE, "ext_proc streams open now.", lambda: [((), float(self.active))])
        m.histogram(
            _DECISION,
            "Time the EPP takes to answer a request's headers or body: the policy, a turn "
            "in the fair queue, the pick.",
            duration_buckets(message_timeout_s(gateway.config.queue.max_queue_s)),
        )

    async def Process(  # the gRPC method's name
        self, requests: AsyncIterator[ext.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext.ProcessingResponse]:
        metrics = self.gateway.metrics
        metrics.inc(_STREAMS)
        self.active += 1
        conversation = _Conversation(self.gateway, self.ehbp)
        try:
            async for message in requests:
                if message.WhichOneof("request") not in _REQUEST_PHASE:
                    yield await conversation.answer(message)
                    continue
                started = time.monotonic()
                answer = await conversation.answer(message)
                metrics.observe(_DECISION, (), time.monotonic() - started)
                yield answer
        except (asyncio.CancelledError, GeneratorExit):
            metrics.inc(_STREAM_ERRORS, _CANCELLED)
            raise
        except Exception:
            metrics.inc(_STREAM_ERRORS, _FAILED)
            raise
        finally:
            self.active -= 1
            if conversation.unended:  # no task for the many that ended already
                await asyncio.shield(conversation.close())


@dataclass
class RunningEpp:
    gateway: Gateway
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    ehbp: EhbpOpener | None = None  # [ehbp] enabled: its keyring may be replaced to rotate
    metrics: MetricsListener | None = None  # [epp] metrics_port
    closed: bool = False

    def reload(self, config: GatewayConfig) -> list[asyncio.Task[Any]]:
        """A new [[replicas]] list (SIGHUP); the added replicas' first probes returned."""
        return self.gateway.reload(config)

    async def close(self, grace_s: float | None = None) -> None:
        """Drain: health NOT_SERVING and /ready draining at once, streams under way given
        ``grace_s`` (default `[gateway] drain_grace_s`), then the gateway's parts closed;
        once."""
        if self.closed:
            return
        self.closed = True
        self.gateway.draining = True
        await self.health.enter_graceful_shutdown()
        grace = self.gateway.config.drain_grace_s if grace_s is None else grace_s
        await self.server.stop(grace)
        if self.metrics is not None:
            await self.metrics.close()
        await self.gateway.aclose()


async def start_epp(
    config: GatewayConfig,
    *,
    workers: int = 1,
    host_limits: socket.socket | None = None,
    keyring: Keyring | None = None,
) -> RunningEpp:
    """The gateway's parts behind an ext_proc server on [gateway] host, [epp] grpc_port
    (0: a free port), with the standard gRPC health service: SERVING once the replicas
    had their first probe and the isolation canary its first round ([canary]). A worker
    of `saltgate epp --workers N` (epp/supervisor.py) is one of `workers`, with its
    channel to the supervisor's count of the host's limits and the EHBP keyring its
    parent gave every worker."""
    if config.ehbp and keyring is None:
        keyring = ehbp_keyring(config)  # refused before anything opens
    tls = metrics_tls(config)  # its refusal first: nothing opened or bound
    access_log = AccessLog.open(config.access_log, config.log_format)
    gateway = await open_gateway(
        config, access_log, workers=workers, host_limits=host_limits, bus=True
    )
    server = grpc.aio.server()
    ehbp = None if keyring is None else EhbpOpener(keyring, gateway.metrics)
    ext_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(gateway, ehbp), server)
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    metrics = None
    try:
        try:
            port = server.add_insecure_port(f"{config.host}:{config.epp.grpc_port}")
        except RuntimeError as exc:  # grpc's word for a bind that failed
            failed = OSError(str(exc))
            raise listen_error(GRPC_OPTIONS, config.host, config.epp.grpc_port, failed) from None
        await server.start()
        await gateway.replicas.probe_all()
        gateway.replicas.start_probing()
        if gateway.canary is not None:  # its first round before serving, as the gateway's
            await gateway.canary.run_all()
            gateway.canary.start()
        if gateway.cluster is not None:  # [cluster]: routing state shared, as the gateway's
            gateway.cluster.start()
        metrics = await start_metrics_listener(config, gateway, access_log, tls)
    except BaseException:
        await server.stop(None)
        await gateway.aclose()
        raise
    for name in ("", SERVICE):
        await checks.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningEpp(gateway, server, port, checks, ehbp, metrics)
