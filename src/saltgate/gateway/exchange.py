"""One forwarded request, from its first attempt at a replica to its one usage record.

An `Exchange` owns everything a forwarded request holds: the replica attempt (in-flight
count and prefill estimate, `gateway/replicas.py`), the upstream response and the ledger
record. It ends exactly once (`_end`), and every way a request can end goes through it:

    ending                                    record status     usage recorded
    the replica answered, client still there  the replica's     the replica's
    the client left, before or during it      499 (*)           the replica's (see below)
    the replica broke before answering        next replica; with none left: 503, none
    the replica broke while answering         502               what the stream showed
    cancelled (the gateway stops)             499 / 503         what the stream showed

A replica reports usage once, at the end of its answer, so when the client leaves the
exchange runs on to that end without relaying anything (the HTTP server does not cancel
the gateway's handler, and a stream's `aclose` reads the rest). That keeps every request a
replica served metered: leaving early is neither a way around billing nor a lost record.
The cost: the replica finishes a request nobody reads, as it would for a client that
stayed. For a stream, the exchange is the response body itself: the HTTP server always
calls its `aclose`, whether the body was sent whole, in part or not at all.

(*) With on_client_gone = "finish", the gateway knows the client left once a write to it
fails: its FIN alone may be a half-close, after which it still reads its answer (RFC 9112,
section 9.6), and gets it. A stream is then recorded 499 from its next event on; a whole
answer is recorded before its first byte is written, so under the replica's status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from saltgate.derivations.derive import ROUTE_RESPONSES
from saltgate.gateway.admission import Admission
from saltgate.gateway.context import RequestContext
from saltgate.gateway.metrics import Labels, Metrics
from saltgate.gateway.replicas import Attempt, ReplicaSet
from saltgate.gateway.shared_limits import SharedTicket
from saltgate.gateway.usage import SseUsageScanner, Usage, usage_from_body
from saltgate.governance.limits import Ticket
from saltgate.http import Client, Headers, Response, UpstreamError, UpstreamResponse
from saltgate.policy.errors import ApiError
from saltgate.policy.headers import scrub_response_headers
from saltgate.policy.request import GENERATION_ROUTES
from saltgate.prices import PriceVersion
from saltgate.routing import Plan, ReplicaId
from saltgate.store.ledger import UsageLedger, UsageRecord
from saltgate.store.tenants import Principal

log = logging.getLogger(__name__)

DONE: Final = b"data: [DONE]\n\n"
CLIENT_CLOSED: Final = 499  # nginx's convention: the client went away before the response ended
NOT_SERVED: Final = 503
REPLICA_FAILED: Final = 502
_SSE: Final = b"text/event-stream"
_NO_USAGE: Final = Usage()
_PROMPT: Final = (("kind", "prompt"),)
_CACHED: Final = (("kind", "cached"),)
_COMPLETION: Final = (("kind", "completion"),)
_FAILURES: Final = "saltgate_upstream_failures_total"
_UNREPORTED: Final = "saltgate_replica_cached_tokens_unreported_total"
_STREAM_FAILED: Final = (
    b"data: "
    + ApiError(502, "The replica failed during the stream; retry the request.").body()
    + b"\n\n"
)


def no_replica() -> ApiError:
    return ApiError(
        503,
        "No replica is available to serve this request; try again shortly.",
        type="service_unavailable",
        code="no_replica",
    )


def replica_failed() -> ApiError:
    return ApiError(502, "The replica failed while answering; retry the request.")


# vLLM opens a Responses stream (response.created, response.in_progress) before the prefill;
# its first output item comes with the first token (docs/conformance.md).
_RESPONSES_OUTPUT: Final = b'"response.output_'


def _prefilled(route: str, chunk: bytes) -> bool:
    """Whether a stream chunk shows the prompt prefilled: any chunk, but on /v1/responses
    only one past the opening events."""
    return route != ROUTE_RESPONSES or _RESPONSES_OUTPUT in chunk or b"response.completed" in chunk


class Meter:
    """Where exchanges report: the usage ledger, the token and latency metrics; and the
    prices each record is billed at when it is recorded (docs/billing.md)."""

    __slots__ = ("_unreported", "ledger", "metrics", "prices")

    def __init__(
        self,
        ledger: UsageLedger,
        metrics: Metrics,
        prices: Mapping[str, PriceVersion] | None = None,
    ) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.prices: Mapping[str, PriceVersion] = prices or {}
        self._unreported: dict[str, Labels] = {}  # replica URL -> its labels, once warned
        metrics.describe("saltgate_tokens_total", "counter", "Tokens metered, by kind.")
        metrics.describe(_FAILURES, "counter", "Failed upstream exchanges.")
        metrics.describe(
            _UNREPORTED,
            "counter",
            "Generation answers whose usage had no cached-token count (vLLM without "
            "--enable-prompt-tokens-details), by replica URL.",
        )

    def cached_unreported(self, url: str) -> None:
        """Count an answer of the replica at `url` without cached tokens; the first one
        of each replica is logged: its cached tokens are billed at the full input price."""
        labels = self._unreported.get(url)
        if labels is None:
            labels = self._unreported[url] = (("replica", replica_label(url)),)
            log.warning(
                "saltgate: replica %s reports no cached tokens in its usage (start vLLM with "
                "--enable-prompt-tokens-details); its requests are recorded with cached "
                "tokens unknown and priced at the full input price (docs/billing.md)",
                labels[0][1],
            )
        self.metrics.inc(_UNREPORTED, labels)


def replica_label(url: str) -> str:
    """A replica's URL as a metric label and in logs: stable, without any user:password."""
    parts = urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


