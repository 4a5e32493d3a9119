"""One request's context, from its arrival to its end.

The gateway mints it when a request arrives: the request's id (also the id of its one
usage record), the client's own `x-request-id`, and its start. The request path fills
in what it learns (route, tenant, model, the first byte's time) and the request ends
exactly once, in `end`, which writes its access-log line. A request answered by the
gateway itself ends when its response is ready; a forwarded one ends with its exchange
(gateway/exchange.py), which alone knows its final status and usage.
"""

from __future__ import annotations

from typing import Protocol

from saltgate.gateway.usage import Usage
from saltgate.store.ledger import new_request_id


class RequestLog(Protocol):
    """Where a request's line goes (gateway/access_log.py)."""

    def write(self, context: RequestContext, status: int, usage: Usage | None = None) -> None: ...


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
        self._ended = False

    def end(self, status: int, usage: Usage | None = None) -> None:
        """The request is over: its line is written, once; later calls change nothing."""
        if self._ended:
            return
        self._ended = True
        self._log.write(self, status, usage)
