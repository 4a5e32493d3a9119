"""OpenTelemetry traces over OTLP/HTTP, when [tracing] is configured (docs/observability.md).

A request is one SERVER span ("POST /v1/chat/completions"); each attempt at a replica is
a CLIENT child span named as the GenAI semantic conventions name an inference call
("chat sim-model"). Both carry the model and token counts under the conventions'
`gen_ai.*` names, the HTTP status, and the tenant id; the attempt also carries the
replica's URL without userinfo. Nothing else from the request is read: no prompt, no
key, no salt, no user secret, no tenant name can reach a span.

The request span continues the client's W3C trace context (a well-formed `traceparent`,
policy/headers.py) and the replica receives the attempt span's own `traceparent` (with
the client's `tracestate`), so a vLLM started with `--otlp-traces-endpoint` nests its
spans under the attempt. Without [tracing] the client's context passes through as is.

The OpenTelemetry SDK is an optional extra (`saltgate[otel]`) imported only here, and
only by `start_tracer`: without [tracing] the gateway never loads it. This module stays
interpreted (it is not in buildinfo.COMPILED_MODULES): it runs twice per request and
the SDK's own cost dwarfs the interpreter's.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from saltgate.config import ConfigError, TracingConfig
from saltgate.derivations.derive import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MESSAGES,
    ROUTE_RESPONSES,
)
from saltgate.gateway.usage import Usage
from saltgate.policy.headers import TRACE_PARENT, TRACE_STATE, Headers, trace_context

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

    from saltgate.gateway.context import RequestContext

EXTRA_MISSING: Final = (
    "tracing: [tracing] needs the OpenTelemetry SDK and its OTLP/HTTP exporter, which are "
    "not installed: pip install 'saltgate[otel]'"
)
# gen_ai.operation.name by route (the conventions' well-known values); other routes are
# named by their path.
_OPERATIONS: Final = {
    ROUTE_CHAT: "chat",
    ROUTE_RESPONSES: "chat",
    ROUTE_MESSAGES: "chat",
    ROUTE_COMPLETIONS: "text_completion",
    "/v1/embeddings": "embeddings",
}
_TRACE_FIELDS: Final = (TRACE_PARENT, TRACE_STATE)


OTEL_MODULES: Final = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


def require_otel() -> None:
    """ConfigError when the `otel` extra is missing, without importing it (`serve --check`
    says it as `serve` would)."""
    try:
        found = all(importlib.util.find_spec(m) is not None for m in OTEL_MODULES)
    except ModuleNotFoundError:  # a parent package missing
        found = False
    if not found:
        raise ConfigError(EXTRA_MISSING)


def start_tracer(settings: TracingConfig) -> GatewayTracer:
    """The tracer of [tracing], exporting in the background; ConfigError when the
    `otel` extra is not installed, so `saltgate serve` says so at start."""
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError:
        raise ConfigError(EXTRA_MISSING) from None
    provider = TracerProvider(
        resource=Resource.create({"service.name": settings.service_name}),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint + "/v1/traces"))
    )
    return GatewayTracer(provider, trace, TraceContextTextMapPropagator())


class GatewayTracer:
    """Makes the spans of requests; `shutdown` sends what is still buffered."""

    def __init__(self, provider: TracerProvider, api: Any, propagator: Any) -> None:
        self._provider = provider
        self.tracer = provider.get_tracer("saltgate")
        self.api = api  # opentelemetry.trace, loaded by start_tracer
        self.propagator = propagator
        self.error = api.Status(api.StatusCode.ERROR)

    def request(self, method: bytes, headers: Headers) -> RequestSpan:
        """The span of a request that just arrived, under the client's trace if it sent
        a well-formed one."""
        carrier = {
            name.decode(): value.decode()
            for name, value in trace_context([(n, v) for n, v in headers if n in _TRACE_FIELDS])
        }
        verb = method.decode()
        span = self.tracer.start_span(
            verb,
            context=self.propagator.extract(carrier) if carrier else None,
            kind=self.api.SpanKind.SERVER,
            attributes={"http.request.method": verb},
        )
        return RequestSpan(self, span)

    def shutdown(self) -> None:
        """Export the spans still buffered and stop (blocks up to the exporter's timeout)."""
        self._provider.shutdown()


class RequestSpan:
    """One request's span (see the module docstring); `end` is called once, by the
    request's context when the request ends."""

    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: GatewayTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span

    def attempt(self, context: RequestContext, url: str) -> AttemptSpan:
        """A child span for one attempt at the replica at `url` (its label: no userinfo)."""
        tracer = self._tracer
        operation = _OPERATIONS.get(context.route, context.route)
        parts = urlsplit(url)
        span = tracer.tracer.start_span(
            f"{operation} {context.model}".strip(),
            context=tracer.api.set_span_in_context(self._span),
            kind=tracer.api.SpanKind.CLIENT,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": context.model,
                "server.address": parts.hostname or "",
                "server.port": parts.port or (443 if parts.scheme == "https" else 80),
                "saltgate.replica": url,
            },
        )
        carrier: dict[str, str] = {}
        tracer.propagator.inject(carrier, context=tracer.api.set_span_in_context(span))
        headers = [(k.encode(), v.encode()) for k, v in carrier.items()]
        return AttemptSpan(tracer, span, headers)

    def end(self, context: RequestContext, status: int, usage: Usage | None) -> None:
        span = self._span
        if context.route:
            span.update_name(f"{context.method.decode()} {context.route}")
            span.set_attribute("http.route", context.route)
        if context.tenant_id:
            span.set_attribute("saltgate.tenant.id", context.tenant_id)
        if context.model:
            span.set_attribute("gen_ai.request.model", context.model)
        _set_outcome(self._tracer, span, status, usage)
        span.end()


class AttemptSpan:
    """One attempt at a replica, ended once: when it fails before an answer, or with the
    exchange."""

    __slots__ = ("_ended", "_span", "_trace_headers", "_tracer")

    def __init__(self, tracer: GatewayTracer, span: Span, trace_headers: Headers) -> None:
        self._tracer = tracer
        self._span = span
        self._trace_headers = trace_headers
        self._ended = False

    def upstream_headers(self, headers: Headers) -> Headers:
        """`headers` with this attempt's traceparent in place of the client's (the
        client's tracestate, if any, is carried on in it)."""
        return [h for h in headers if h[0] not in _TRACE_FIELDS] + self._trace_headers

    def end(self, status: int, usage: Usage | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        _set_outcome(self._tracer, self._span, status, usage)
        self._span.end()


def _set_outcome(tracer: GatewayTracer, span: Span, status: int, usage: Usage | None) -> None:
    span.set_attribute("http.response.status_code", status)
    if usage is not None:
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        if usage.cached_tokens is not None:  # unknown is not zero
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cached_tokens)
    if status >= 500:
        span.set_attribute("error.type", str(status))
        span.set_status(tracer.error)
