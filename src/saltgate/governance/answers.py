"""What governance answers a client: a request's reservation, the 429 of a limit, the
rate-limit headers, and the 503 / 529 of a request that waited too long for a replica.

Pure: the shells (gateway/admission.py, gateway/fairshare.py) decide when to answer and
pass the time in; the answers are OpenAI's (x-ratelimit-*, `rate_limit_exceeded`,
`insufficient_quota`) or, on /v1/messages, Anthropic's (anthropic-ratelimit-*,
`rate_limit_error`, 529 `overloaded_error`), so the official SDKs retry (or stop) as they
would against those APIs (docs/limits.md, docs/fairness.md).
"""

from __future__ import annotations

import math
from typing import Final

from saltgate.governance.kinds import LimitKind, Scope
from saltgate.governance.limits import Demand, Denial, Quota, output_allowance, prompt_estimate
from saltgate.policy.errors import AnthropicApiError, ApiError
from saltgate.policy.headers import Headers
from saltgate.policy.request import GENERATION_ROUTES
from saltgate.prices import PriceVersion

# What OpenAI's message calls each limit.
_NAMES: Final = {
    LimitKind.REQUESTS: "requests per min (RPM)",
    LimitKind.INPUT_TOKENS: "uncached input tokens per min (TPM)",
    LimitKind.OUTPUT_TOKENS: "output tokens per min (TPM)",
    LimitKind.CONCURRENCY: "concurrent requests",
}
# A concurrency lease frees when a request ends, which the log cannot foresee: the caller
# is told to retry after this (or the lease's expiry, if sooner).
CONCURRENCY_RETRY_S: Final = 1.0
_ANTHROPIC_KINDS: Final = {
    LimitKind.REQUESTS: b"requests",
    LimitKind.INPUT_TOKENS: b"input-tokens",
    LimitKind.OUTPUT_TOKENS: b"output-tokens",
}
_SECONDS_PER_DAY: Final = 86400
_DAYS_TO_1970: Final = 719468  # days from 0000-03-01 to 1970-01-01 (the civil calendar)


def reservation(
    price: PriceVersion | None, route: str, body_bytes: int, max_tokens: int | None
) -> Demand:
    """What a request reserves at admission: the prompt estimate, its output allowance
    and their price (docs/limits.md; saltgate-bench limits bounds a budget's overshoot
    with it)."""
    prompt = prompt_estimate(body_bytes)
    allowance = output_allowance(max_tokens) if route in GENERATION_ROUTES else 0
    cost = 0 if price is None else price.cost_micro_usd(prompt, None, allowance)
    return Demand(prompt, allowance, cost)


def go_duration(seconds: float) -> str:
    """A duration as OpenAI's x-ratelimit-reset-* write it (Go's style): "6m0s", "1.5s",
    "120ms"; rounded up to the millisecond, so waiting that long is always enough."""
    ms = max(math.ceil(seconds * 1000 - 1e-6), 0)
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rfc3339(wall: float) -> str:
    """A Unix time as RFC 3339 in UTC to the second ("2026-12-05T19:30:00Z"), as
    Anthropic writes its resets; computed here, without the datetime library (a clock)."""
    whole = int(wall)
    if round((wall - whole) * 1e6) >= 1_000_000:  # to the microsecond first, as datetime
        whole += 1
    days, secs = divmod(whole, _SECONDS_PER_DAY)
    # Howard Hinnant's days-to-civil: the proleptic Gregorian date of a day count.
    z = days + _DAYS_TO_1970
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    year = yoe + era * 400 + (month <= 2)
    hh, rest = divmod(secs, 3600)
    mm, ss = divmod(rest, 60)
    return f"{year:04d}-{month:02d}-{day:02d}T{hh:02d}:{mm:02d}:{ss:02d}Z"


