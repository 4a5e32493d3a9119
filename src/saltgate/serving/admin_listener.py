"""The admin listener's front door: one handler for `serve`, `serve --workers N` and `up`.

Before anything else a request's ``Host`` must name this listener (`allowed_hosts`) or
be an IP address: a DNS-rebinding page, which the browser sends with its own host name,
is answered 421 and reads nothing. Then the admin API (/admin/v1/), the console
(/console/) and /metrics, which takes an admin token that may read every tenant's
traffic (saltgate.admin.scopes.may_read_fleet): a bearer token, as Prometheus sends from
``authorization.credentials_file`` (docs/observability.md).

Every request leaves one line in the gateway's access log, in its format: the method,
the path without its query, the status, the admin token's id (never the token: the id
comes from saltgate.admin.tokens.AUTHENTICATED, set where a token or session is
accepted), the peer and the duration; refused ones (401, 403, 421, failed sign-ins) too.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Final

from saltgate.admin import scopes
from saltgate.admin.api import JSON, AdminApi
from saltgate.admin.tokens import AUTHENTICATED, AdminPrincipal, authenticate_admin
from saltgate.config import (
    LOOPBACK_NAMES,
    GatewayConfig,
    admin_plaintext_warning,
    refuse_plaintext_admin,
)
from saltgate.console.app import Console
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.server import error_response
from saltgate.http import HttpServer, Request, Response
from saltgate.policy.errors import ApiError
from saltgate.runtime import listen_error
from saltgate.serving.listener_tls import listener_context
from saltgate.store.errors import StoreError

log = logging.getLogger(__name__)
ADMIN_OPTIONS: Final = "the admin listener: gateway.admin_host, gateway.admin_port"

METRICS_PATH: Final = b"/metrics"
METRICS_TYPE: Final = (b"content-type", b"text/plain; version=0.0.4")
CHALLENGE: Final = (b"www-authenticate", b'Bearer realm="saltgate-admin"')
MAX_SCRAPERS: Final = 64  # tokens remembered for metrics through a store outage
LOCAL_HOSTS: Final = frozenset({*LOOPBACK_NAMES, "127.0.0.1", "[::1]"})

RenderMetrics = Callable[[], Awaitable[bytes]]


def allowed_hosts(config: GatewayConfig) -> frozenset[str]:
    """The names a request's Host may give: admin_host, the loopback names and the
    operator's admin_allowed_hosts (lower case, IPv6 in brackets, no port)."""
    own = config.admin_host.lower()
    if ":" in own and not own.startswith("["):
        own = f"[{own}]"
    return frozenset({own, *LOCAL_HOSTS, *config.admin_allowed_hosts})


def host_name(header: bytes | None) -> str | None:
    """The name in a Host header without its port (lower case), or None if malformed."""
    if header is None:
        return None
    try:
        text = header.decode("ascii").strip().lower()
    except UnicodeDecodeError:
        return None
    if text.startswith("["):  # [::1]:8001
        end = text.find("]") + 1
        name, port = text[:end], text[end:]
        if not end or (port and not port.startswith(":")):
            return None
        port = port[1:]
    else:
        name, _, port = text.partition(":")
    if port and not port.isdigit():
        return None
    return name or None


