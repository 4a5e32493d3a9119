"""[media] remote = "fetch": the gateway fetches remote media itself, under its egress policy.

Real parts over loopback: a media server on 127.0.0.2, in the one network the tests allow
(``allow_networks = ["127.0.0.2/31"]``; nothing listens on 127.0.0.3), so that the rest of
loopback stays what the policy refuses; a "victim" listener on 127.0.0.1, standing for
what a URL must not reach (it counts every request); the gateway in front of the
simulator. Names resolve through a resolver the tests inject (``media.test`` is
127.0.0.2, ``internal.test`` a private address); ``.test`` names resolve nowhere else, so
a second resolution by the client would fail the fetch.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import socket
import ssl
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, run, stack
from tests.support.adversarial_media import remote_cases
from tests.support.tls import make_pki
from tests.support.waiting import eventually

from saltgate.gateway.media import MediaFetcher, SystemResolver
from saltgate.http import HttpServer, Request, Response
from saltgate.http.tls import server_context
from saltgate.policy import egress
from saltgate.policy.egress import IPAddress, MediaSettings, MediaUrl
from saltgate.store.tenants import TenantStore

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
MEDIA_HOST = "127.0.0.2"
SECRET = "s3cret-signature"  # in URLs' queries: no answer may echo it
PNG = b"\x89PNG\r\n\x1a\n" + b"pixels of a cat " * 40


class MediaServer:
    """A loopback HTTP server of media that records every request. Paths: ``/slow...``
    answers once `release` is set; ``/bytes/N`` is N bytes; ``/stream/N`` N bytes in
    chunks, without Content-Length; `redirects` maps a path to a Location."""

    def __init__(self, host: str, scheme: str = "http") -> None:
        self.host = host
        self.scheme = scheme
        self.seen: list[Request] = []
        self.redirects: dict[bytes, str] = {}
        self.release = asyncio.Event()
        self.slow = 0  # slow requests waiting now
        self.server = HttpServer(self.handle)
        self.port = 0

    def url(self, path: str, host: str | None = None) -> str:
        return f"{self.scheme}://{host or self.host}:{self.port}{path}"

    async def handle(self, request: Request) -> Response:
        self.seen.append(request)
        path = request.path
        if path in self.redirects:
            return Response(302, [(b"location", self.redirects[path].encode())])
        if path.startswith(b"/slow"):
            self.slow += 1
            try:
                await self.release.wait()
            finally:
                self.slow -= 1
        png = [(b"content-type", b"image/png")]
        if path in FIXED:
            return FIXED[path]
        if path.startswith(b"/bytes/"):
            return Response(200, png, b"x" * int(path[7:].removesuffix(b".png")))
        if path.startswith(b"/stream/"):
            return Response(200, png, stream=_chunks(int(path[8:].removesuffix(b".png"))))
        return Response(200, png, self.image(path))

    def image(self, path: bytes) -> bytes:
        """The bytes the default route serves at ``path``."""
        return PNG + path


FIXED = {
    b"/page.html": Response(200, [(b"content-type", b"text/html")], b"<html></html>"),
    b"/missing.png": Response(404, [(b"content-type", b"text/plain")], b"no"),
    b"/gzip.png": Response(200, [(b"content-type", b"image/png"), (b"content-encoding", b"gzip")]),
}


async def _chunks(size: int) -> AsyncGenerator[bytes, None]:
    for _ in range(size // 100):
        yield b"y" * 100


@asynccontextmanager
async def serving(host: str, tls: ssl.SSLContext | None = None) -> AsyncIterator[MediaServer]:
    server = MediaServer(host, "http" if tls is None else "https")
    server.port = await server.server.start(host, 0, tls=tls)
    try:
        yield server
    finally:
        server.release.set()
        await server.server.close(grace=1.0)


ADDRESSES: dict[str, list[str]] = {
    "media.test": [MEDIA_HOST],
    "internal.test": ["10.0.0.7"],
    "split.test": [MEDIA_HOST, "10.0.0.7"],  # one allowed address is not enough
    "wrong.example": [MEDIA_HOST],
    "fallback.test": [
        "127.0.0.3",
        MEDIA_HOST,
    ],  # nothing listens on the first  # the name tests/support/tls.py's wrong_host is for
}


class Resolver:
    """The injected resolver: `ADDRESSES`, and every call counted."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> list[IPAddress]:
        self.calls.append(host)
        if host not in ADDRESSES:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in ADDRESSES[host]]


