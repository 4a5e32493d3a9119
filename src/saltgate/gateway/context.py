"""One request's context, from its arrival to its end.

The gateway mints it when a request arrives: the request's id (also the id of its one
usage record), the client's own `x-request-id`, and its start. The request path fills
in what it learns (route, tenant, model, the first byte's time) and the request ends
exactly once, in `end`, which writes its access-log line (and ends its span, with
[tracing]: gateway/tracing.py). A request answered by the gateway itself ends when its
response is ready; a forwarded one ends with its exchange (gateway/exchange.py), which
alone knows its final status and usage.
"""

from __future__ import annotations

from typing import Protocol

from saltgate.gateway.usage import Usage
from saltgate.policy.headers import Headers
from saltgate.store.ledger import new_request_id


class RequestLog(Protocol):
    """Where a request's line goes (gateway/access_log.py)."""

    def write(self, context: RequestContext, status: int, usage: Usage | None = None) -> None: ...


class AttemptTrace(Protocol):
    """The span of one attempt at a replica (gateway/tracing.py)."""

    def upstream_headers(self, headers: Headers) -> Headers: ...

    def end(self, status: int, usage: Usage | None = None) -> None: ...


class RequestTrace(Protocol):
    """The span of one request (gateway/tracing.py)."""

    def attempt(self, context: RequestContext, url: str) -> AttemptTrace: ...

    def end(self, context: RequestContext, status: int, usage: Usage | None) -> None: ...


class Tracer(Protocol):
    """Where requests' spans come from: gateway/tracing.py, loaded only with [tracing]."""

    def request(self, method: bytes, headers: Headers) -> RequestTrace: ...

    def shutdown(self) -> None: ...


class RequestContext:
    """See the module docstring."""

    __slots__ = (
        "_ended",
        "_log",
        "client_addr",
        "client_request_id",
        "first_byte",
        "method",
        "model",
        "request_id",
        "route",
        "span",
        "started",
        "tenant_id",
    )

    def __init__(
        self, log: RequestLog, method: bytes, client_request_id: bytes | None, started: float
    ) -> None:
        self._log = log
        self.request_id = new_request_id()
        self.method = method
        self.client_request_id = client_request_id
        self.client_addr = ""  # the TCP peer, or whom a trusted proxy names (policy/forwarded.py)
        self.started = started
        self.route = ""
        self.tenant_id = ""
        self.model = ""
        self.first_byte = 0.0
        self.span: RequestTrace | None = None
        self._ended = False

    def end(self, status: int, usage: Usage | None = None) -> None:
        """The request is over: its line is written, once; later calls change nothing."""
        if self._ended:
            return
        self._ended = True
        self._log.write(self, status, usage)
        if self.span is not None:
            self.span.end(self, status, usage)