class Exchange:
    """See the module docstring; `forward` starts it, `_end` ends it, once."""

    __slots__ = (
        "_admission",
        "_attempt",
        "_client",
        "_context",
        "_ended",
        "_finished",
        "_held",
        "_meter",
        "_prefilling",
        "_principal",
        "_scanner",
        "_ticket",
        "_upstream",
    )

    def __init__(
        self,
        meter: Meter,
        principal: Principal,
        context: RequestContext,
        client: Client,
        *,
        admission: Admission | None = None,
        ticket: Ticket | SharedTicket | None = None,
    ) -> None:
        """`ticket`: the request's reservations under its tenant's limits, settled with
        `admission` when it ends (gateway/admission.py); None when it has no limits."""
        self._admission = admission
        self._ticket = ticket
        self._meter = meter
        self._principal = principal
        self._context = context
        self._client = client
        self._attempt: Attempt | None = None
        self._upstream: UpstreamResponse | None = None
        self._scanner: SseUsageScanner | None = None
        self._held = b""
        self._prefilling = True  # no output of the replica's yet: the prompt may be in prefill
        self._finished = False  # the stream has nothing more to give
        self._ended = False

    async def forward(
        self,
        replicas: ReplicaSet,
        plan: Plan,
        path: bytes,
        headers: Headers,
        payload: bytes,
        *,
        client_wants_usage: bool,
    ) -> Response:
        """Send the request down the plan's ranking until a replica answers; a failure
        before any response moves on to the next replica."""
        tried: list[ReplicaId] = []
        # Every ending awaits its record outside the handler that caught it: compiled code
        # must not suspend inside one (buildinfo.py).
        try:
            while True:
                attempt = self._attempt = replicas.acquire(plan, tried)
                if attempt is None:
                    if tried:
                        await self._end(NOT_SERVED)
                    if self._admission is not None:
                        self._settle(None, None)
                    raise no_replica()
                replica = attempt.replica
                try:
                    upstream = await replica.pool.request(
                        b"POST", replica.prefix + path, headers + replica.auth, payload
                    )
                    break
                except UpstreamError as exc:
                    answered = not exc.before_response
                self._failed()
                if answered:
                    await self._end(REPLICA_FAILED)
                    raise replica_failed() from None
                attempt.close()
                tried.append(replica.id)
            attempt.responded()
            self._upstream = upstream
            response_headers = scrub_response_headers(upstream.headers)
            if upstream.status == 200 and (upstream.header(b"content-type") or b"").startswith(
                _SSE
            ):
                self._scanner = SseUsageScanner(drop_usage_event=not client_wants_usage)
                return Response(200, response_headers, stream=self)
            try:
                body = await upstream.read()
            except UpstreamError:
                body = None
            if body is None:
                self._failed()
                await self._end(REPLICA_FAILED)
                raise replica_failed() from None
            usage = usage_from_body(body) if upstream.status == 200 else None
            await self._end(upstream.status, usage)
            return Response(upstream.status, response_headers, body)
        except asyncio.CancelledError as cancel:
            cancelled = cancel
        await self._end(NOT_SERVED)
        raise cancelled

    # -- the streamed body -------------------------------------------------------------
    def __aiter__(self) -> Exchange:
        return self

    async def __anext__(self) -> bytes:
        """The next events to relay. The closing `[DONE]` is held back until the usage
        record is committed, so a client that saw the whole stream is always metered."""
        upstream, scanner = self._upstream, self._scanner
        assert upstream is not None and scanner is not None, "only a stream is iterated"
        while not self._finished:
            failure: BaseException | None = None
            try:
                chunk = await upstream.next_chunk()
            except (UpstreamError, asyncio.CancelledError) as exc:
                failure = exc  # ended below, outside the handler (buildinfo.py)
            if failure is not None:
                self._finished = True
                if isinstance(failure, UpstreamError):
                    self._failed()
                    await self._end(REPLICA_FAILED, scanner.usage)
                    return _STREAM_FAILED
                await self._end(NOT_SERVED, scanner.usage)
                raise failure
            if chunk is None:
                self._finished = True
                held = self._held + scanner.flush()
                await self._end(200, scanner.usage)
                if held:
                    return held
                break
            context = self._context
            if not context.first_byte:
                context.first_byte = time.monotonic()
            if self._prefilling and _prefilled(context.route, chunk):
                self._prefilling = False
                if self._attempt is not None:
                    self._attempt.first_output()
            out = scanner.feed(chunk)
            if out.endswith(DONE):
                out, self._held = out[: -len(DONE)], DONE
            if out:
                return out
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """The HTTP server is done with the body. Before its end that means the client
        left: read the rest unrelayed, so the replica's usage is recorded (status 499).
        If the gateway is being cancelled (shutting down), stop at once instead."""
        if self._finished:
            return
        self._finished = True
        upstream, scanner = self._upstream, self._scanner
        assert upstream is not None and scanner is not None
        task = asyncio.current_task()
        failure: BaseException | None = None
        try:
            if task is None or not task.cancelling():
                while (chunk := await upstream.next_chunk()) is not None:
                    scanner.feed(chunk)
        except UpstreamError:
            self._failed()
        except BaseException as exc:
            failure = exc  # recorded below, outside the handler (buildinfo.py)
        await self._end(CLIENT_CLOSED, scanner.usage)
        if failure is not None:
            raise failure

    # -- the one ending ----------------------------------------------------------------
    def _settle(self, used: Usage | None, cost: int | None) -> None:
        """Correct the request's reservations to what it used (nothing metered: nothing
        used) and free its concurrency lease; once, whichever way it ended."""
        admission, ticket = self._admission, self._ticket
        if admission is None or ticket is None:
            return
        self._admission = None
        if used is None:
            admission.settle(ticket, 0, 0, 0)
            return
        uncached = used.prompt_tokens - (used.cached_tokens or 0)
        admission.settle(ticket, max(uncached, 0), used.completion_tokens, cost or 0)

    def _failed(self) -> None:
        if self._attempt is not None:
            self._attempt.failed()
        self._meter.metrics.inc(_FAILURES)

    async def _end(self, status: int, usage: Usage | None = None) -> None:
        """Free the replica and the upstream connection, commit the one record, and end
        the request."""
        if self._ended:
            return
        self._ended = True
        if self._attempt is not None:
            self._attempt.close()
        if self._upstream is not None:
            self._upstream.release()
        if self._client.gone:
            status = CLIENT_CLOSED
        used = usage or _NO_USAGE
        p = self._principal
        context = self._context
        meter = self._meter
        if (
            usage is not None
            and usage.cached_tokens is None
            and self._attempt is not None
            and context.route in GENERATION_ROUTES  # pooling answers never carry them
        ):
            meter.cached_unreported(self._attempt.replica.config.url)
        price = meter.prices.get(context.model)
        record = UsageRecord(
            request_id=context.request_id,  # this exchange's one record, however often committed
            ts=time.time(),
            tenant_id=p.tenant_id,
            key_id=p.key_id,
            model=context.model,
            prompt_tokens=used.prompt_tokens,
            cached_tokens=used.cached_tokens,
            completion_tokens=used.completion_tokens,
            status=status,
            cost_micro_usd=None
            if price is None
            else price.cost_micro_usd(
                used.prompt_tokens, used.cached_tokens, used.completion_tokens
            ),
            price_version=None if price is None else price.version,
        )
        if self._admission is not None:
            self._settle(used, record.cost_micro_usd)
        await meter.ledger.record(record)
        tokens = meter.metrics.series("saltgate_tokens_total")
        tokens[_PROMPT] += record.prompt_tokens
        tokens[_CACHED] += record.cached_tokens or 0
        tokens[_COMPLETION] += record.completion_tokens
        meter.metrics.observe_latency((), time.monotonic() - context.started)
        context.end(status, usage)