class Setup:
    def __init__(self, s: Stack, media: MediaServer, victim: MediaServer) -> None:
        self.s, self.media, self.victim = s, media, victim
        self.resolver = Resolver()
        fetcher = s.gateway.gateway.media
        assert isinstance(fetcher, MediaFetcher)
        self.fetcher = fetcher
        fetcher.resolve = self.resolver

    def tenant_id(self, name: str) -> str:
        with TenantStore.from_state_dir(self.s.state_dir) as store:
            return store.get_tenant(name).id


@asynccontextmanager
async def fetching(
    tmp: Path, *, tls: ssl.SSLContext | None = None, **settings: Any
) -> AsyncIterator[Setup]:
    """The gateway in fetch mode, the media server (over ``tls`` when given) and the
    victim."""
    async with serving(MEDIA_HOST, tls) as media, serving("127.0.0.1") as victim:
        table = {
            "remote": "fetch",
            "allow_networks": [f"{MEDIA_HOST}/31"],  # .2 and .3
            "ports": [80, media.port, victim.port],
            **settings,
        }
        async with stack(tmp, replicas=1, media=MediaSettings.from_table(table, tmp)) as s:
            yield Setup(s, media, victim)


def chat(*urls: str) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "describe"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 2}


def anthropic(url: str) -> dict[str, Any]:
    block = {"type": "image", "source": {"type": "url", "url": url}}
    content = [{"type": "text", "text": "describe"}, block]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def replica_parts(s: Stack) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = orjson.loads(s.forwarded()[-1].body)["messages"][0]["content"]
    return parts


def replica_image(s: Stack) -> dict[str, Any]:
    return next(p for p in replica_parts(s) if p.get("type") == "image_url")


# -- the default ----------------------------------------------------------------------------


def test_the_default_refuses_remote_media_and_fetches_nothing(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            serving(MEDIA_HOST) as media,
            stack(tmp_path, replicas=1) as s,
            s.client("alice") as alice,
        ):
            assert s.gateway.gateway.media is None
            resp = await alice.post(CHAT, json=chat(media.url("/cat.png")))
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["code"] == "remote_media_refused"
            assert media.seen == [] and s.forwarded() == []

    run(main)


# -- fetched ----------------------------------------------------------------------------