def rate_headers(quotas: tuple[Quota, ...], anthropic: bool, wall: float) -> Headers:
    """x-ratelimit-* (OpenAI: requests, and tokens as the tighter of input and output) or
    anthropic-ratelimit-* (RFC 3339 resets from `wall`, the Unix time now)."""
    headers: Headers = []
    if anthropic:
        for q in quotas:
            name = b"anthropic-ratelimit-" + _ANTHROPIC_KINDS[q.kind]
            headers += [
                (name + b"-limit", str(q.limit).encode()),
                (name + b"-remaining", str(q.remaining).encode()),
                (name + b"-reset", rfc3339(wall + q.reset_s).encode()),
            ]
        return headers
    tokens: Quota | None = None
    for q in quotas:
        if q.kind == LimitKind.REQUESTS:
            headers += _openai(b"requests", q)
        elif tokens is None or q.remaining < tokens.remaining:
            tokens = q
    if tokens is not None:
        headers += _openai(b"tokens", tokens)
    return headers


def _openai(name: bytes, q: Quota) -> Headers:
    return [
        (b"x-ratelimit-limit-" + name, str(q.limit).encode()),
        (b"x-ratelimit-remaining-" + name, str(q.remaining).encode()),
        (b"x-ratelimit-reset-" + name, go_duration(q.reset_s).encode()),
    ]


def denial_error(denial: Denial, model: str, anthropic: bool, headers: Headers) -> ApiError:
    """The 429, worded as OpenAI words it; a spent budget is `insufficient_quota` with
    x-should-retry: false and no Retry-After, so the official SDKs stop retrying."""
    error_type = AnthropicApiError if anthropic else ApiError
    scope = "this API key" if denial.scope == Scope.KEY else "this tenant"
    if denial.kind == LimitKind.BUDGET:
        message = (
            "You exceeded your current quota, please check your plan and billing details. "
            f"The spend budget of {scope} is used up."
        )
        return error_type(
            429,
            message,
            type="rate_limit_error" if anthropic else "insufficient_quota",
            code="insufficient_quota",
            headers=[*headers, (b"x-should-retry", b"false")],
        )
    what = f"{model or 'requests'} on {_NAMES[denial.kind]} of {scope}"
    retry = denial.retry_after_s
    if denial.kind == LimitKind.CONCURRENCY and retry is not None:
        retry = min(retry, CONCURRENCY_RETRY_S)
    extra: Headers = [(b"x-should-retry", b"false")]
    if retry is None and denial.limit == 0:
        # Set to 0, or a limit smaller than the processes it is split between.
        message = (
            f"Rate limit reached for {what}: Limit 0, Requested {denial.requested}. This "
            "limit admits nothing here; ask the operator to raise it."
        )
    elif retry is None:
        message = (
            f"Request too large for {what}: Limit {denial.limit}, Requested "
            f"{denial.requested}. The input or output tokens must be reduced in order to "
            "run successfully."
        )
    else:
        message = (
            f"Rate limit reached for {what}: Limit {denial.limit}, Used {denial.used}, "
            f"Requested {denial.requested}. Please try again in {go_duration(retry)}."
        )
        ms = max(math.ceil(retry * 1000 - 1e-6), 1)
        extra = [
            (b"retry-after", str(math.ceil(ms / 1000)).encode()),
            (b"retry-after-ms", str(ms).encode()),
        ]
    tokens = denial.kind in (LimitKind.INPUT_TOKENS, LimitKind.OUTPUT_TOKENS)
    return error_type(
        429,
        message,
        type="rate_limit_error" if anthropic else ("tokens" if tokens else "requests"),
        code="rate_limit_exceeded",
        headers=[*headers, *extra],
    )


def overloaded(anthropic: bool, retry_after_s: float) -> ApiError:
    """The answer to a request that waited `max_queue_s` for a replica: 503 (OpenAI's
    routes) or 529 `overloaded_error` (Anthropic's), with Retry-After."""
    headers = [(b"retry-after", str(max(math.ceil(retry_after_s), 1)).encode())]
    if anthropic:
        return AnthropicApiError(
            529, "Overloaded: no replica could take the request in time; retry it shortly.",
            type="overloaded_error", headers=headers,
        )  # fmt: skip
    return ApiError(
        503,
        "The replicas are saturated and the request waited too long for one; retry shortly.",
        type="service_unavailable",
        code="overloaded",
        headers=headers,
    )
