"""The web console at /console/ on the admin listener (docs/console.md).

Server-rendered pages, each with a ``.json`` twin holding the same data; filters live in
the URL query. Every page is built from the admin service (saltgate.admin.service), the
one the HTTP admin API fronts, called with the admin token the operator signed in with
(kept server side in the session, saltgate.console.security, and read from the store on
every page): the console adds no access rule of its own, so a token's scopes and tenant
pinning hold here exactly as they do over HTTP, and every change it makes is in the audit
log under that token. Routing and fleet come from the
gateway's metrics.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs, unquote

import orjson

from saltgate.admin import scopes
from saltgate.admin.api import CSV, CSV_DISPOSITION
from saltgate.admin.service import (
    AdminService,
    Caller,
    NewAdminToken,
    NewKey,
    Page,
    store_status,
)
from saltgate.admin.tokens import AUTHENTICATED, authenticate_admin
from saltgate.config import GatewayConfig
from saltgate.console import html
from saltgate.console.html import Markup, esc, fmt, link, raw, url, when
from saltgate.console.security import (
    SAFE_METHODS,
    Session,
    Sessions,
    SignInLimiter,
    clear_cookie,
    cookie_value,
    same_origin,
    security_headers,
    set_cookie,
)
from saltgate.gateway.metrics import Histogram, Snapshot
from saltgate.governance.limits import (
    BUDGET_PERIOD,
    BUDGET_USD,
    Limits,
    dollars_label,
    limits_label,
    parse_limits,
    period_label,
)
from saltgate.governance.priority import DEFAULT_PRIORITY
from saltgate.http import Request, Response
from saltgate.policy.errors import ApiError
from saltgate.prices import price_from_fields
from saltgate.store.errors import StoreError
from saltgate.store.ledger import new_request_id

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


class Console:
    """`handle` answers /console/... (None for any other path)."""

    def __init__(
        self,
        service: AdminService,
        metrics: SnapshotSource,
        config: GatewayConfig,
        *,
        tls: bool = False,
    ) -> None:
        self.service = service
        self.metrics = metrics
        self.config = config
        self.tls = tls
        self.sessions = Sessions()
        self.sign_ins = SignInLimiter()
        self.static = _static_files()
        self._ttft = _Ttft()
        self._pages: dict[str, Callable[[Session, dict[str, str]], Awaitable[View]]] = {
            "overview": self._overview,
            "usage": self._usage,
            "tenants": self._tenants,
            "keys": self._keys,
            "fleet": self._fleet,
            "audit": self._audit,
            "admin-tokens": self._admin_tokens,
            "prices": self._prices,
        }
        self._actions: dict[str, Callable[[Session, str, Form], Awaitable[Response]]] = {
            "tenants": self._create_tenant,
            "tenants/limits": self._set_limits,
            "tenants/rotate-salt": self._rotate_salt,
            "keys/create": self._create_key,
            "keys/revoke": self._revoke_key,
            "keys/rotate": self._rotate_key,
            "admin-tokens": self._create_admin_token,
            "admin-tokens/revoke": self._revoke_admin_token,
            "prices": self._set_price,
            "prices/clear": self._clear_price,
        }

    # -- entry -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response | None:
        path = request.path.decode("utf-8", "replace")
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            return None
        if path in (PREFIX, PREFIX + "/"):
            return redirect(url("overview"))
        if request.method not in SAFE_METHODS and not same_origin(request, tls=self.tls):
            return self._plain(
                403, "Refused: a change to the console must come from its own pages."
            )
        rest = path[len(PREFIX) + 1 :]
        try:
            return await self._route(request, rest)
        except _Answer as answer:
            return answer.response

    async def _route(self, request: Request, rest: str) -> Response:
        if rest.startswith("static/"):
            return self._static(rest[len("static/") :])
        if rest == "sign-in":
            return await self._sign_in(request)
        if rest == "sign-out":
            return self._sign_out(request)
        session = self._session(request, wants_json=rest.endswith(".json"))
        if request.method == b"POST":
            return await self._action(session, rest, request)
        if request.method not in SAFE_METHODS:
            return self._plain(405, "Use GET, or POST from a form.")
        query = {k: v[-1] for k, v in parse_qs(request.query.decode("utf-8", "replace")).items()}
        return await self._get(session, rest, query)

    def _plain(self, status: int, message: str) -> Response:
        body = html.page(
            "Refused" if status == 403 else "Error", html.notice(message, kind="error")
        )
        return _response(status, body, HTML_TYPE, [])

    def _static(self, name: str) -> Response:
        content = self.static.get(name)
        if content is None:
            return self._plain(404, "No such file.")
        kind = STATIC_TYPES[name[name.rindex(".") :]]
        return Response(
            200,
            [
                (b"content-type", kind),
                *security_headers()[:-1],
                (b"cache-control", b"max-age=3600"),
            ],
            content,
        )

    # -- sessions --------------------------------------------------------------------------

    def _session(self, request: Request, *, wants_json: bool) -> Session:
        session = self.sessions.find(cookie_value(request))
        if session is not None:
            AUTHENTICATED.set(session.token_id)  # the access log names who acted
            return session
        if wants_json:
            body = orjson.dumps({"error": {"message": "sign in first", "type": "unauthorized"}})
            raise _Answer(_response(401, body, JSON_TYPE, []))
        raise _Answer(redirect(url("sign-in")))

    def _sign_in_page(self, status: int, message: str = "") -> Response:
        body = (html.notice(message, kind="error") if message else "") + html.form(
            url("sign-in"),
            html.field("token", "Admin token", kind="password"),
            "Sign in",
            name="sign-in",
        )
        body += raw(
            "<p>Sign in with an admin token (<code>saltgate admin-tokens create --scopes all"
            "</code>; <code>saltgate up</code> prints one). The console can do what the "
            "token's scopes allow, nothing more.</p>"
        )
        return _response(status, html.page("Sign in", body), HTML_TYPE, [])

    async def _sign_in(self, request: Request) -> Response:
        if request.method in SAFE_METHODS:
            return self._sign_in_page(200)
        if request.method != b"POST":
            return self._plain(405, "Use GET or POST.")
        form = parse_qs(request.body.decode("utf-8", "replace"))
        token = (form.get("token") or [""])[-1].strip()
        if not self.sign_ins.allow(token):
            return self._sign_in_page(429, "Too many failed sign-ins; wait a minute.")
        me = await authenticate_admin(self.service.store, token) if token else None
        if me is None:  # refused (a store outage raises instead: no one's guess, not counted)
            self.sign_ins.failed(token)
            return self._sign_in_page(401, "That admin token was not accepted.")
        value = self.sessions.start(token, me.token_id, me.scopes, me.tenant_id)
        return redirect(url("overview"), [(b"set-cookie", set_cookie(value, tls=self.tls))])

    def _sign_out(self, request: Request) -> Response:
        if request.method != b"POST":
            return self._plain(405, "Sign out with the button (POST).")
        self.sessions.end(cookie_value(request))
        return redirect(url("sign-in"), [(b"set-cookie", clear_cookie(tls=self.tls))])

    # -- the admin service, as the session's token ----------------------------------------

    async def _caller(self, session: Session) -> Caller:
        """The session's token as the service's caller, read from the store on every page
        as the API reads it: a token revoked since sign-in (or pinned to a tenant since
        archived) ends the session and sends the browser to sign in again."""
        principal = await authenticate_admin(self.service.store, session.token)
        if principal is None:
            self.sessions.end_token(session.token)
            raise _Answer(redirect(url("sign-in")))
        return Caller.of(principal, new_request_id())

    async def _do(self, session: Session, op: Callable[[Caller], Awaitable[T]]) -> T | Refusal:
        """One service operation as the session's token; its refusal as the API's
        status and message."""
        caller = await self._caller(session)
        try:
            return await op(caller)
        except ApiError as error:
            return Refusal(error.status, error.message)
        except StoreError as error:
            return Refusal(store_status(error), str(error))

    async def _list(
        self,
        session: Session,
        fetch: Callable[[Caller, str], Awaitable[Page[T]]],
        last_id: Callable[[T], str],
    ) -> tuple[list[T], str | None]:
        """Every item of a service list (up to MAX_PAGES pages), or the refusal's text."""

        async def every(caller: Caller) -> list[T]:
            items: list[T] = []
            after = ""
            for _ in range(MAX_PAGES):
                found = await fetch(caller, after)
                items.extend(found.items)
                if not found.has_more or not found.items:
                    break
                after = last_id(found.items[-1])
            return items

        found = await self._do(session, every)
        return ([], found.text) if isinstance(found, Refusal) else (found, None)

    async def _buckets(
        self,
        session: Session,
        operation: UsageOperation,
        query: dict[str, str],
    ) -> tuple[list[dict[str, Any]], str | None]:
        """Every bucket of a usage or costs query (following its cursor)."""

        async def every(caller: Caller) -> list[dict[str, Any]]:
            buckets: list[dict[str, Any]] = []
            page = query
            for _ in range(MAX_PAGES):
                answer = await operation(caller, page)
                buckets.extend(answer.get("data") or [])
                if not answer.get("has_more") or not answer.get("next_page"):
                    break
                page = {**query, "page": str(answer["next_page"])}
            return buckets

        found = await self._do(session, every)
        return ([], found.text) if isinstance(found, Refusal) else (found, None)

    async def _snapshot(self) -> Snapshot:
        snap = self.metrics()
        return await snap if inspect.isawaitable(snap) else snap

    # -- GET pages -------------------------------------------------------------------------

    async def _get(self, session: Session, rest: str, query: dict[str, str]) -> Response:
        name, as_json = (rest[:-5], True) if rest.endswith(".json") else (rest, False)
        done = DONE.get(query.pop("done", ""))  # a code of ours: a link cannot bring text
        if name == "usage.csv":
            return await self._usage_csv(session, query)
        parts = name.split("/")
        if len(parts) == 2 and parts[0] == "tenants":
            view = await self._tenant(session, parts[1], query)
        elif name in self._pages:
            view = await self._pages[name](session, query)
        else:
            return self._plain(404, "No such page.")
        if as_json:
            return _response(view.status, orjson.dumps(view.data), JSON_TYPE, [])
        body = (html.notice(done) if done else "") + view.body
        twin = url(f"{name}.json", query)
        who = session.token_id + (f" (tenant {session.tenant_id})" if session.tenant_id else "")
        page = html.page(view.title, body, current=view.current or name, twin=twin, signed_in=who)
        return _response(view.status, page, HTML_TYPE, [])

    def _range(
        self, query: Mapping[str, str], ranges: Mapping[str, tuple[int, str]]
    ) -> tuple[str, int, str, int]:
        """The URL's range (default 24h): its name, seconds, bucket width and start time."""
        chosen = _choice(query, "range", ranges, "24h")
        span, width = ranges[chosen]
        width = _choice(query, "bucket_width", WIDTHS, width)
        step = WIDTHS[width]
        now = int(time.time())
        start = (now - span) // step * step
        return chosen, span, width, start

    async def _overview(self, session: Session, query: dict[str, str]) -> View:
        chosen, _, width, start = self._range(query, RANGES_LONG)
        params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
        usage, usage_error = await self._buckets(session, self.service.usage_completions, params)
        costs, cost_error = await self._buckets(session, self.service.costs, params)
        times = [int(b["start_time"]) for b in usage]
        series: dict[str, list[float | None]] = {
            k: [_sum(b, k) for b in usage] for k, _ in METRICS if k != "cost_usd"
        }
        cost_by_time = {int(b["start_time"]): _cost(b) for b in costs}
        series["cost_usd"] = [cost_by_time.get(t, 0.0) for t in times]
        totals = {k: _total(v) for k, v in series.items()}
        if usage_error:  # unknown, not 0
            totals = dict.fromkeys(totals)
        prompt, cached = totals.get("input_tokens") or 0, totals.get("input_cached_tokens")
        hit = None if cached is None or not prompt else cached / prompt
        ttft = await self._ttft_view(session)
        data = {
            "range": chosen,
            "bucket_width": width,
            "start_time": start,
            "totals": {**totals, "cache_hit_rate": hit},
            "usage_error": usage_error,
            "cost_error": cost_error,
            "ttft": ttft,
            "charts": {
                "tokens": _chart(
                    times, [(label, series[k]) for k, label in METRICS[1:4]], "tokens"
                ),
                "requests": _chart(
                    times, [(label, series[k]) for k, label in (METRICS[0], METRICS[4])], "requests"
                ),
                "cost": _chart(times, [("Cost (USD)", series["cost_usd"])], "USD"),
                "ttft": _chart(
                    ttft["series"]["time"], [("Mean TTFT (s)", ttft["series"]["mean_s"])], "s"
                ),
            },
        }
        tiles = [
            ("Requests", _num(totals.get("num_model_requests"))),
            ("Prompt tokens", _num(totals.get("input_tokens"))),
            ("Cached tokens", _num(cached)),
            ("Completion tokens", _num(totals.get("output_tokens"))),
            ("Cache hit rate", "unknown" if hit is None else f"{hit:.1%}"),
            ("Cost", "unknown" if cost_error else f"${totals.get('cost_usd') or 0:.6f}"),
            ("Errors", _num(totals.get("num_errors"))),
            ("TTFT p50 / p95 (streamed)", _ttft_text(ttft)),
        ]
        twin = url("overview.json", query)
        body = (
            html.form(
                url("overview"),
                html.select("range", "Range", [(r, r) for r in RANGES_LONG], chosen),
                "Show",
                method="get",
                name="range",
            )
            + (html.notice(f"Usage: {usage_error}", kind="error") if usage_error else "")
            + html.tiles(tiles)
            + html.chart(twin + "#tokens", "Tokens")
            + html.chart(twin + "#requests", "Requests and errors")
            + html.chart(twin + "#cost", "Cost (USD)")
            + html.chart(twin + "#ttft", "Time to first token, mean between samples (this gateway)")
        )
        return View("Overview", data, body)

    async def _ttft_view(self, session: Session) -> dict[str, Any]:
        """TTFT quantiles since start, and the mean between samples the console took:
        every tenant's traffic, so nothing for a token that may not read it."""
        if scopes.may_read_fleet(session.scopes, session.tenant_id) is not None:
            return {
                "requests": None,
                "mean_s": None,
                "p50_s": None,
                "p95_s": None,
                "series": {"time": [], "mean_s": []},
            }
        snap = await self._snapshot()
        hist = snap.histograms.get("saltgate_time_to_first_token_seconds")
        count = total = 0.0
        if hist is not None:
            for values, summed in hist.values.values():
                count += sum(values)
                total += summed
        samples = self._ttft.samples
        if not samples or count != samples[-1][1]:  # a point per read that saw new requests
            samples.append((time.time(), count, total))
        times, means = [], []
        for (_, c0, s0), (t1, c1, s1) in zip(samples, list(samples)[1:], strict=False):
            if c1 > c0:
                times.append(int(t1))
                means.append((s1 - s0) / (c1 - c0))
        return {
            "requests": int(count),
            "mean_s": total / count if count else None,
            "p50_s": None if hist is None else _quantile(hist, 0.5),
            "p95_s": None if hist is None else _quantile(hist, 0.95),
            "series": {"time": times, "mean_s": means},
        }

    async def _usage(self, session: Session, query: dict[str, str]) -> View:
        chosen, _, width, start = self._range(query, RANGES_LONG)
        metric = _choice(query, "metric", dict(METRICS), "input_tokens")
        group = _choice(query, "group_by", dict(GROUPS_ALL), "")
        params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
        if group:
            params["group_by"] = group
        service = self.service
        operation = service.costs if metric == "cost_usd" else service.usage_completions
        buckets, error = await self._buckets(session, operation, params)
        times = [int(b["start_time"]) for b in buckets]
        per: dict[str, list[float | None]] = {}
        for i, b in enumerate(buckets):
            for r in b.get("results") or []:
                name = _group_name(r, group)
                values = per.setdefault(name, [0.0] * len(buckets))
                value = _cost_result(r) if metric == "cost_usd" else r.get(metric)
                values[i] = None if value is None or values[i] is None else (values[i] or 0) + value
        totals = {n: (None if None in v else sum(x or 0 for x in v)) for n, v in per.items()}
        ranked = sorted(per, key=lambda n: -(totals[n] or 0))
        shown = [(n, per[n]) for n in ranked[:TOP_GROUPS]]
        if len(ranked) > TOP_GROUPS:
            rest = [per[n] for n in ranked[TOP_GROUPS:]]
            shown.append(("other", [sum(v[i] or 0 for v in rest) for i in range(len(times))]))
        label = dict(METRICS)[metric]
        data = {
            "metric": metric,
            "group_by": group,
            "range": chosen,
            "bucket_width": width,
            "start_time": start,
            "error": error,
            "totals": [{"group": n, "total": totals[n]} for n in ranked],
            "charts": {"usage": _chart(times, shown, label)},
        }
        filters = (
            html.select("metric", "Metric", list(METRICS), metric)
            + html.select("group_by", "Group by", list(GROUPS_ALL), group)
            + html.select("range", "Range", [(r, r) for r in RANGES_LONG], chosen)
            + html.select(
                "bucket_width",
                "Bucket",
                [("1m", "1 minute"), ("1h", "1 hour"), ("1d", "1 day")],
                width,
            )
        )
        twin = url("usage.json", query)
        rows = [(esc(n), esc("unknown" if totals[n] is None else _num(totals[n]))) for n in ranked]
        body = (
            html.form(url("usage"), filters, "Show", method="get", name="usage")
            + (html.notice(error, kind="error") if error else "")
            + html.chart(twin + "#usage", f"{label} per {width}")
            + html.table(["Group", label], rows, empty="No usage in this range.")
            + fmt("<p>{}</p>", link(url("usage.csv", query), "Download as CSV"))
        )
        return View("Usage explorer", data, body)

    async def _usage_csv(self, session: Session, query: dict[str, str]) -> Response:
        """The explorer's range as the admin API's CSV export (usage/completions.csv),
        streamed through: one row per bucket and group, every metric."""
        _, _, width, start = self._range(query, RANGES_LONG)
        group = _choice(query, "group_by", dict(GROUPS_ALL), "")
        params = {"start_time": str(start), "bucket_width": width, "limit": _max_limit(width)}
        if group:
            params["group_by"] = str(group)
        caller = await self._caller(session)
        try:  # the query is checked before a byte is streamed
            stream = self.service.usage_completions_csv(caller, params)
        except ApiError as error:
            return self._plain(502, f"Usage: {Refusal(error.status, error.message).text}")
        return Response(200, [CSV, CSV_DISPOSITION, *security_headers()], stream=stream)

    async def _tenants(self, session: Session, query: dict[str, str]) -> View:
        tenants, error = await self._tenant_list(session)
        start = (int(time.time()) - 30 * 86400) // 86400 * 86400
        params = {
            "start_time": str(start),
            "bucket_width": "1d",
            "limit": "31",
            "group_by": "tenant",
        }
        usage, usage_error = await self._buckets(session, self.service.usage_completions, params)
        costs, _ = await self._buckets(session, self.service.costs, params)
        prompt: dict[str, int] = {}
        cached: dict[str, int | None] = {}
        spend: dict[str, float] = {}
        for b in usage:
            for r in b.get("results") or []:
                t = str(r.get("tenant_id"))
                prompt[t] = prompt.get(t, 0) + _int(r.get("input_tokens"))
                c = r.get("input_cached_tokens")
                cached[t] = (
                    None
                    if c is None or (t in cached and cached[t] is None)
                    else (cached.get(t) or 0) + int(c)
                )
        for b in costs:
            for r in b.get("results") or []:
                t = str(r.get("tenant_id"))
                spend[t] = spend.get(t, 0.0) + _cost_result(r)
        rows = []
        for tenant in tenants:
            tid = str(tenant["id"])
            keys, _ = await self._key_list(session, tid)
            live = sum(1 for k in keys if k.get("revoked_at") is None)
            c = cached.get(tid)
            hit = None if c is None or not prompt.get(tid) else c / prompt[tid]
            limits = tenant.get("limits") or {}
            tenant.update(
                {
                    "live_keys": live,
                    "spend_30d_usd": spend.get(tid, 0.0),
                    "cache_hit_rate_30d": hit,
                    "budget_usd": None
                    if limits.get("budget_micro_usd") is None
                    else limits["budget_micro_usd"] / 1e6,
                }
            )
            rows.append(
                (
                    link(url(f"tenants/{tid}"), tenant["name"]),
                    esc(tid),
                    esc(f"${spend.get(tid, 0.0):.6f}"),
                    esc(_budget(limits)),
                    esc(limits_label(_limits(limits))),
                    link(url("keys", {"tenant": tid}), live),
                    esc("unknown" if hit is None else f"{hit:.1%}"),
                    esc("archived" if tenant.get("archived_at") else "active"),
                )
            )
        data = {"tenants": tenants, "error": error, "usage_error": usage_error}
        body = (
            (html.notice(error, kind="error") if error else "")
            + html.table(
                [
                    "Tenant",
                    "Id",
                    "Spend (30 d)",
                    "Budget",
                    "Limits",
                    "Live keys",
                    "Cache hit rate (30 d)",
                    "State",
                ],
                rows,
                empty="No tenants yet.",
            )
            + (
                ""
                if session.tenant_id is not None  # the operator's, as the service says
                else raw("<h2>New tenant</h2>")
                + html.form(
                    url("tenants"),
                    html.field("name", "Name"),
                    "Create tenant",
                    name="create-tenant",
                )
            )
        )
        return View("Tenants", data, body)

    async def _tenant(self, session: Session, tenant_id: str, query: dict[str, str]) -> View:
        found = await self._do(session, lambda caller: self.service.tenants_get(caller, tenant_id))
        if isinstance(found, Refusal):
            return View(
                "Tenant",
                {"error": found.text},
                html.notice(found.text, kind="error"),
                "tenants",
                found.status,
            )
        tenant: dict[str, Any] = dict(found.to_dict())
        limits = tenant.get("limits") or {}
        fields = html.EMPTY.join(
            html.field(
                k, label, shown, kind="text" if k in (BUDGET_USD, BUDGET_PERIOD) else "number"
            )
            for (k, label), shown in zip(LIMIT_FIELDS, _form_values(limits), strict=True)
        ) + html.field("weight", WEIGHT_LABEL, limits.get("weight", ""))
        tid = esc(tenant["id"])
        body = (
            html.table(
                ["Name", "Id", "Salt epoch", "Models", "Created", "Limits"],
                [
                    (
                        esc(tenant["name"]),
                        tid,
                        esc(tenant.get("epoch")),
                        esc(", ".join(tenant.get("models") or []) or "all"),
                        esc(when(tenant.get("created_at"))),
                        esc(limits_label(_limits(limits))),
                    )
                ],
            )
            + fmt("<p>{}</p>", link(url("keys", {"tenant": tenant["id"]}), "Keys of this tenant"))
            + raw("<h2>Limits</h2>")
            + (
                raw(
                    "<p>The operator sets this tenant's limits, budget and weight (a token "
                    "pinned to the tenant may not).</p>"
                )
                if session.tenant_id is not None
                else raw(
                    "<p>Leave a field empty for no limit of that kind. The weight is the "
                    "tenant's fair share when the replicas are saturated (empty: 1).</p>"
                )
                + html.form(
                    url(f"tenants/{tenant['id']}/limits"), fields, "Save limits", name="limits"
                )
            )
            + raw("<h2>Cache namespace</h2>")
            + html.form(
                url(f"tenants/{tenant['id']}/rotate-salt"),
                "",
                "Rotate the salt",
                name="rotate-salt",
            )
        )
        return View(f"Tenant {tenant['name']}", {"tenant": tenant}, body, "tenants")

    async def _keys(self, session: Session, query: dict[str, str]) -> View:
        tenants, error = await self._tenant_list(session)
        chosen = query.get("tenant") or (str(tenants[0]["id"]) if tenants else "")
        keys: list[dict[str, Any]] = []
        if chosen and not error:
            keys, error = await self._key_list(session, chosen)
        rows = []
        for k in keys:
            kid = str(k["id"])
            actions = ""
            if k.get("revoked_at") is None:
                actions = html.form(
                    url(f"keys/{kid}/rotate"),
                    html.field("grace_period_s", "Grace (s)", "86400", kind="number"),
                    "Rotate",
                    name=f"rotate-{kid}",
                ) + html.form(url(f"keys/{kid}/revoke"), "", "Revoke", name=f"revoke-{kid}")
            rows.append(
                (
                    esc(kid),
                    esc(k.get("redacted_value")),
                    esc(when(k.get("created_at"))),
                    esc(when(k.get("last_used_at")) or "never"),
                    esc(when(k.get("expires_at")) or "none"),
                    esc("revoked " + when(k["revoked_at"]) if k.get("revoked_at") else "live"),
                    actions,
                )
            )
        options = [(str(t["id"]), str(t["name"])) for t in tenants]
        data = {"tenant": chosen, "keys": keys, "error": error}
        body = (
            html.form(
                url("keys"),
                html.select("tenant", "Tenant", options, chosen),
                "Show",
                method="get",
                name="pick-tenant",
            )
            + (html.notice(error, kind="error") if error else "")
            + html.table(
                ["Key id", "Key", "Created", "Last used", "Expires", "State", ""],
                rows,
                empty="No keys.",
            )
            + (
                raw("<h2>New key</h2>")
                + html.form(
                    url("keys/create"),
                    html.hidden("tenant", chosen),
                    "Mint a key",
                    name="create-key",
                )
                if chosen
                else ""
            )
        )
        return View("Keys", data, body)

    async def _fleet(self, session: Session, query: dict[str, str]) -> View:
        refused = scopes.may_read_fleet(session.scopes, session.tenant_id)
        if refused is not None:  # replicas, the store and every tenant's traffic
            message = f"The fleet is not shown to this admin token: {refused}."
            body = html.notice(message, kind="error")
            return View("Routing and fleet", {"error": message}, body)  # as a refused call
        snap = await self._snapshot()
        gauges = {
            name: {dict(labels).get("replica", ""): v for labels, v in g.values}
            for name, g in snap.gauges.items()
        }
        healthy = gauges.get("saltgate_replica_healthy", {})
        inflight = gauges.get("saltgate_replica_inflight", {})
        results = snap.gauges.get("saltgate_isolation_canary_result")
        canary = {  # each replica's latest isolation canary result (docs/canary.md)
            dict(labels).get("replica", ""): dict(labels).get("result")
            for labels, v in (results.values if results is not None else [])
            if v == 1.0
        }
        start = (int(time.time()) - 3600) // 60 * 60
        params = {
            "start_time": str(start),
            "bucket_width": "1m",
            "limit": "60",
            "group_by": "replica",
        }
        usage, usage_error = await self._buckets(session, self.service.usage_completions, params)
        ratio: dict[str, tuple[int, int | None]] = {}
        for b in usage:
            for r in b.get("results") or []:
                name = str(r.get("replica"))
                p, c = ratio.get(name, (0, 0))
                rc = r.get("input_cached_tokens")
                ratio[name] = (
                    p + _int(r.get("input_tokens")),
                    None if c is None or rc is None else c + int(rc),
                )
        replicas = []
        for name in sorted(set(healthy) | set(inflight)):
            p, c = ratio.get(name, (0, 0))
            replicas.append(
                {
                    "replica": name,
                    "healthy": healthy.get(name) == 1.0,
                    "canary": canary.get(name),  # None: not run (yet, or switched off)
                    "inflight": int(inflight.get(name, 0)),
                    "cached_ratio_1h": None if c is None or not p else c / p,
                }
            )
        single = {name: g.values[0][1] for name, g in snap.gauges.items() if len(g.values) == 1}
        bus = {
            "configured": self.config.cluster is not None,
            "up": single.get("saltgate_cluster_bus_up"),
            "peers": single.get("saltgate_cluster_peers"),
            "workers_alive": single.get("saltgate_workers_alive"),
        }
        store = {
            "backend": self.config.store_settings.backend,
            "where": self.config.store_settings.describe(),
            "unreachable_s": single.get("saltgate_store_unreachable_seconds"),
            "spooled_records": single.get("saltgate_ledger_spooled_records"),
        }
        data = {"replicas": replicas, "cluster": bus, "store": store, "usage_error": usage_error}
        rows = [
            (
                esc(r["replica"]),
                esc("healthy" if r["healthy"] else "unhealthy"),
                esc(r["canary"] or "not run"),
                esc(r["inflight"]),
                esc("unknown" if r["cached_ratio_1h"] is None else f"{r['cached_ratio_1h']:.1%}"),
            )
            for r in replicas
        ]
        peers = (
            "not configured"
            if not bus["configured"]
            else f"bus {'up' if bus['up'] else 'down'}, {int(bus['peers'] or 0)} other gateways"
        )
        body = (
            raw("<h2>Replicas</h2>")
            + html.table(
                ["Replica", "Health", "Isolation canary", "In flight", "Cached ratio (1 h)"],
                rows,
                empty="No replicas.",
            )
            + raw("<h2>Gateways on the bus</h2>")
            + fmt("<p>{}</p>", peers)
            + (
                fmt("<p>{} worker processes alive</p>", int(bus["workers_alive"] or 0))
                if bus["workers_alive"] is not None
                else ""
            )
            + raw("<h2>Store</h2>")
            + html.table(
                ["Backend", "Where", "Unreachable for", "Spooled records"],
                [
                    (
                        esc(store["backend"]),
                        esc(store["where"]),
                        esc(f"{store['unreachable_s'] or 0:.0f} s"),
                        esc(int(store["spooled_records"] or 0)),
                    )
                ],
            )
        )
        return View("Routing and fleet", data, body)

    async def _audit(self, session: Session, query: dict[str, str]) -> View:
        after = query.get("after", "")
        found = await self._do(
            session,
            lambda caller: self.service.audit_logs_list(
                caller, after_seq=int(after) if after.isdigit() else 0, limit=50
            ),
        )
        error = found.text if isinstance(found, Refusal) else None
        entries = [] if isinstance(found, Refusal) else found.items
        has_more = not isinstance(found, Refusal) and found.has_more
        rows = [
            (
                esc(e.seq),
                esc(when(e.ts)),
                esc(e.actor),
                esc(e.action),
                esc(e.resource_id),
                fmt("<code>{}</code>", e.before or "null"),
                fmt("<code>{}</code>", e.after or "null"),
            )
            for e in entries
        ]
        more = html.EMPTY
        if has_more:
            more = fmt(
                "<p>{}</p>", link(url("audit", {"after": str(entries[-1].seq)}), "Next entries")
            )
        body = (
            (html.notice(error, kind="error") if error else "")
            + html.table(
                ["#", "Time", "Who", "What", "Resource", "Before", "After"],
                rows,
                empty="No entries.",
            )
            + more
        )
        shown = [e.to_dict() for e in entries]
        return View("Audit log", {"entries": shown, "error": error, "has_more": has_more}, body)

    async def _admin_tokens(self, session: Session, query: dict[str, str]) -> View:
        found, error = await self._list(
            session,
            lambda caller, after: self.service.admin_tokens_list(caller, after=after, limit=100),
            lambda t: t.id,
        )
        tokens = [t.to_dict() for t in found]
        rows = [
            (
                esc(t.get("id")),
                esc(t.get("redacted_value")),
                esc(", ".join(t.get("scopes") or [])),
                esc(t.get("tenant_id") or "every tenant"),
                esc(when(t.get("last_used_at")) or "never"),
                esc("revoked" if t.get("revoked_at") else "live"),
                ""
                if t.get("revoked_at")
                else html.form(
                    url(f"admin-tokens/{t['id']}/revoke"),
                    "",
                    "Revoke",
                    name=f"revoke-token-{t['id']}",
                ),
            )
            for t in tokens
        ]
        boxes = html.EMPTY.join(
            fmt('<label><input type="checkbox" name="scopes" value="{}" checked> {}</label>', s, s)
            for s in SCOPE_NAMES
            if s in session.scopes
        )
        body = (
            (html.notice(error, kind="error") if error else "")
            + html.table(
                ["Id", "Token", "Scopes", "Tenant", "Last used", "State", ""],
                rows,
                empty="No admin tokens visible.",
            )
            + raw("<h2>New admin token</h2><p>A token can have only scopes this one has.</p>")
            + html.form(
                url("admin-tokens"),
                fmt('<fieldset class="scopes">{}</fieldset>', boxes)
                + html.field("tenant_id", "Pinned to tenant (id, optional)"),
                "Create admin token",
                name="create-admin-token",
            )
        )
        return View("Admin tokens", {"admin_tokens": tokens, "error": error}, body)

    async def _prices(self, session: Session, query: dict[str, str]) -> View:
        """The prices in effect (the store's over the config's), and with prices:write a
        form to set a model's and a button to clear each set in the store."""
        found = await self._do(session, self.service.prices_list)
        error = found.text if isinstance(found, Refusal) else None
        prices = [] if isinstance(found, Refusal) else [dict(p.to_dict()) for p in found]
        writes = "prices:write" in session.scopes and session.tenant_id is None
        rows = [
            (
                esc(p.get("model")),
                esc(f"${p.get('input_per_mtok')}"),
                esc(f"${p.get('cached_input_per_mtok')}"),
                esc(f"${p.get('output_per_mtok')}"),
                esc(p.get("version")),
                esc(p.get("source")),
                html.form(
                    url("prices/clear"),
                    html.hidden("model", p.get("model")),
                    "Clear",
                    name=f"clear-price-{p.get('model')}",
                )
                if writes and p.get("source") == "store"
                else "",
            )
            for p in prices
        ]
        body = (html.notice(error, kind="error") if error else "") + html.table(
            [
                "Model",
                "Input / Mtok",
                "Cached input / Mtok",
                "Output / Mtok",
                "Version",
                "Source",
                "",
            ],
            rows,
            empty="No prices: usage is counted, not priced.",
        )
        body += raw(
            "<p>A price set here (source <em>store</em>) overrides the configuration's "
            "<code>[prices]</code> table for that model; clearing it reverts to the "
            "configuration's. The gateways bill with a change within a second; a request "
            "keeps the price of its time.</p>"
        )
        if writes:
            body += raw(
                "<h2>Set a price</h2><p>USD per million tokens, up to 6 decimals.</p>"
            ) + html.form(
                url("prices"),
                html.field("model", "Model")
                + html.field("input_per_mtok", "Input")
                + html.field("cached_input_per_mtok", "Cached input")
                + html.field("output_per_mtok", "Output"),
                "Set price",
                name="set-price",
            )
        return View("Prices", {"prices": prices, "error": error}, body)

    # -- forms -----------------------------------------------------------------------------

    async def _action(self, session: Session, rest: str, request: Request) -> Response:
        """A form's POST: the matching admin API call, then a page (or the new secret)."""
        parts = rest.split("/")
        # "tenants" or "keys/create" as they are; "keys/ID/revoke" as ("keys", "revoke").
        name = rest if len(parts) < 3 else f"{parts[0]}/{parts[-1]}"
        ident = unquote(parts[1]) if len(parts) == 3 else ""
        action = self._actions.get(name)
        if action is None or len(parts) > 3:
            return self._plain(404, "No such form.")
        form = parse_qs(request.body.decode("utf-8", "replace"), keep_blank_values=True)
        return await action(session, ident, Form(form))

    async def _create_tenant(self, session: Session, _: str, form: Form) -> Response:
        name = form.one("name")
        made = await self._do(session, lambda caller: self.service.tenants_create(caller, name))
        to = (
            ""
            if isinstance(made, Refusal)
            else url(f"tenants/{made.id}", {"done": "tenant-created"})
        )
        return self._after(made, to)

    async def _set_limits(self, session: Session, tenant: str, form: Form) -> Response:
        names = [k for k, _ in LIMIT_FIELDS] + ["weight"]
        try:
            limits = parse_limits({k: form.one(k) for k in names})
        except ValueError as exc:
            return self._plain(400, f"{str(exc).capitalize()}.")
        done = await self._do(
            session, lambda caller: self.service.tenants_limits(caller, tenant, limits)
        )
        return self._after(done, url(f"tenants/{tenant}", {"done": "limits-saved"}))

    async def _rotate_salt(self, session: Session, tenant: str, _: Form) -> Response:
        done = await self._do(
            session, lambda caller: self.service.tenants_rotate_salt(caller, tenant)
        )
        back = {"done": "salt-rotated"}
        return self._after(done, url(f"tenants/{tenant}", back))

    async def _create_key(self, session: Session, _: str, form: Form) -> Response:
        tenant = form.one("tenant")
        made = await self._do(
            session, lambda caller: self.service.keys_create(caller, tenant, DEFAULT_PRIORITY)
        )
        return self._shown_once(made, "New API key", url("keys", {"tenant": tenant}))

    async def _revoke_key(self, session: Session, key: str, _: Form) -> Response:
        done = await self._do(session, lambda caller: self.service.keys_revoke(caller, key))
        tenant = "" if isinstance(done, Refusal) else done.tenant_id
        return self._after(done, url("keys", {"tenant": tenant, "done": "key-revoked"}))

    async def _rotate_key(self, session: Session, key: str, form: Form) -> Response:
        try:
            grace = float(form.one("grace_period_s") or 86400)
        except ValueError:
            return self._plain(400, "The grace period is a number of seconds.")
        made = await self._do(session, lambda caller: self.service.keys_rotate(caller, key, grace))
        tenant = "" if isinstance(made, Refusal) else made.key.tenant_id
        return self._shown_once(made, "Rotated API key", url("keys", {"tenant": tenant}))

    async def _create_admin_token(self, session: Session, _: str, form: Form) -> Response:
        try:
            wanted = scopes.parse_scopes(form.values.get("scopes") or [])
        except ValueError as exc:
            return self._plain(400, str(exc))
        tenant = form.one("tenant_id") or session.tenant_id
        made = await self._do(
            session, lambda caller: self.service.admin_tokens_create(caller, wanted, tenant)
        )
        return self._shown_once(made, "New admin token", url("admin-tokens"))

    async def _revoke_admin_token(self, session: Session, token_id: str, _: Form) -> Response:
        done = await self._do(
            session, lambda caller: self.service.admin_tokens_revoke(caller, token_id)
        )
        return self._after(done, url("admin-tokens", {"done": "admin-token-revoked"}))

    async def _set_price(self, session: Session, _: str, form: Form) -> Response:
        model = form.one("model")
        fields = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
        try:
            price = price_from_fields({f: form.one(f) for f in fields})
        except ValueError as exc:
            return self._plain(400, str(exc))
        done = await self._do(session, lambda caller: self.service.prices_set(caller, model, price))
        return self._after(done, url("prices", {"done": "price-set"}))

    async def _clear_price(self, session: Session, _: str, form: Form) -> Response:
        model = form.one("model")
        done = await self._do(session, lambda caller: self.service.prices_clear(caller, model))
        back = {"done": "price-cleared"}
        return self._after(done, url("prices", back))

    def _after(self, done: object, to: str) -> Response:
        """Post, then redirect to a page (so a reload does not post again); or the error."""
        if isinstance(done, Refusal):
            return self._plain(done.status, done.text)
        return redirect(to)

    def _shown_once(
        self, made: NewKey | NewAdminToken | Refusal, title: str, back: str
    ) -> Response:
        """A new secret, on this response only (never in a URL, never stored here)."""
        if isinstance(made, Refusal):
            return self._plain(made.status, made.text)
        made_id = made.key.id if isinstance(made, NewKey) else made.token.id
        body = (
            html.notice("Copy it now: it is shown this once.")
            + fmt('<p><code class="secret" data-secret="1">{}</code></p>', made.value)
            + fmt("<p>Id {}. {}</p>", made_id, link(back, "Back"))
        )
        return _response(201, html.page(title, body, signed_in=""), HTML_TYPE, [])

    async def _tenant_list(self, session: Session) -> tuple[list[dict[str, Any]], str | None]:
        found, error = await self._list(
            session,
            lambda caller, after: self.service.tenants_list(caller, after=after, limit=100),
            lambda t: t.id,
        )
        return [dict(t.to_dict()) for t in found], error

    async def _key_list(
        self, session: Session, tenant: str
    ) -> tuple[list[dict[str, Any]], str | None]:
        found, error = await self._list(
            session,
            lambda caller, after: self.service.keys_list(caller, tenant, after=after, limit=100),
            lambda k: k.key.id,
        )
        return [dict(k.to_dict()) for k in found], error


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