def test_fetched_media_reaches_the_replica_inline_with_the_namespace_s_uuid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with (
            fetching(tmp_path) as t,
            t.s.client("alice") as alice,
            t.s.client("bob") as bob,
        ):
            s, media = t.s, t.media
            # No proxy: the environment's would otherwise be the victim.
            for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
                monkeypatch.setenv(name, t.victim.url("/"))
            url = media.url(f"/cat.png?token={SECRET}", host="media.test")
            resp = await alice.post(CHAT, json=chat(url))
            assert resp.status_code == 200, resp.text
            raw = media.image(b"/cat.png")
            part = replica_image(s)
            assert part["image_url"] == {"url": data_url(raw)}
            assert part["uuid"].startswith("sg1m_")
            assert b"media.test" not in s.forwarded()[-1].body  # never the http URL
            # Asked once, by name, at the checked address: Host kept, nothing of the client's.
            assert t.resolver.calls == ["media.test"]
            [asked] = media.seen
            assert (asked.method, asked.query) == (b"GET", f"token={SECRET}".encode())
            assert asked.header(b"host") == f"media.test:{media.port}".encode()
            assert asked.header(b"authorization") is None
            assert s.keys["alice"].encode() not in b"".join(v for _, v in asked.headers)
            assert t.victim.seen == []
            fetched_uuid = part["uuid"]
            # The same bytes sent inline get the same uuid (one cache entry within the
            # tenant); another tenant fetching the same URL gets its own.
            inline = chat(data_url(raw))
            assert (await alice.post(CHAT, json=inline)).status_code == 200
            assert replica_image(s)["uuid"] == fetched_uuid
            assert (await bob.post(CHAT, json=chat(url))).status_code == 200
            assert replica_image(s)["image_url"] == {"url": data_url(raw)}
            assert replica_image(s)["uuid"] != fetched_uuid
            # Anthropic's url source becomes a base64 source.
            resp = await alice.post(MESSAGES, json=anthropic(url))
            assert resp.status_code == 200, resp.text
            block = replica_parts(s)[1]
            assert block["source"] == {
                "type": "base64",
                "media_type": "image/png",
                "data": base64.b64encode(raw).decode(),
            }
            # The Responses API's input_image is a URL string.
            image = {"type": "input_image", "image_url": url}
            item = {"role": "user", "content": [{"type": "input_text", "text": "hi"}, image]}
            body = {"model": MODEL, "input": [item], "max_output_tokens": 2}
            resp = await alice.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text
            sent = orjson.loads(s.forwarded()[-1].body)["input"][0]["content"][1]
            assert sent["image_url"] == data_url(raw) and sent["uuid"] == fetched_uuid
            assert t.victim.seen == []  # the proxy variables were never used
            monkeypatch.undo()  # the test's own scrape would use them
            assert 'saltgate_media_fetches_total{outcome="fetched"} 4.0' in await s.scrape()

    run(main)


@pytest.mark.parametrize("allowed", [False, True], ids=["loopback-refused", "loopback-allowed"])
def test_the_system_resolver_s_answers_are_checked(tmp_path: Path, allowed: bool) -> None:
    """``localhost`` through the system's resolver (127.0.0.1, and ::1 where /etc/hosts
    says so): refused as loopback; with loopback allowed, fetched from whichever of its
    addresses answers (the victim listens on 127.0.0.1 only)."""
    loopback: dict[str, Any] = {"allow_networks": ["127.0.0.0/8", "::1/128"]} if allowed else {}

    async def main() -> None:
        async with fetching(tmp_path, **loopback) as t, t.s.client("alice") as alice:
            resolver = t.fetcher.resolve = SystemResolver(2)
            try:
                url = t.victim.url("/cat.png", host="localhost")
                resp = await alice.post(CHAT, json=chat(url))
            finally:
                resolver.close()
            if allowed:
                assert resp.status_code == 200, resp.text
                [asked] = t.victim.seen
                assert asked.header(b"host") == f"localhost:{t.victim.port}".encode()
            else:
                assert resp.status_code == 400, resp.text
                assert "(loopback)" in resp.json()["error"]["message"]
                assert t.victim.seen == []

    run(main)


def test_an_address_that_does_not_answer_falls_through_to_the_next(tmp_path: Path) -> None:
    async def main() -> None:
        async with fetching(tmp_path) as t, t.s.client("alice") as alice:
            url = t.media.url("/cat.png", host="fallback.test")
            resp = await alice.post(CHAT, json=chat(url))
            assert resp.status_code == 200, resp.text
            assert t.resolver.calls == ["fallback.test"]  # resolved once, both tried
            assert len(t.media.seen) == 1

    run(main)


def test_the_same_url_twice_is_fetched_once(tmp_path: Path) -> None:
    async def main() -> None:
        async with fetching(tmp_path) as t, t.s.client("alice") as alice:
            url = t.media.url("/dog.png")
            resp = await alice.post(CHAT, json=chat(url, url))
            assert resp.status_code == 200, resp.text
            assert len(t.media.seen) == 1
            images = [p for p in replica_parts(t.s) if p.get("type") == "image_url"]
            assert [p["image_url"]["url"] for p in images] == [
                data_url(t.media.image(b"/dog.png"))
            ] * 2

    run(main)


