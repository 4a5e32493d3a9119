"""One forwarded request, from its first attempt at a replica to its one usage record.

An `Exchange` owns everything a forwarded request holds: the replica attempt (in-flight
count and prefill estimate, `gateway/replicas.py`), the upstream response and the ledger
record. It ends exactly once (`_end`), and every way a request can end goes through it:

    ending                                    record status     usage recorded
    the replica answered, client still there  the replica's     the replica's
    the client left, before or during it      499 (*)           the replica's (see below)
    the replica broke before answering        next replica; with none left: 503, none
    the replica broke while answering         502               what the stream showed
    cut when the gateway stops (drain grace)  503               what the stream delivered
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from saltgate.derivations.derive import ROUTE_RESPONSES
from saltgate.gateway.context import AttemptTrace, RequestContext
from saltgate.gateway.governor import Pass
from saltgate.gateway.metrics import TTFT_BUCKETS, Labels, Metrics, duration_buckets
from saltgate.gateway.replicas import CREDENTIALS_REFUSED, Attempt, ReplicaSet
from saltgate.gateway.responses import response_id_in
from saltgate.gateway.usage import SseUsageScanner, Usage, delivered_usage, usage_from_body
from saltgate.governance.limits import prompt_estimate
from saltgate.http import Client, Headers, Response, UpstreamError, UpstreamResponse
from saltgate.policy.errors import ApiError, gateway_stopping, stream_error_event
from saltgate.policy.fields import scrub_answer, scrub_events
from saltgate.policy.headers import scrub_response_headers
from saltgate.policy.request import GENERATION_ROUTES
from saltgate.prices import PriceBook
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
_TOKENS: Final = "saltgate_tokens_total"
_REQUESTS: Final = "saltgate_tenant_requests_total"
_DURATION: Final = "saltgate_request_duration_seconds"
_TTFT: Final = "saltgate_time_to_first_token_seconds"
_FAILURES: Final = "saltgate_upstream_failures_total"
OTHER_MODEL: Final = "other"  # the model label of any model the gateway does not know
_LABEL_CACHE: Final = 65_536  # (tenant, model, status) label sets remembered; cleared when full
_UNREPORTED: Final = "saltgate_replica_cached_tokens_unreported_total"
# Records a response id with its tenant and replica ([responses] store).
KeepResponse = Callable[[str, str, ReplicaId], Awaitable[None]]
_STREAM_FAILED: Final = ApiError(502, "The replica failed during the stream; retry the request.")
_STOPPING: Final = "the gateway is stopping"


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
    """Where exchanges report: the usage ledger, the token, request and latency metrics;
    and the prices each record is billed at when it is recorded (docs/billing.md)."""

    __slots__ = ("_labels", "_unreported", "answering", "ledger", "metrics", "prices")

    def __init__(
        self,
        ledger: UsageLedger,
        metrics: Metrics,
        prices: PriceBook | None = None,
        *,
        timeout_s: float = 600.0,
    ) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.prices = prices or PriceBook()
        # Exchanges a replica is answering now: the drain cuts those still open at its end.
        self.answering: set[Exchange] = set()
        self._unreported: dict[str, Labels] = {}  # replica label -> its labels, once warned
        # (tenant id, model label, status) -> the labels of its request and token series
        self._labels: dict[tuple[str, str, int], tuple[Labels, Labels, Labels, Labels]] = {}
        metrics.describe(
            _TOKENS,
            "counter",
            "Tokens metered, by kind (prompt, cached, completion), tenant id and model.",
        )
        metrics.describe(
            _REQUESTS, "counter", "Forwarded requests by tenant id, model and final status."
        )
        metrics.describe(_FAILURES, "counter", "Failed upstream exchanges.")
        metrics.describe(
            _UNREPORTED,
            "counter",
            "Generation answers whose usage had no cached-token count (vLLM without "
            "--enable-prompt-tokens-details), by replica URL.",
        )
        metrics.histogram(
            _DURATION,
            "Time from a forwarded request's arrival to the end of its response, by route.",
            duration_buckets(timeout_s),
        )
        metrics.histogram(
            _TTFT,
            "Time from a streamed request's arrival to its first output, by route and model.",
            TTFT_BUCKETS,
        )

    def model_label(self, model: str, attempt: Attempt | None) -> str:
        """`model` if the gateway knows it (it has a price, or the replica that answered
        serves it), else "other": a client cannot add series by inventing model names."""
        if model in self.prices.by_model:
            return model
        if attempt is not None and model in (attempt.replica.served or ()):
            return model
        return OTHER_MODEL

    def replica(self, attempt: Attempt | None) -> str | None:
        """The name a record gives the replica that answered (None: none did)."""
        return None if attempt is None else attempt.replica.label

    def ttft(self, route: str, model: str, seconds: float) -> None:
        self.metrics.observe(_TTFT, (("route", route), ("model", model)), seconds)

    def count(self, record: UsageRecord, model: str, route: str, seconds: float) -> None:
        """A request's record in the metrics: its request, its tokens (cached ones only
        when known: unknown is not zero) and its duration."""
        key = (record.tenant_id, model, record.status)
        labels = self._labels.get(key)
        if labels is None:
            if len(self._labels) >= _LABEL_CACHE:
                self._labels.clear()
            tenant_model = (("tenant", record.tenant_id), ("model", model))
            labels = self._labels[key] = (
                (*tenant_model, ("status", str(record.status))),
                (("kind", "prompt"), *tenant_model),
                (("kind", "cached"), *tenant_model),
                (("kind", "completion"), *tenant_model),
            )
        metrics = self.metrics
        metrics.inc(_REQUESTS, labels[0])
        tokens = metrics.series(_TOKENS)
        tokens[labels[1]] += record.prompt_tokens
        if record.cached_tokens is not None:
            tokens[labels[2]] += record.cached_tokens
        tokens[labels[3]] += record.completion_tokens
        metrics.observe(_DURATION, (("route", route),), seconds)

    def cached_unreported(self, replica: str) -> None:
        """Count an answer of the replica labelled `replica` without cached tokens; the
        first one of each replica is logged: its cached tokens are billed at the full
        input price."""
        labels = self._unreported.get(replica)
        if labels is None:
            labels = self._unreported[replica] = (("replica", replica),)
            log.warning(
                "replica %s reports no cached tokens in its usage (start vLLM with "
                "--enable-prompt-tokens-details); its requests are recorded with cached "
                "tokens unknown and priced at the full input price (docs/billing.md)",
                labels[0][1],
            )
        self.metrics.inc(_UNREPORTED, labels)


async def _send(
    replicas: ReplicaSet, attempt: Attempt, path: bytes, headers: Headers, payload: bytes
) -> UpstreamResponse | bool:
    """One attempt at a replica: its answer, or whether the failure came after it began
    answering. A 401 or 403 refuses the gateway's API key, not the tenant's: a failure
    before the answer, never relayed (gateway/replicas.py takes the replica down)."""
    replica = attempt.replica
    try:
        upstream = await replica.pool.request(
            b"POST", replica.prefix + path, headers + replica.auth, payload
        )
    except UpstreamError as exc:
        return not exc.before_response
    if upstream.status not in CREDENTIALS_REFUSED:
        return upstream
    await replicas.credentials_refused(replica, upstream)
    return False


class Exchange:
    """See the module docstring; `forward` starts it, `_end` ends it, once."""

    __slots__ = (
        "_attempt",
        "_body_bytes",
        "_client",
        "_context",
        "_cut",
        "_ended",
        "_finished",
        "_held",
        "_keep",
        "_meter",
        "_pass",
        "_prefilling",
        "_principal",
        "_scanner",
        "_span",
        "_upstream",
    )

    def __init__(
        self,
        meter: Meter,
        principal: Principal,
        context: RequestContext,
        client: Client,
        *,
        pass_: Pass | None = None,
        keep: KeepResponse | None = None,
    ) -> None:
        """`pass_`: the request's way through governance (gateway/governor.py): its first
        attempt is the pass's, settled once when it ends; None when it has no limits and
        [queue] is off."""
        self._pass = pass_
        self._keep = keep  # [responses] store: record the answer's response id and owner
        self._meter = meter
        self._principal = principal
        self._context = context
        self._client = client
        self._attempt: Attempt | None = None
        self._upstream: UpstreamResponse | None = None
        self._scanner: SseUsageScanner | None = None
        self._span: AttemptTrace | None = None  # the current attempt's, with [tracing]
        self._held = b""
        self._prefilling = True  # no output of the replica's yet: the prompt may be in prefill
        self._finished = False  # the stream has nothing more to give
        self._ended = False
        self._cut = False  # ended by the gateway's drain (`cut`)
        self._body_bytes = 0

    async def forward(
        self,
        replicas: ReplicaSet,
        plan: Plan,
        path: bytes,
        headers: Headers,
        payload: bytes,
        *,
        client_wants_usage: bool,
        avoid: Sequence[ReplicaId] = (),
    ) -> Response:
        """Send the request down the plan's ranking until a replica answers; a failure
        before any response moves on to the next replica. `avoid`: replicas not to try
        (all but the one holding the response a request continues)."""
        tried = list(avoid)
        self._body_bytes = len(payload)
        trace = self._context.span
        pass_ = self._pass
        # Every ending awaits its record outside the handler that caught it: compiled code
        # must not suspend inside one (buildinfo.py).
        try:
            while True:
                attempt = self._attempt = (
                    await pass_.first_attempt(replicas, plan, self._client, len(payload))
                    if pass_ is not None and not tried
                    else replicas.acquire(plan, tried)
                )
                if attempt is None:
                    if tried:
                        await self._end(NOT_SERVED)
                    if pass_ is not None:
                        pass_.settle(None, None)
                    raise no_replica()
                replica = attempt.replica
                sent = headers
                if trace is not None:
                    span = self._span = trace.attempt(self._context, replica.label)
                    sent = span.upstream_headers(headers)
                sending = await _send(replicas, attempt, path, sent, payload)
                if isinstance(sending, UpstreamResponse):
                    upstream = sending
                    break
                answered = sending
                self._failed()
                if self._span is not None and not answered:
                    self._span.end(REPLICA_FAILED)
                if answered:
                    await self._end(REPLICA_FAILED)
                    raise replica_failed() from None
                attempt.close()
                tried.append(replica.id)
            attempt.responded()
            self._upstream = upstream
            self._meter.answering.add(self)
            response_headers = scrub_response_headers(upstream.headers)
            if upstream.status == 200 and (upstream.header(b"content-type") or b"").startswith(
                _SSE
            ):
                self._scanner = SseUsageScanner(drop_usage_event=not client_wants_usage)
                return Response(200, response_headers, stream=self)
            return await self._whole(upstream, response_headers)
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
                return await self._broken(failure, scanner)
            if chunk is None:
                self._finished = True
                held = self._held + scrub_events(scanner.flush())
                await self._end(200, scanner.usage)
                if held:
                    return held
                break
            self.output(chunk)
            out = scrub_events(scanner.feed(chunk))
            if self._keep is not None:
                await self._kept(out)
            if out.endswith(DONE):
                out, self._held = out[: -len(DONE)], DONE
            if out:
                return out
        raise StopAsyncIteration

    async def _broken(self, failure: BaseException, scanner: SseUsageScanner) -> bytes:
        """The stream's last event when reading it failed: cut by the drain, or the
        replica broke; a cancellation is recorded and goes on."""
        route = self._context.route
        if self._cut:
            delivered = delivered_usage(route, scanner, prompt_estimate(self._body_bytes))
            await self._end(NOT_SERVED, delivered)
            return stream_error_event(route, gateway_stopping())
        if isinstance(failure, UpstreamError):
            self._failed()
            await self._end(REPLICA_FAILED, scanner.usage)
            return stream_error_event(route, _STREAM_FAILED)
        await self._end(NOT_SERVED, scanner.usage)
        raise failure

    def cut(self) -> None:
        """The gateway is stopping and its drain grace ran out: end the answer now. The
        replica's connection is closed under it, so the reader wakes at once and ends the
        stream with an error event in its route's shape, recording what was delivered
        (a whole answer not yet read gets the 503 instead)."""
        if self._ended or self._upstream is None:
            return
        self._cut = True
        self._upstream.interrupt(_STOPPING)

    def output(self, chunk: bytes) -> None:
        """A chunk of the replica's stream arrived: its first byte and, once the prompt
        is prefilled, its first output are timed and told to the router."""
        context = self._context
        if not context.first_byte:
            context.first_byte = time.monotonic()
        if self._prefilling and _prefilled(context.route, chunk):
            self._prefilling = False
            attempt = self._attempt
            if attempt is not None:
                attempt.first_output()
            meter = self._meter
            meter.ttft(
                context.route,
                meter.model_label(context.model, attempt),
                time.monotonic() - context.started,
            )

    # -- an exchange another proxy carries (saltgate/epp: Envoy moves the bytes) --------
    async def relay(
        self, replicas: ReplicaSet, plan: Plan, avoid: Sequence[ReplicaId], body_bytes: int
    ) -> Attempt | None:
        """The replica for a request another proxy carries: its turn in the fair queue
        ([queue]; the 503 / 529 when it waited too long), else the router's pick, as
        `forward`'s first attempt; None: no replica."""
        pass_ = self._pass
        if pass_ is not None and not avoid:
            attempt = await pass_.first_attempt(replicas, plan, self._client, body_bytes)
        else:
            attempt = replicas.acquire(plan, avoid)
        self._attempt = attempt
        return attempt

    def moved(self, attempt: Attempt) -> None:
        """The proxy retried the request on another replica, which answers it: the first
        attempt failed (told, counted, freed) and ``attempt`` is the exchange's now."""
        self._failed()
        if self._attempt is not None:
            self._attempt.close()
        self._attempt = attempt

    def unserved(self) -> None:
        """No replica could take the request: its reservations freed, nothing recorded
        (as `forward` does when the first attempt finds none)."""
        if self._pass is not None:
            self._pass.settle(None, None)

    def failed(self) -> None:
        """The replica broke the exchange: told to the router, counted."""
        self._failed()

    async def end(self, status: int, usage: Usage | None = None) -> None:
        """The relayed exchange is over: the same one ending as the gateway's own."""
        await self._end(status, usage)

    async def keep(self, data: bytes) -> None:
        """[responses] store: record the response id relayed data carries, once, before
        it is released (as `forward` does)."""
        if self._keep is not None:
            await self._kept(data)

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

    async def _whole(self, upstream: UpstreamResponse, headers: Headers) -> Response:
        """A whole answer: read, its response id kept, metered, then handed to the
        client; the 502 when the replica broke while sending it, the 503 when the drain
        cut it."""
        try:
            body: bytes | None = await upstream.read()
        except UpstreamError:
            body = None
        if body is None and self._cut:
            await self._end(NOT_SERVED)
            raise gateway_stopping() from None
        if body is None:
            self._failed()
            await self._end(REPLICA_FAILED)
            raise replica_failed() from None
        status = upstream.status
        usage = usage_from_body(body) if status == 200 else None
        if status == 200:
            await self._kept(body)
        await self._end(status, usage)
        return Response(status, headers, scrub_answer(body))

    async def _kept(self, data: bytes) -> None:
        """Record the response id the answer carries, once, before the client sees it (so
        a continuation made at once finds it)."""
        keep, attempt = self._keep, self._attempt
        response_id = response_id_in(data)
        if keep is None or attempt is None or response_id is None:
            return
        self._keep = None
        await keep(response_id, self._principal.tenant_id, attempt.replica.id)

    # -- the one ending ----------------------------------------------------------------
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
        self._meter.answering.discard(self)
        if self._attempt is not None:
            self._attempt.close()
        if self._upstream is not None:
            self._upstream.release()
        if self._client.gone:
            status = CLIENT_CLOSED
        if self._span is not None:
            self._span.end(status, usage)
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
            meter.cached_unreported(self._attempt.replica.label)
        price = meter.prices.by_model.get(context.model)
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
            replica=meter.replica(self._attempt),
        )
        if self._pass is not None:
            self._pass.settle(used, record.cost_micro_usd)
        await meter.ledger.record(record)
        meter.count(
            record,
            meter.model_label(context.model, self._attempt),
            context.route,
            time.monotonic() - context.started,
        )
        context.end(status, usage)
