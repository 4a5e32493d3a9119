"""Remote media the gateway fetches itself ([media] remote = "fetch"; docs/multimodal.md).

The shell around policy/egress.py, which decides everything: this module resolves, connects,
reads and counts. For each remote media URL of a request (`content.remote_media`):

- the host is resolved once (the loop's resolver, or one a test injects), every address
  it resolves to is checked, and the connection goes to the checked address: no second
  resolution a DNS rebinding could answer differently. Host header and TLS name (SNI and
  certificate check) stay the URL's host;
- the gateway's own HTTP client (http/client.py) fetches it: it reads no proxy
  environment variable (HTTP_PROXY, ...) and sends nothing of the client's request;
- a redirect is not followed but checked as a new URL (egress.redirect) and fetched anew;
- the body is streamed under the item and request byte caps, the whole fetch under one
  deadline (timeout_s, slots and redirects included);
- fetches run in slots: at most per_tenant_concurrency at once per tenant and
  max_concurrency for all, so a tenant's slow URLs hold its own slots, not others'.

The bytes are inlined as ``data:`` URLs (`content.inline_media`); the request policy then
gives them the content-bound media uuid as any inline media (`content.rewrite`). Any
refusal is a 400 naming the part and the reason, never the URL (it may carry a token).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import itertools
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Final

import orjson

from saltgate.gateway.metrics import Metrics
from saltgate.http import Headers, UpstreamError, UpstreamPool, UpstreamResponse
from saltgate.http.tls import client_context
from saltgate.policy import content, egress
from saltgate.policy.egress import (
    FAILED,
    REDIRECT_STATUSES,
    TIMED_OUT,
    IPAddress,
    Media,
    MediaRefused,
    MediaSettings,
    MediaUrl,
)
from saltgate.policy.errors import ApiError
from saltgate.policy.request import Body

Resolver = Callable[[str, int], Awaitable[list[IPAddress]]]
FETCHES: Final = "saltgate_media_fetches_total"
_FETCHED: Final = (("outcome", "fetched"),)


class SystemResolver:
    """The system's resolver (getaddrinfo) in threads of its own, at most one per fetch
    slot: a tenant whose names answer slowly holds its own slots' threads, neither the
    event loop nor the default executor the rest of the gateway uses (the spool)."""

    def __init__(self, threads: int) -> None:
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="saltgate-media-dns")

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        infos = await asyncio.get_running_loop().run_in_executor(self._threads, lookup)
        return [ipaddress.ip_address(info[4][0]) for info in infos]

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


class _Tenant:
    __slots__ = ("slots", "users")

    def __init__(self, size: int) -> None:
        self.slots = asyncio.Semaphore(size)
        self.users = 0  # fetches holding or waiting for a slot: forgotten at 0


class Slots:
    """At most ``per_tenant`` fetches at once per tenant, ``total`` for all: a tenant
    waits for its own slot before it takes one of the shared ones."""

    def __init__(self, per_tenant: int, total: int) -> None:
        self._per_tenant = per_tenant
        self._total = asyncio.Semaphore(total)
        self._tenants: dict[str, _Tenant] = {}

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        entry = self._tenants.get(tenant)
        if entry is None:
            entry = self._tenants[tenant] = _Tenant(self._per_tenant)
        entry.users += 1
        try:
            async with entry.slots, self._total:
                yield
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._tenants[tenant]

    def users(self, tenant: str) -> int:
        """The fetches of ``tenant`` running or waiting for a slot."""
        entry = self._tenants.get(tenant)
        return 0 if entry is None else entry.users


class _Budget:
    """The bytes a request's fetches have read together (max_request_bytes)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int) -> None:
        self.used += size
        egress.check_request_size(self.used, self.limit)


def _asking(modality: str) -> Headers:
    """A fetch's request headers: nothing of the client's request."""
    return [
        (b"accept", f"{modality}/*".encode()),
        (b"accept-encoding", b"identity"),
        (b"user-agent", b"saltgate-media-fetch"),
        (b"connection", b"close"),
    ]


def _header(response: UpstreamResponse, name: bytes) -> str | None:
    value = response.header(name)
    return None if value is None else value.decode("latin-1")