def test_https_media_is_verified_for_the_url_s_host_at_the_checked_address(
    tmp_path: Path,
) -> None:
    """The media server (127.0.0.2) holds a certificate for wrong.example only: fetched
    by that name (resolved by the injected resolver), the TLS name and the Host are the
    name, not the address; by another name resolving to the same address, refused."""
    pki = make_pki(tmp_path / "pki")
    server_tls = server_context(pki.wrong_host.cert, pki.wrong_host.key)
    names: list[str | None] = []
    server_tls.sni_callback = lambda _sock, name, _ctx: names.append(name)

    async def main() -> None:
        async with (
            fetching(tmp_path, tls=server_tls, tls_ca_file=str(pki.ca)) as t,
            t.s.client("alice") as alice,
        ):
            url = t.media.url("/cat.png", host="wrong.example")
            resp = await alice.post(CHAT, json=chat(url))
            assert resp.status_code == 200, resp.text
            assert replica_image(t.s)["image_url"]["url"] == data_url(t.media.image(b"/cat.png"))
            assert names == ["wrong.example"]
            assert t.media.seen[0].header(b"host") == f"wrong.example:{t.media.port}".encode()
            resp = await alice.post(CHAT, json=chat(t.media.url("/cat.png", host="media.test")))
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["code"] == "media_fetch_failed"
            assert "certificate verify failed" in error["message"]
            assert len(t.media.seen) == 1  # no request went over the unverified connection

    run(main)


# -- refused --------------------------------------------------------------------------------


def refusals(media: MediaServer, victim: MediaServer) -> Iterator[tuple[str, list[str], str, str]]:
    """(name, the request's URLs, the error code, words of the message)."""
    media.redirects[b"/to-metadata"] = "http://169.254.169.254/latest/meta-data/"
    media.redirects[b"/to-victim"] = victim.url(f"/cat.png?token={SECRET}")
    media.redirects[b"/to-internal"] = media.url("/cat.png", host="internal.test")
    media.redirects[b"/loop"] = "/loop"
    refused, failed = "media_url_refused", "media_fetch_failed"
    yield "loopback", [victim.url(f"/x.png?token={SECRET}")], refused, "(loopback)"
    yield "metadata", ["http://169.254.169.254/latest/meta-data/"], refused, "(link-local)"
    yield "metadata, IPv4 in IPv6", ["http://[::ffff:169.254.169.254]/"], refused, "link-local"
    yield (
        "a name resolving to a private address",
        [media.url("/cat.png", host="internal.test")],
        refused,
        "(private)",
    )
    yield (
        "a name with one private address",
        [media.url("/cat.png", host="split.test")],
        refused,
        "(private)",
    )
    yield (
        "a name that does not resolve",
        [media.url("/cat.png", host="nowhere.test")],
        failed,
        "does not resolve",
    )
    yield "redirect to metadata", [media.url("/to-metadata")], refused, "(link-local)"
    yield "redirect to loopback", [media.url("/to-victim")], refused, "(loopback)"
    yield "redirect to a private name", [media.url("/to-internal")], refused, "(private)"
    yield "redirect loop", [media.url("/loop")], refused, "more than 2 times"
    yield "a port not allowed", ["http://media.test:1/x.png"], refused, "port 1 "
    yield "decimal IPv4", ["http://2130706433/"], refused, "dotted decimal"
    yield "credentials", [f"http://user:{SECRET}@media.test/"], refused, "credentials"
    yield "too large, declared", [media.url("/bytes/1001.png")], "media_too_large", "over 1000"
    yield "too large, streamed", [media.url("/stream/1100.png")], "media_too_large", "over 1000"
    yield (
        "too large together",
        [
            media.url("/bytes/800.png"),
            media.url("/bytes/801.png"),
        ],
        "media_too_large",
        "together",
    )
    yield (
        "too many",
        [media.url(f"/{i}.png") for i in range(3)],
        "too_many_remote_media",
        "at most 2",
    )
    yield "not an image", [media.url("/page.html")], refused, "text/html, not image"
    yield "an error answer", [media.url("/missing.png")], failed, "HTTP 404"
    yield "an encoded answer", [media.url("/gzip.png")], failed, "Content-Encoding"


