"""The console's core, which every page takes: the admin service called as the session's
token (its refusals as the API's), the metrics, and the answers pages share. The router
(app.py) adds sessions, sign-in and the pages themselves."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from saltgate.admin.service import (
    AdminService,
    Caller,
    NewAdminToken,
    NewKey,
    Page,
    store_status,
)
from saltgate.admin.tokens import authenticate_admin
from saltgate.config import GatewayConfig
from saltgate.console import html
from saltgate.console.common import (
    HTML_TYPE,
    MAX_PAGES,
    WIDTHS,
    Refusal,
    SnapshotSource,
    T,
    UsageOperation,
    _Answer,
    _choice,
    _response,
    _Ttft,
    redirect,
)
from saltgate.console.html import fmt, link, url
from saltgate.console.security import (
    Session,
    Sessions,
)
from saltgate.gateway.metrics import Snapshot
from saltgate.http import Response
from saltgate.policy.errors import ApiError
from saltgate.store.errors import StoreError
from saltgate.store.ledger import new_request_id


class ConsoleCore:
    """What a page may use; nothing of the routing or the sign-in."""

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
        self.ttft = _Ttft()

    def plain(self, status: int, message: str) -> Response:
        body = html.page(
            "Refused" if status == 403 else "Error", html.notice(message, kind="error")
        )
        return _response(status, body, HTML_TYPE, [])

    async def caller(self, session: Session) -> Caller:
        """The session's token as the service's caller, read from the store on every page
        as the API reads it: a token revoked since sign-in (or pinned to a tenant since
        archived) ends the session and sends the browser to sign in again."""
        principal = await authenticate_admin(self.service.store, session.token)
        if principal is None:
            self.sessions.end_token(session.token)
            raise _Answer(redirect(url("sign-in")))
        return Caller.of(principal, new_request_id())

    async def do(self, session: Session, op: Callable[[Caller], Awaitable[T]]) -> T | Refusal:
        """One service operation as the session's token; its refusal as the API's
        status and message."""
        caller = await self.caller(session)
        try:
            return await op(caller)
        except ApiError as error:
            return Refusal(error.status, error.message)
        except StoreError as error:
            return Refusal(store_status(error), str(error))

    async def list_all(
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

        found = await self.do(session, every)
        return ([], found.text) if isinstance(found, Refusal) else (found, None)

    async def buckets(
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

        found = await self.do(session, every)
        return ([], found.text) if isinstance(found, Refusal) else (found, None)

    async def snapshot(self) -> Snapshot:
        snap = self.metrics()
        return await snap if inspect.isawaitable(snap) else snap

    def range_of(
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

    def after(self, done: object, to: str) -> Response:
        """Post, then redirect to a page (so a reload does not post again); or the error."""
        if isinstance(done, Refusal):
            return self.plain(done.status, done.text)
        return redirect(to)

    def shown_once(self, made: NewKey | NewAdminToken | Refusal, title: str, back: str) -> Response:
        """A new secret, on this response only (never in a URL, never stored here)."""
        if isinstance(made, Refusal):
            return self.plain(made.status, made.text)
        made_id = made.key.id if isinstance(made, NewKey) else made.token.id
        body = (
            html.notice("Copy it now: it is shown this once.")
            + fmt('<p><code class="secret" data-secret="1">{}</code></p>', made.value)
            + fmt("<p>Id {}. {}</p>", made_id, link(back, "Back"))
        )
        return _response(201, html.page(title, body, signed_in=""), HTML_TYPE, [])

    async def tenant_list(self, session: Session) -> tuple[list[dict[str, Any]], str | None]:
        found, error = await self.list_all(
            session,
            lambda caller, after: self.service.tenants_list(caller, after=after, limit=100),
            lambda t: t.id,
        )
        return [dict(t.to_dict()) for t in found], error

    async def key_list(
        self, session: Session, tenant: str
    ) -> tuple[list[dict[str, Any]], str | None]:
        found, error = await self.list_all(
            session,
            lambda caller, after: self.service.keys_list(caller, tenant, after=after, limit=100),
            lambda k: k.key.id,
        )
        return [dict(k.to_dict()) for k in found], error
