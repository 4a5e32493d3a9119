"""What every console page shares: its view, forms, constants and formatting helpers."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final, TypeVar

from saltgate.admin.service import (
    Caller,
)
from saltgate.console.html import Markup
from saltgate.console.security import (
    security_headers,
)
from saltgate.gateway.metrics import Histogram, Snapshot
from saltgate.governance.limits import (
    BUDGET_PERIOD,
    BUDGET_USD,
    Limits,
    dollars_label,
    period_label,
)
from saltgate.http import Response

T = TypeVar("T")
SnapshotSource = Callable[[], Snapshot | Awaitable[Snapshot]]

PREFIX: Final = "/console"
JSON_TYPE: Final = b"application/json"
HTML_TYPE: Final = b"text/html; charset=utf-8"
STATIC_TYPES: Final = {
    ".js": b"text/javascript; charset=utf-8",
    ".css": b"text/css; charset=utf-8",
    ".svg": b"image/svg+xml",
    ".txt": b"text/plain; charset=utf-8",
}
WIDTHS: Final = {"1m": 60, "1h": 3600, "1d": 86400}
RANGES: Final = {"1h": (3600, "1m"), "24h": (86400, "1h"), "7d": (7 * 86400, "1d")}
RANGES_LONG: Final = {**RANGES, "30d": (30 * 86400, "1d")}
METRICS: Final = (
    ("num_model_requests", "Requests"),
    ("input_tokens", "Prompt tokens"),
    ("input_cached_tokens", "Cached prompt tokens"),
    ("output_tokens", "Completion tokens"),
    ("num_errors", "Errors"),
    ("cost_usd", "Cost (USD)"),
)
GROUPS: Final = (("", "nothing"), ("tenant", "tenant"), ("key", "key"), ("model", "model"))
GROUPS_ALL: Final = (*GROUPS, ("replica", "replica"))
MAX_PAGES: Final = 20  # pages of an API list or series followed for one console page
TOP_GROUPS: Final = 6  # series drawn per chart; the rest are summed as "other"
TTFT_SAMPLES: Final = 360
LIMIT_FIELDS: Final = (
    ("rpm", "Requests per minute"),
    ("input_tpm", "Prompt tokens per minute"),
    ("output_tpm", "Completion tokens per minute"),
    ("concurrency", "Concurrent requests"),
    ("budget_usd", "Budget (USD)"),
    ("budget_period", "Budget period (e.g. 30d, 7d, 24h)"),
)
# What a form's redirect says on the next page (``?done=CODE``); other codes show nothing.
DONE: Final = {
    "tenant-created": "Tenant created.",
    "limits-saved": "Limits saved.",
    "salt-rotated": "Salt rotated: a fresh cache namespace.",
    "key-revoked": "Key revoked.",
    "admin-token-revoked": "Admin token revoked.",
    "price-set": "Price set.",
    "price-cleared": "Price cleared: the configuration's applies.",
}
WEIGHT_LABEL: Final = "Fair-share weight"
SCOPE_NAMES: Final = (
    "usage:read",
    "tenants:read",
    "tenants:write",
    "keys:write",
    "limits:write",
    "prices:write",
    "audit_log:read",
    "admin_tokens:write",
)


class _Answer(Exception):
    """A response decided deep in a page (sign-in needed, the API refused)."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status)
        self.response = response


@dataclass
class View:
    """A page: its data (the .json twin) and the markup of that same data."""

    title: str
    data: dict[str, Any]
    body: Markup
    current: str = ""
    status: int = 200


@dataclass(frozen=True, slots=True)
class Form:
    """A posted form's fields."""

    values: dict[str, list[str]]

    def one(self, name: str) -> str:
        return (self.values.get(name) or [""])[-1].strip()


@dataclass
class _Ttft:
    """TTFT samples taken from the metrics as the console is read: (time, count, sum)."""

    samples: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=TTFT_SAMPLES)
    )


def _static_files() -> dict[str, bytes]:
    folder = resources.files("saltgate.console") / "static"
    return {
        f.name: f.read_bytes() for f in folder.iterdir() if f.name.endswith(tuple(STATIC_TYPES))
    }


def _response(status: int, body: bytes, kind: bytes, extra: list[tuple[bytes, bytes]]) -> Response:
    return Response(status, [(b"content-type", kind), *security_headers(), *extra], body)