SETTINGS: dict[str, Any] = {
    "max_item_bytes": 1000,
    "max_request_bytes": 1500,
    "max_items": 2,
    "max_redirects": 2,
}


def test_every_refusal_is_a_400_that_says_why_and_nothing_reaches_a_replica(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with fetching(tmp_path, **SETTINGS) as t, t.s.client("alice") as alice:
            cases = list(refusals(t.media, t.victim))
            for name, urls, code, words in cases:
                resp = await alice.post(CHAT, json=chat(*urls))
                assert resp.status_code == 400, (name, resp.text)
                error = resp.json()["error"]
                assert error["code"] == code, (name, error)
                assert words in error["message"], (name, error)
                assert error["param"].startswith("messages[0].content["), (name, error)
                assert f"'{error['param']}'" in error["message"]
                assert SECRET not in resp.text, name
            assert t.s.forwarded() == []
            assert t.victim.seen == []
            # The redirects were asked of the media server, their targets never fetched.
            assert not any(r.path.startswith((b"/0.png", b"/1.png")) for r in t.media.seen)
            # Anthropic's route answers in Anthropic's shape.
            resp = await alice.post(MESSAGES, json=anthropic(t.victim.url("/x.png")))
            assert resp.status_code == 400
            doc = resp.json()
            assert doc["type"] == "error" and "(loopback)" in doc["error"]["message"]
            assert t.s.forwarded() == [] and t.victim.seen == []
            # Counted by outcome, the Anthropic one with the rest.
            expected = Counter(code for _, _, code, _ in cases) + Counter(["media_url_refused"])
            scrape = await t.s.scrape()
            for code, count in expected.items():
                assert f'saltgate_media_fetches_total{{outcome="{code}"}} {count:.1f}' in scrape

    run(main)


def test_the_corpus_s_internal_urls_are_refused_in_fetch_mode_on_every_route(
    tmp_path: Path,
) -> None:
    """tests/support/adversarial_media.py's remote cases (metadata, loopback ports, a
    private https host, [::1], file:) in every route's shape, with the default egress
    policy: each a 400 before any replica, and nothing fetched."""

    async def main() -> None:
        settings = MediaSettings(remote="fetch")
        async with stack(tmp_path, replicas=1, media=settings) as s, s.client("bob") as bob:
            fetcher = s.gateway.gateway.media
            assert isinstance(fetcher, MediaFetcher)
            resolver = Resolver()
            fetcher.resolve = resolver
            for case in remote_cases():
                resp = await bob.post(case.route, json={"model": MODEL, **case.body})
                assert resp.status_code == 400, (case.name, resp.text)
                doc = resp.json()
                if case.route.startswith("/v1/messages"):
                    assert doc["type"] == "error", case.name
                else:
                    expected = "invalid_media_url" if "file:" in case.name else "media_url_refused"
                    assert doc["error"]["code"] == expected, (case.name, doc)
            assert s.forwarded() == [] and resolver.calls == []

    run(main)


def _follow_without_checks(
    current: MediaUrl, location: str | None, hops: int, settings: MediaSettings
) -> MediaUrl:
    """The redirect re-check switched off: any Location, anywhere (the positive control)."""
    anywhere = MediaSettings.from_table(
        {"allow_networks": ["0.0.0.0/1", "128.0.0.0/1"], "ports": list(range(1, 65536))}, Path()
    )
    return egress.parse_url(urljoin(current.url, location or "/"), anywhere)


@pytest.mark.parametrize("recheck", [True, False], ids=["rechecked", "control-unchecked"])
def test_a_redirect_to_loopback_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recheck: bool
) -> None:
    """An allowed host redirects to the loopback victim. The control follows redirects
    unchecked, and the victim's bytes reach the replica: what the re-check prevents."""

    async def main() -> None:
        async with fetching(tmp_path) as t, t.s.client("alice") as alice:
            if not recheck:
                monkeypatch.setattr(egress, "redirect", _follow_without_checks)
            t.media.redirects[b"/to-victim"] = t.victim.url("/secret.png")
            resp = await alice.post(CHAT, json=chat(t.media.url("/to-victim", host="media.test")))
            if recheck:
                assert resp.status_code == 400, resp.text
                assert "(loopback)" in resp.json()["error"]["message"]
                assert t.victim.seen == [] and t.s.forwarded() == []
            else:
                assert resp.status_code == 200, resp.text
                assert [r.path for r in t.victim.seen] == [b"/secret.png"]
                leaked = data_url(t.victim.image(b"/secret.png"))
                assert replica_image(t.s)["image_url"] == {"url": leaked}

    run(main)