class MediaFetcher:
    """Fetches a request's remote media under ``settings`` and inlines it."""

    def __init__(self, settings: MediaSettings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        metrics.describe(
            FETCHES,
            "counter",
            "Requests with remote media ([media] remote = fetch), by outcome: fetched, or "
            "the code of the refusal.",
        )
        self._resolver = SystemResolver(settings.max_concurrency)
        # Tests inject theirs (a name resolving to a private address).
        self.resolve: Resolver = self._resolver
        self.slots = Slots(settings.per_tenant_concurrency, settings.max_concurrency)
        self._tls: ssl.SSLContext | None = None

    def close(self) -> None:
        self._resolver.close()

    @property
    def tls(self) -> ssl.SSLContext:
        if self._tls is None:  # made on the first https fetch: reads tls_ca_file then
            self._tls = client_context(self.settings.tls_ca_file)
        return self._tls

    async def inline(self, route: str, body: Body, tenant: str) -> Body:
        """``body`` with its remote media fetched and inlined as data: URLs (``body``
        itself when it has none); ApiError (400) naming the part that was refused."""
        items = content.remote_media(route, body.obj)
        if not items:
            return body
        try:
            fetches = egress.fetch_list(route, items, self.settings)
        except ApiError as refused:
            raise self._counted(refused) from None
        fetched: dict[str, str] = {}
        failure: ApiError | None = None
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                failure = await self._fetch_all(route, fetches, tenant, fetched)
        except TimeoutError:
            late = next(item for item in fetches if item.url not in fetched)
            why = f"fetching the request's media took longer than {self.settings.timeout_s:g} s"
            failure = egress.refusal(route, late.param, MediaRefused(why, TIMED_OUT))
        if failure is not None:
            raise self._counted(failure)
        self.metrics.inc(FETCHES, _FETCHED)
        obj = content.inline_media(route, orjson.loads(body.serialized), fetched)
        content.check(route, obj)  # nothing remote is left for a replica to fetch
        return Body(obj, orjson.dumps(obj))

    def _counted(self, refused: ApiError) -> ApiError:
        self.metrics.inc(FETCHES, (("outcome", refused.code or "refused"),))
        return refused

    async def _fetch_all(
        self,
        route: str,
        fetches: list[content.RemoteMedia],
        tenant: str,
        fetched: dict[str, str],
    ) -> ApiError | None:
        """Fetch every item at once (each in its slot) into ``fetched``; the first
        refusal stops the others and is returned."""
        budget = _Budget(self.settings.max_request_bytes)
        failures: list[ApiError] = []
        try:
            async with asyncio.TaskGroup() as group:
                for item in fetches:
                    group.create_task(self._fetch_into(route, item, tenant, budget, fetched))
        except* ApiError as refused:
            failures = [e for e in refused.exceptions if isinstance(e, ApiError)]
        return failures[0] if failures else None

    async def _fetch_into(
        self,
        route: str,
        item: content.RemoteMedia,
        tenant: str,
        budget: _Budget,
        fetched: dict[str, str],
    ) -> None:
        try:
            async with self.slots.slot(tenant):
                media = await self._fetch(item, budget)
        except MediaRefused as refused:
            raise egress.refusal(route, item.param, refused) from None
        except UpstreamError as broke:
            why = MediaRefused(f"fetching the media failed ({broke})", FAILED)
            raise egress.refusal(route, item.param, why) from None
        fetched[item.url] = media.data_url

    async def _fetch(self, item: content.RemoteMedia, budget: _Budget) -> Media:
        """One URL, its redirects checked and followed, to its bytes."""
        settings = self.settings
        url = egress.parse_url(item.url, settings)
        for hops in itertools.count():
            response, pool = await self._get(url, item.modality)
            try:
                if response.status in REDIRECT_STATUSES:
                    location = _header(response, b"location")
                    url = egress.redirect(url, location, hops, settings)
                    continue
                return await self._media(response, item.modality, budget)
            finally:
                response.release()
                await pool.close()
        raise AssertionError("unreachable")

    async def _get(self, url: MediaUrl, modality: str) -> tuple[UpstreamResponse, UpstreamPool]:
        """The answer to a GET of ``url`` (and its one-connection client, to close), from
        the first of its checked addresses that answers."""
        failure: UpstreamError | None = None
        for address in await self._addresses(url):
            pool = self._pool(url, address)
            try:
                return await pool.request(
                    b"GET", url.target.encode("ascii"), _asking(modality)
                ), pool
            except UpstreamError as exc:
                failure = exc  # the next address; the pool is closed outside the handler
            await pool.close()
        assert failure is not None
        raise failure

    async def _addresses(self, url: MediaUrl) -> list[IPAddress]:
        """The addresses to connect to: the literal, or what the host resolves to, once,
        every one of them checked."""
        if url.literal is not None:
            return [url.literal]  # parse_url checked it
        try:
            addresses = await self.resolve(url.host, url.port)
        except OSError:
            raise MediaRefused("the media host does not resolve", FAILED) from None
        egress.check_addresses(addresses, self.settings)
        return list(dict.fromkeys(addresses))

    def _pool(self, url: MediaUrl, address: IPAddress) -> UpstreamPool:
        """A one-connection client for ``url`` bound to ``address``."""
        timeout = self.settings.timeout_s
        return UpstreamPool(
            url.host,
            url.port,
            tls=self.tls if url.scheme == "https" else None,
            max_idle=0,
            connect_timeout=timeout,
            response_timeout=timeout,
            read_timeout=timeout,
            address=str(address),
            authority=url.authority,
        )

    async def _media(self, response: UpstreamResponse, modality: str, budget: _Budget) -> Media:
        settings = self.settings
        egress.check_status(response.status)
        egress.check_encoding(_header(response, b"content-encoding"))
        mime = egress.media_type(_header(response, b"content-type"), modality, settings)
        egress.check_declared_size(_header(response, b"content-length"), settings.max_item_bytes)
        parts: list[bytes] = []
        size = 0
        while (chunk := await response.next_chunk()) is not None:
            size += len(chunk)
            egress.check_size(size, settings.max_item_bytes)
            budget.take(len(chunk))
            parts.append(chunk)
        return Media(mime, b"".join(parts))
