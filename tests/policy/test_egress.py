"""The media egress policy (policy/egress.py): URLs, hosts, addresses, redirects, answers."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import orjson
import pytest

from saltgate.policy import egress
from saltgate.policy.content import RemoteMedia
from saltgate.policy.egress import MediaRefused, MediaSettings, parse_url
from saltgate.policy.errors import AnthropicApiError, ApiError

pytestmark = pytest.mark.unit

OPEN = MediaSettings(remote="fetch")
CHAT = "/v1/chat/completions"


def refused(url: str, settings: MediaSettings = OPEN) -> str:
    with pytest.raises(MediaRefused) as caught:
        parse_url(url, settings)
    return caught.value.reason


# -- URLs ---------------------------------------------------------------------------------


def test_a_plain_https_url_is_taken_apart() -> None:
    url = parse_url("HTTPS://Media.Example.COM./a/b.png?x=1#frag", OPEN)
    assert tuple(url) == ("https", "media.example.com", 443, "/a/b.png?x=1", None)
    assert url.authority == "media.example.com"
    assert url.url == "https://media.example.com/a/b.png?x=1"
    assert parse_url("http://example.com", OPEN).target == "/"


def test_a_port_other_than_the_allowed_ones_is_refused_and_named() -> None:
    assert "port 8080" in refused("http://example.com:8080/x.png")
    assert "port 443" in refused("http://example.com:443/x.png", MediaSettings(ports=(80,)))
    url = parse_url("http://example.com:8080/x.png", MediaSettings(ports=(8080,)))
    assert url.authority == "example.com:8080"  # not the scheme's default: Host names it


@pytest.mark.parametrize(
    "url",
    ["file:///etc/passwd", "ftp://example.com/x", "gopher://example.com/", "data:,x", "//x.com/"],
)
def test_schemes_other_than_http_and_https_are_refused(url: str) -> None:
    assert "http:// or https://" in refused(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://user@example.com/x.png",
        "http://user:pw@example.com/x.png",
        "http://:@example.com/x.png",
        "http://example.com@169.254.169.254/x.png",
        "http://169.254.169.254@example.com/x.png",
    ],
)
def test_userinfo_is_refused(url: str) -> None:
    assert "credentials" in refused(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com\\@127.0.0.1/",  # the backslash differential (CVE-2026-24779)
        "http://exa mple.com/",
        "http://example.com/\x00",
        "http://example.com\t/",
        "http://ex\u00e4mple.com/",
    ],
)
def test_characters_parsers_disagree_on_are_refused(url: str) -> None:
    assert "percent-encode" in refused(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://2130706433/",  # decimal 127.0.0.1
        "http://0x7f000001/",  # hexadecimal
        "http://0177.0.0.1/",  # octal
        "http://127.1/",  # short form
        "http://0x7f.0.0.1/",
        "http://169.254.43518/",  # 169.254.169.254 with a 16-bit tail
        "http://example.0x10/",
    ],
)
def test_ipv4_spellings_a_resolver_reads_as_addresses_are_refused(url: str) -> None:
    assert "dotted decimal" in refused(url)


@pytest.mark.parametrize(
    "url",
    ["http:///x.png", "http://[::1/", "http://[fe80::1%25eth0]/", "http://[v1.x]/", "http://a..b/"],
)
def test_a_url_without_a_usable_host_is_refused(url: str) -> None:
    refused(url)


def test_a_port_that_is_not_a_number_is_refused() -> None:
    assert "cannot be parsed" in refused("http://example.com:99999/")
    assert "cannot be parsed" in refused("http://example.com:x/")


def test_an_overlong_url_is_refused() -> None:
    assert "longer than" in refused("http://example.com/" + "a" * egress.MAX_URL_CHARS)


# -- the allow-list -----------------------------------------------------------------------


def test_the_allow_list_takes_names_and_their_subdomains() -> None:
    settings = MediaSettings.from_table(
        {"hosts": ["cdn.example.com", "*.images.example.org", "93.184.215.14"]}, Path()
    )
    assert parse_url("https://cdn.example.com/x", settings).host == "cdn.example.com"
    assert parse_url("https://a.b.images.example.org/x", settings)
    assert parse_url("https://93.184.215.14/x", settings)
    for url in (
        "https://images.example.org/x",  # *. is the subdomains, not the name itself
        "https://evilcdn.example.com/x",
        "https://cdn.example.com.evil.net/x",
        "https://xcdn.example.com/x",
        "https://eviLimages.example.org/x",
    ):
        assert "allow-list" in refused(url, settings), url


def test_no_allow_list_allows_any_public_host() -> None:
    assert parse_url("https://anything.example/x", OPEN).host == "anything.example"


# -- addresses ----------------------------------------------------------------------------

NON_PUBLIC = {
    "127.0.0.1": "loopback",
    "127.255.0.9": "loopback",
    "10.1.2.3": "private",
    "172.16.0.1": "private",
    "192.168.1.1": "private",
    "169.254.169.254": "link-local",  # the cloud metadata service
    "169.254.0.1": "link-local",
    "100.64.0.1": "shared (CGNAT)",
    "100.127.255.254": "shared (CGNAT)",
    "0.0.0.0": "unspecified",
    "0.1.2.3": "unspecified",
    "224.0.0.1": "multicast or broadcast",
    "239.255.255.250": "multicast or broadcast",
    "255.255.255.255": "multicast or broadcast",
    "240.0.0.1": "private",  # reserved, which Python counts as private
    "192.0.2.1": "private",  # documentation
    "198.18.0.1": "private",  # benchmarking
    "::1": "loopback",
    "::": "unspecified",
    "fe80::1": "link-local",
    "fc00::1": "private",  # unique-local
    "fd00:ec2::254": "private",  # AWS's IPv6 metadata address
    "fec0::1": "site-local",
    "ff02::1": "multicast or broadcast",
    "2001:db8::1": "private",
    "::7f00:1": "reserved",  # IPv4-compatible, deprecated
    "::ffff:127.0.0.1": "loopback (IPv4 inside IPv6)",
    "::ffff:169.254.169.254": "link-local (IPv4 inside IPv6)",
    "::ffff:10.0.0.1": "private (IPv4 inside IPv6)",
    "64:ff9b::a9fe:a9fe": "link-local (IPv4 inside IPv6)",  # NAT64 of 169.254.169.254
    "2002:7f00:1::": "loopback (IPv4 inside IPv6)",  # 6to4 of 127.0.0.1
}


@pytest.mark.parametrize(("address", "kind"), sorted(NON_PUBLIC.items()))
def test_every_non_public_address_class_is_named(address: str, kind: str) -> None:
    assert egress.address_class(ipaddress.ip_address(address)) == kind


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "93.184.215.14", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]
)
def test_public_addresses_pass(address: str) -> None:
    assert egress.address_class(ipaddress.ip_address(address)) is None
    egress.check_address(ipaddress.ip_address(address), OPEN)


@pytest.mark.parametrize("address", sorted(NON_PUBLIC))
def test_an_ip_literal_host_that_is_not_public_is_refused(address: str) -> None:
    host = f"[{address}]" if ":" in address else address
    assert "non-public address" in refused(f"http://{host}/x.png")


def test_allow_networks_lets_a_private_network_through_and_only_it() -> None:
    settings = MediaSettings.from_table({"allow_networks": ["10.1.0.0/16", "::1/128"]}, Path())
    assert parse_url("http://10.1.2.3/x", settings).literal == ipaddress.ip_address("10.1.2.3")
    assert parse_url("http://[::ffff:10.1.2.3]/x", settings)  # the same address, mapped
    assert parse_url("http://[::1]/x", settings).authority == "[::1]"
    assert "private" in refused("http://10.2.0.1/x", settings)
    assert "loopback" in refused("http://127.0.0.1/x", settings)
    assert "link-local" in refused("http://169.254.169.254/x", settings)


def test_unspecified_multicast_and_broadcast_are_refused_even_when_allowed() -> None:
    settings = MediaSettings.from_table({"allow_networks": ["0.0.0.0/0", "::/0"]}, Path())
    assert parse_url("http://127.0.0.1/x", settings)  # everything else is now allowed
    for host in ("0.0.0.0", "224.0.0.1", "255.255.255.255", "[::]", "[ff02::1]"):
        assert "non-public" in refused(f"http://{host}/x", settings), host


def test_every_resolved_address_must_pass() -> None:
    public, private = ipaddress.ip_address("8.8.8.8"), ipaddress.ip_address("10.0.0.1")
    egress.check_addresses([public], OPEN)
    with pytest.raises(MediaRefused, match="private"):
        egress.check_addresses([public, private], OPEN)
    with pytest.raises(MediaRefused, match="does not resolve"):
        egress.check_addresses([], OPEN)


# -- redirects ----------------------------------------------------------------------------

START = parse_url("https://media.example.com/a/b.png", OPEN)


def test_a_redirect_is_resolved_against_the_current_url_and_checked_anew() -> None:
    assert egress.redirect(START, "c.png", 0, OPEN).url == "https://media.example.com/a/c.png"
    assert egress.redirect(START, "//other.example/x", 0, OPEN).host == "other.example"
    with pytest.raises(MediaRefused, match="link-local"):
        egress.redirect(START, "http://169.254.169.254/latest/meta-data/", 0, OPEN)
    with pytest.raises(MediaRefused, match="dotted decimal"):
        egress.redirect(START, "https://2130706433/", 0, OPEN)
    with pytest.raises(MediaRefused, match="credentials"):
        egress.redirect(START, "https://u@example.org/", 0, OPEN)
    listed = MediaSettings(hosts=("media.example.com",))
    with pytest.raises(MediaRefused, match="allow-list"):
        egress.redirect(START, "https://elsewhere.example/", 0, listed)


def test_redirects_are_counted_and_capped() -> None:
    settings = MediaSettings(max_redirects=2)
    egress.redirect(START, "/x", 1, settings)
    with pytest.raises(MediaRefused, match="more than 2 times"):
        egress.redirect(START, "/x", 2, settings)
    with pytest.raises(MediaRefused, match="more than 0 times"):
        egress.redirect(START, "/x", 0, MediaSettings(max_redirects=0))


def test_a_redirect_from_https_to_http_or_without_location_is_refused() -> None:
    with pytest.raises(MediaRefused, match="https to http"):
        egress.redirect(START, "http://media.example.com/b.png", 0, OPEN)
    with pytest.raises(MediaRefused, match="without a Location") as caught:
        egress.redirect(START, None, 0, OPEN)
    assert caught.value.code == "media_fetch_failed"
    with pytest.raises(MediaRefused, match="invalid URL"):
        egress.redirect(START, "/a\\b", 0, OPEN)


# -- answers ------------------------------------------------------------------------------


def test_content_types_must_match_the_modality_and_the_list() -> None:
    assert egress.media_type("Image/PNG; charset=binary", "image", OPEN) == "image/png"
    assert egress.media_type("audio/wav", "audio", OPEN) == "audio/wav"
    for header, modality, why in (
        ("text/html", "image", "not image"),
        ("image/png", "audio", "not audio"),
        ("image/svg+xml", "image", "not accepted"),
        (None, "image", "no Content-Type"),
        ("", "video", "no Content-Type"),
    ):
        with pytest.raises(MediaRefused, match=why):
            egress.media_type(header, modality, OPEN)
    wildcard = MediaSettings.from_table({"content_types": ["image/*"]}, Path())
    assert egress.media_type("image/svg+xml", "image", wildcard) == "image/svg+xml"
    with pytest.raises(MediaRefused, match="not accepted"):
        egress.media_type("video/mp4", "video", wildcard)


def test_sizes_statuses_and_encodings() -> None:
    egress.check_declared_size("100", 100)
    egress.check_declared_size(None, 100)
    egress.check_declared_size("garbage", 100)  # the streamed count still applies
    with pytest.raises(MediaRefused, match="over 100 bytes") as caught:
        egress.check_declared_size("101", 100)
    assert (caught.value.status, caught.value.code) == (400, "media_too_large")
    egress.check_status(200)
    for status in (204, 206, 304, 403, 404, 500):
        with pytest.raises(MediaRefused, match=f"HTTP {status}"):
            egress.check_status(status)
    egress.check_encoding(None)
    egress.check_encoding("identity")
    with pytest.raises(MediaRefused, match="encoded"):
        egress.check_encoding("gzip")


def test_media_becomes_a_data_url() -> None:
    assert egress.Media("image/png", b"\x89PNG").data_url == "data:image/png;base64,iVBORw=="


# -- settings -----------------------------------------------------------------------------


def test_the_default_refuses_remote_media() -> None:
    settings = MediaSettings.from_table({}, Path())
    assert settings == MediaSettings()
    assert not settings.fetch
    assert settings.allow_networks == ()
    assert settings.ports == (80, 443)


def test_a_full_table_is_read(tmp_path: Path) -> None:
    settings = MediaSettings.from_table(
        {
            "remote": "fetch",
            "hosts": ["CDN.example.com."],
            "ports": [443],
            "allow_networks": ["10.0.0.0/8"],
            "max_item_bytes": 1000,
            "max_request_bytes": 5000,
            "timeout_s": 2,
            "max_redirects": 0,
            "per_tenant_concurrency": 1,
            "max_concurrency": 8,
            "content_types": ["image/PNG"],
            "tls_ca_file": "ca.pem",
        },
        tmp_path,
    )
    assert settings.fetch
    assert settings.hosts == ("cdn.example.com",)
    assert settings.allow_networks == (ipaddress.ip_network("10.0.0.0/8"),)
    assert settings.timeout_s == 2.0
    assert settings.content_types == ("image/png",)
    assert settings.tls_ca_file == tmp_path / "ca.pem"


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"remote": "proxy"}, "remote: expected one of refuse, fetch"),
        ({"remote": True}, "remote: expected"),
        ({"hosts": "example.com"}, "hosts: expected a list"),
        ({"hosts": ["exa mple.com"]}, "hosts: 'exa mple.com' is not"),
        ({"hosts": ["*.10.0.0.1"]}, "hosts: '*.10.0.0.1': a wildcard goes with a name"),
        ({"ports": []}, "ports: expected a non-empty list"),
        ({"ports": [0]}, "ports: every entry"),
        ({"ports": [True]}, "ports: every entry"),
        ({"allow_networks": ["10.0.0.1/8"]}, "allow_networks: 10.0.0.1/8 has host bits set"),
        ({"max_item_bytes": 0}, "max_item_bytes: expected an integer, 1 or more"),
        ({"max_item_bytes": 1.5}, "max_item_bytes: expected an integer"),
        ({"max_redirects": 11}, "max_redirects: expected an integer, 0 to 10"),
        ({"timeout_s": 0}, "timeout_s: expected seconds"),
        ({"timeout_s": "5"}, "timeout_s: expected seconds"),
        ({"content_types": ["text/html"]}, "content_types: 'text/html'"),
        ({"content_types": ["image"]}, "content_types: 'image'"),
        (
            {"per_tenant_concurrency": 9, "max_concurrency": 8},
            "per_tenant_concurrency: must not be more than max_concurrency",
        ),
        (
            {"max_item_bytes": 9, "max_request_bytes": 8},
            "max_item_bytes: must not be more than max_request_bytes",
        ),
        ({"tls_ca_file": ""}, "tls_ca_file: expected a file name"),
        ({"allow_private": True}, "allow_private: unknown key; expected some of"),
    ],
)
def test_table_mistakes_are_named(table: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        MediaSettings.from_table(table, Path())


# -- a request ----------------------------------------------------------------------------


def remote(param: str, url: str, modality: str = "image") -> RemoteMedia:
    return RemoteMedia(param, url, modality)


def test_each_url_is_fetched_once_and_the_count_is_capped() -> None:
    settings = MediaSettings(max_items=2)
    a, b = "https://a.example/x.png", "https://b.example/y.png"
    items = [remote("p0", a), remote("p1", b), remote("p2", a)]
    assert egress.fetch_list(CHAT, items, settings) == items[:2]
    with pytest.raises(ApiError) as caught:
        egress.fetch_list(CHAT, [*items, remote("p3", "https://c.example/")], settings)
    error = caught.value
    assert (error.status, error.code, error.param) == (400, "too_many_remote_media", "p3")
    assert "at most 2 remote media URLs" in error.message


def test_one_url_as_two_modalities_is_refused() -> None:
    url = "https://a.example/x"
    with pytest.raises(ApiError, match="the same URL is p0, as image") as caught:
        egress.fetch_list(CHAT, [remote("p0", url), remote("p1", url, "audio")], OPEN)
    assert caught.value.param == "p1"


def test_a_refusal_names_the_part_and_the_reason_in_the_route_s_shape() -> None:
    why = MediaRefused("the media is over 5 bytes", egress.TOO_LARGE)
    openai = egress.refusal(CHAT, "messages[0].content[1].image_url", why)
    assert type(openai) is ApiError
    assert openai.to_dict()["error"]["code"] == "media_too_large"
    assert openai.message.startswith(
        "Invalid 'messages[0].content[1].image_url': the media is over 5 bytes."
    )
    anthropic = egress.refusal("/v1/messages", "messages[0].content[1].source", why)
    assert isinstance(anthropic, AnthropicApiError)
    assert orjson.loads(anthropic.body())["type"] == "error"


def test_the_request_s_bytes_are_capped_together() -> None:
    egress.check_request_size(10, 10)
    with pytest.raises(MediaRefused, match="over 10 bytes together") as caught:
        egress.check_request_size(11, 10)
    assert caught.value.code == "media_too_large"


def test_max_items_is_read_and_bounded_by_the_request_s_media_cap() -> None:
    assert MediaSettings.from_table({"max_items": 32}, Path()).max_items == 32
    with pytest.raises(ValueError, match=r"^max_items: expected an integer, 1 to 32"):
        MediaSettings.from_table({"max_items": 33}, Path())
