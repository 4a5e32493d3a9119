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

from collections.abc import Awaitable, Callable
from functools import partial
from urllib.parse import parse_qs, unquote

import orjson

from saltgate.admin.service import (
    AdminService,
)
from saltgate.admin.tokens import AUTHENTICATED, authenticate_admin
from saltgate.config import GatewayConfig
from saltgate.console import html
from saltgate.console.common import (
    DONE,
    HTML_TYPE,
    JSON_TYPE,
    PREFIX,
    STATIC_TYPES,
    Form,
    SnapshotSource,
    View,
    _Answer,
    _response,
    _static_files,
    redirect,
)
from saltgate.console.core import ConsoleCore
from saltgate.console.html import raw, url
from saltgate.console.pages.actions import (
    clear_price,
    create_admin_token,
    create_key,
    create_tenant,
    revoke_admin_token,
    revoke_key,
    rotate_key,
    rotate_salt,
    set_limits,
    set_price,
)
from saltgate.console.pages.admin_tokens import admin_tokens_page
from saltgate.console.pages.audit import audit_page
from saltgate.console.pages.fleet import fleet_page
from saltgate.console.pages.keys import keys_page
from saltgate.console.pages.overview import overview_page
from saltgate.console.pages.prices import prices_page
from saltgate.console.pages.tenants import tenant_page, tenants_page
from saltgate.console.pages.usage import usage_csv, usage_page
from saltgate.console.security import (
    SAFE_METHODS,
    Session,
    SignInLimiter,
    clear_cookie,
    cookie_value,
    same_origin,
    security_headers,
    set_cookie,
)
from saltgate.http import Request, Response


class Console(ConsoleCore):
    """`handle` answers /console/... (None for any other path)."""

    def __init__(
        self,
        service: AdminService,
        metrics: SnapshotSource,
        config: GatewayConfig,
        *,
        tls: bool = False,
    ) -> None:
        super().__init__(service, metrics, config, tls=tls)
        self.sign_ins = SignInLimiter()
        self.static = _static_files()
        self._pages: dict[str, Callable[[Session, dict[str, str]], Awaitable[View]]] = {
            "overview": partial(overview_page, self),
            "usage": partial(usage_page, self),
            "tenants": partial(tenants_page, self),
            "keys": partial(keys_page, self),
            "fleet": partial(fleet_page, self),
            "audit": partial(audit_page, self),
            "admin-tokens": partial(admin_tokens_page, self),
            "prices": partial(prices_page, self),
        }
        self._actions: dict[str, Callable[[Session, str, Form], Awaitable[Response]]] = {
            "tenants": partial(create_tenant, self),
            "tenants/limits": partial(set_limits, self),
            "tenants/rotate-salt": partial(rotate_salt, self),
            "keys/create": partial(create_key, self),
            "keys/revoke": partial(revoke_key, self),
            "keys/rotate": partial(rotate_key, self),
            "admin-tokens": partial(create_admin_token, self),
            "admin-tokens/revoke": partial(revoke_admin_token, self),
            "prices": partial(set_price, self),
            "prices/clear": partial(clear_price, self),
        }

    # -- entry -----------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response | None:
        path = request.path.decode("utf-8", "replace")
        if path != PREFIX and not path.startswith(PREFIX + "/"):
            return None
        if path in (PREFIX, PREFIX + "/"):
            return redirect(url("overview"))
        if request.method not in SAFE_METHODS and not same_origin(request, tls=self.tls):
            return self.plain(403, "Refused: a change to the console must come from its own pages.")
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
            return self.plain(405, "Use GET, or POST from a form.")
        query = {k: v[-1] for k, v in parse_qs(request.query.decode("utf-8", "replace")).items()}
        return await self._get(session, rest, query)

    def _static(self, name: str) -> Response:
        content = self.static.get(name)
        if content is None:
            return self.plain(404, "No such file.")
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
            return self.plain(405, "Use GET or POST.")
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
            return self.plain(405, "Sign out with the button (POST).")
        self.sessions.end(cookie_value(request))
        return redirect(url("sign-in"), [(b"set-cookie", clear_cookie(tls=self.tls))])

    # -- the admin service, as the session's token ----------------------------------------

    # -- GET pages -------------------------------------------------------------------------

    async def _get(self, session: Session, rest: str, query: dict[str, str]) -> Response:
        name, as_json = (rest[:-5], True) if rest.endswith(".json") else (rest, False)
        done = DONE.get(query.pop("done", ""))  # a code of ours: a link cannot bring text
        if name == "usage.csv":
            return await usage_csv(self, session, query)
        parts = name.split("/")
        if len(parts) == 2 and parts[0] == "tenants":
            view = await tenant_page(self, session, parts[1], query)
        elif name in self._pages:
            view = await self._pages[name](session, query)
        else:
            return self.plain(404, "No such page.")
        if as_json:
            return _response(view.status, orjson.dumps(view.data), JSON_TYPE, [])
        body = (html.notice(done) if done else "") + view.body
        twin = url(f"{name}.json", query)
        who = session.token_id + (f" (tenant {session.tenant_id})" if session.tenant_id else "")
        page = html.page(view.title, body, current=view.current or name, twin=twin, signed_in=who)
        return _response(view.status, page, HTML_TYPE, [])

    # -- forms -----------------------------------------------------------------------------

    async def _action(self, session: Session, rest: str, request: Request) -> Response:
        """A form's POST: the matching admin API call, then a page (or the new secret)."""
        parts = rest.split("/")
        # "tenants" or "keys/create" as they are; "keys/ID/revoke" as ("keys", "revoke").
        name = rest if len(parts) < 3 else f"{parts[0]}/{parts[-1]}"
        ident = unquote(parts[1]) if len(parts) == 3 else ""
        action = self._actions.get(name)
        if action is None or len(parts) > 3:
            return self.plain(404, "No such form.")
        form = parse_qs(request.body.decode("utf-8", "replace"), keep_blank_values=True)
        return await action(session, ident, Form(form))