def redirect(to: str, extra: list[tuple[bytes, bytes]] | None = None) -> Response:
    return _response(303, b"", HTML_TYPE, [(b"location", to.encode()), *(extra or [])])


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) else 0


def _quantile(hist: Histogram, q: float) -> float | None:
    """A quantile of a histogram summed over its labels (the bucket's upper bound)."""
    counts = [0] * (len(hist.buckets) + 1)
    for values, _ in hist.values.values():
        counts = [a + b for a, b in zip(counts, values, strict=True)]
    total = sum(counts)
    if not total:
        return None
    seen = 0
    for bound, n in zip((*hist.buckets, float("inf")), counts, strict=True):
        seen += n
        if seen >= q * total:
            return bound
    return None


# -- helpers ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """What the service refused: the API's status and message."""

    status: int
    message: str

    @property
    def text(self) -> str:
        return f"{self.message} ({self.status})"


UsageOperation = Callable[[Caller, Mapping[str, str]], Awaitable[dict[str, Any]]]


def _max_limit(width: str) -> str:
    return {"1m": "1440", "1h": "168", "1d": "31"}[width]


def _choice(
    query: Mapping[str, str], name: str, allowed: Mapping[str, object], default: str
) -> str:
    """A URL filter's value if it is one of `allowed`, else the default."""
    given = query.get(name)
    return given if given is not None and given in allowed else default


def _total(values: list[float | None]) -> float | None:
    """A series' sum; None (unknown) when any point is."""
    return None if None in values else sum(v or 0 for v in values)


def _sum(bucket: Mapping[str, Any], key: str) -> int | None:
    """A bucket's total of one field; None when any result's is unknown."""
    total = 0
    for r in bucket.get("results") or []:
        v = r.get(key)
        if v is None:
            return None
        total += int(v)
    return total


def _cost_result(result: Mapping[str, Any]) -> float:
    micro = result.get("amount_micro_usd")
    if isinstance(micro, int):
        return micro / 1e6
    amount = result.get("amount") or {}
    return float(amount.get("value") or 0)


def _cost(bucket: Mapping[str, Any]) -> float:
    return sum(_cost_result(r) for r in bucket.get("results") or [])


def _group_name(result: Mapping[str, Any], group: str) -> str:
    field_name = {
        "tenant": "tenant_id",
        "key": "api_key_id",
        "model": "model",
        "replica": "replica",
    }.get(group)
    return "all" if field_name is None else str(result.get(field_name) or "none")


def _chart(times: list[int], series: list[tuple[str, list[Any]]], unit: str) -> dict[str, Any]:
    """What static/console.js draws: x (unix seconds) and labelled y series."""
    return {"x": times, "unit": unit, "series": [{"label": n, "values": v} for n, v in series]}


def _num(value: object) -> str:
    if value is None:
        return "unknown"
    return f"{value:,.0f}" if isinstance(value, int | float) else str(value)


def _ttft_text(ttft: Mapping[str, Any]) -> str:
    p50, p95 = ttft.get("p50_s"), ttft.get("p95_s")
    if ttft.get("requests") is None:
        return "not shown to this token (every tenant's traffic)"
    if p50 is None or p95 is None:
        return "no streamed requests yet"
    return f"≤ {p50:g} s / ≤ {p95:g} s"


def _limits(shown: Mapping[str, Any]) -> Limits | None:
    """Limits back from their JSON form (a record's `limits`)."""
    return Limits(**shown) if shown else None


def _budget(limits: Mapping[str, Any]) -> str:
    micro, period = limits.get("budget_micro_usd"), limits.get("budget_period_s")
    if micro is None or period is None:
        return "none"
    return f"${dollars_label(micro)} per {period_label(period)}"


def _form_values(limits: Mapping[str, Any]) -> list[object]:
    """LIMIT_FIELDS' values as the form shows them: budgets in dollars, periods as 30d."""
    micro, period = limits.get("budget_micro_usd"), limits.get("budget_period_s")
    human = {
        BUDGET_USD: "" if micro is None else dollars_label(micro),
        BUDGET_PERIOD: "" if period is None else period_label(period),
    }
    return [human[k] if k in human else limits.get(k, "") for k, _ in LIMIT_FIELDS]