def host_allowed(name: str | None, hosts: frozenset[str]) -> bool:
    """A name of `hosts`, or an IP address: DNS rebinding needs a DNS name (the page's
    own, pointed at this listener after it loaded), so an address is no rebinding, and
    Prometheus scraping a pod by its address needs no list."""
    if name is None:
        return False
    if name in hosts:
        return True
    try:
        ipaddress.ip_address(name.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


class AdminListener:
    """`handle` answers every request of the admin listener (see the module doc)."""

    def __init__(
        self,
        config: GatewayConfig,
        api: AdminApi,
        console: Console | None,
        metrics: RenderMetrics,
        log: AccessLog,
    ) -> None:
        """``console`` None: /metrics alone, no admin API or console (the EPP's
        `[epp] metrics_port`); ``api`` then only checks the scrapers' tokens."""
        self.api = api
        self.console = console
        self.metrics = metrics
        self.log = log
        self.hosts = allowed_hosts(config)
        # Tokens /metrics accepted, by SHA-256, for a store outage (`_scraper`).
        self._scrapers: dict[bytes, AdminPrincipal] = {}

    async def handle(self, request: Request) -> Response:
        started = time.monotonic()
        who = AUTHENTICATED.set(None)  # this request's token id, once one is accepted
        status = 500
        try:
            response = await self._answer(request)
            status = response.status
            return response
        finally:
            token_id = AUTHENTICATED.get()
            AUTHENTICATED.reset(who)
            self.log.write_admin(
                request.method,
                request.path,
                status,
                token_id=token_id,
                client_addr=request.client.peer,
                started=started,
            )

    async def _answer(self, request: Request) -> Response:
        if not host_allowed(host_name(request.header(b"host")), self.hosts):
            return _error(
                421, "this admin listener does not answer to that Host (admin_allowed_hosts)"
            )
        if self.console is not None:
            answer = await self.api.handle(request) or await self.console.handle(request)
            if answer is not None:
                return answer
        if request.path == METRICS_PATH:
            return await self._metrics(request)
        return Response(404)

    async def _metrics(self, request: Request) -> Response:
        if request.method not in (b"GET", b"HEAD"):
            return _error(405, "use GET", headers=[(b"allow", b"GET")])
        header = request.header(b"authorization") or b""
        scheme, _, token = header.decode("latin-1").partition(" ")
        principal = None
        if scheme.lower() == "bearer" and token.strip():
            try:
                principal = await self._scraper(token.strip())
            except StoreError:
                return _error(503, "the store does not answer, and this token was not seen before")
        if principal is None:
            return _error(
                401,
                "metrics take an admin token with usage:read: Authorization: Bearer sgadm_...",
                headers=[CHALLENGE],
            )
        refused = scopes.may_read_fleet(principal.scopes, principal.tenant_id)
        if refused is not None:
            return _error(403, refused)
        return Response(200, [METRICS_TYPE], await self.metrics())

    async def _scraper(self, token: str) -> AdminPrincipal | None:
        """The token's principal, from the store; while the store does not answer, a
        token it accepted before (since start), so metrics go on through an outage,
        when they matter most. A revocation applies once the store answers again."""
        digest = hashlib.sha256(token.encode("utf-8", "replace")).digest()
        try:
            principal = await authenticate_admin(self.api.store, token)
        except StoreError:
            known = self._scrapers.get(digest)
            if known is None:
                raise
            AUTHENTICATED.set(known.token_id)
            return known
        if principal is None:
            self._scrapers.pop(digest, None)
        elif digest in self._scrapers or len(self._scrapers) < MAX_SCRAPERS:
            self._scrapers[digest] = principal
        return principal


def _error(
    status: int, message: str, *, headers: list[tuple[bytes, bytes]] | None = None
) -> Response:
    error = ApiError(status, message, headers=headers or [])
    return Response(status, [JSON, *error.headers], error.body())


def admin_tls(config: GatewayConfig) -> ssl.SSLContext | None:
    """The admin listener's server context (None: plain HTTP, on loopback or opted in);
    ConfigError naming the file when one cannot be used."""
    refuse_plaintext_admin(config)
    cert, key = config.admin_tls_cert_file, config.admin_tls_key_file
    if cert is None or key is None:
        return None
    return listener_context(cert, key, "admin_")


def warn_plaintext_admin(config: GatewayConfig) -> None:
    """Say it on stderr when the operator opted into plain HTTP off loopback."""
    warning = admin_plaintext_warning(config)
    if warning is not None:
        print(f"saltgate: {warning}", file=sys.stderr, flush=True)


async def start_admin_listener(
    listener: AdminListener, config: GatewayConfig, tls: ssl.SSLContext | None
) -> tuple[HttpServer, int]:
    """The admin listener serving on admin_host:admin_port; `tls` from `admin_tls`, made
    before anything else started (a refusal leaves nothing bound)."""
    if (warning := admin_plaintext_warning(config)) is not None:
        log.warning(warning)
    server = HttpServer(listener.handle, error_response=error_response)
    assert config.admin_port is not None
    try:
        port = await server.start(config.admin_host, config.admin_port, tls=tls)
    except OSError as exc:
        raise listen_error(ADMIN_OPTIONS, config.admin_host, config.admin_port, exc) from None
    return server, port


def admin_scheme(config: GatewayConfig) -> str:
    return "https" if config.admin_tls_cert_file is not None else "http"