def test_a_slow_server_times_out_within_the_deadline(tmp_path: Path) -> None:
    async def main() -> None:
        async with fetching(tmp_path, timeout_s=0.3) as t, t.s.client("alice") as alice:
            resp = await alice.post(CHAT, json=chat(t.media.url("/slow.png")))
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["code"] == "media_fetch_timeout"
            assert "longer than 0.3 s" in error["message"]
            assert [r.path for r in t.media.seen] == [b"/slow.png"]  # asked, then given up
            assert t.s.forwarded() == []

    run(main)


# -- concurrency ----------------------------------------------------------------------------


def test_one_tenant_s_slow_fetches_do_not_hold_another_tenant_s(tmp_path: Path) -> None:
    """Alice's three slow fetches: two run (her slots), the third waits for one of hers;
    Bob's fetch runs and answers meanwhile."""

    async def main() -> None:
        async with (
            fetching(tmp_path, per_tenant_concurrency=2, max_concurrency=8, timeout_s=60) as t,
            t.s.client("alice") as alice,
            t.s.client("bob") as bob,
        ):
            slots, media = t.fetcher.slots, t.media
            alice_id = t.tenant_id("alice")
            slow = [
                asyncio.create_task(alice.post(CHAT, json=chat(media.url(f"/slow/{i}.png"))))
                for i in range(3)
            ]
            await eventually(lambda: media.slow == 2, what="two of alice's fetches running")
            await eventually(lambda: slots.users(alice_id) == 3, what="the third waiting")
            resp = await bob.post(CHAT, json=chat(media.url("/bob.png")))
            assert resp.status_code == 200, resp.text
            assert replica_image(t.s)["image_url"]["url"] == data_url(media.image(b"/bob.png"))
            assert not any(task.done() for task in slow)
            assert media.slow == 2 and slots.users(alice_id) == 3  # her third still waits
            media.release.set()
            answers = await asyncio.gather(*slow)
            assert [a.status_code for a in answers] == [200] * 3
            assert slots.users(alice_id) == 0  # the tenant's slots are forgotten

    run(main)


def test_the_global_cap_bounds_all_tenants_together(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            fetching(tmp_path, per_tenant_concurrency=2, max_concurrency=2, timeout_s=60) as t,
            t.s.client("alice") as alice,
            t.s.client("bob") as bob,
        ):
            media, bob_id = t.media, t.tenant_id("bob")
            slow = [
                asyncio.create_task(alice.post(CHAT, json=chat(media.url(f"/slow/{i}.png"))))
                for i in range(2)
            ]
            await eventually(lambda: media.slow == 2, what="alice's fetches running")
            waiting = asyncio.create_task(bob.post(CHAT, json=chat(media.url("/bob.png"))))
            await eventually(lambda: t.fetcher.slots.users(bob_id) == 1, what="bob waiting")
            assert not waiting.done()
            assert not any(r.path == b"/bob.png" for r in media.seen)
            media.release.set()
            answers: list[httpx.Response] = await asyncio.gather(*slow, waiting)
            assert [a.status_code for a in answers] == [200] * 3

    run(main)
