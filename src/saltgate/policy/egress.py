"""The egress policy for media the gateway fetches itself (pure; docs/multimodal.md).

vLLM fetches an ``http(s)`` media URL from the replica's network, from any host, with
redirects followed (CVE-2025-6242 class; docs/multimodal.md). With ``[media]
remote = "fetch"`` the gateway fetches it instead, under this policy, and inlines the bytes
as a ``data:`` URL (gateway/media.py is the shell: sockets, time, concurrency). Every
decision is here, without a socket:

- a URL is ``http`` or ``https``, without userinfo, on an allowed port, with a host that is
  a DNS name or a canonical IP literal: the other IPv4 spellings (``2130706433``,
  ``0x7f.1``, ``0177.0.0.1``), which resolvers still read as addresses, are refused;
- the host is on the allow-list (``example.com``, or ``*.example.com`` for its subdomains)
  when there is one;
- every address the host resolves to (or its literal) is public: loopback, private,
  link-local (``169.254.169.254``), CGNAT, multicast, reserved, unspecified, unique- and
  site-local, and IPv6 forms embedding one of those (IPv4-mapped, NAT64, 6to4) are refused
  unless in ``allow_networks``; unspecified, multicast and broadcast always;
- a redirect's ``Location`` is a new URL checked from the start, never https to http, and
  at most ``max_redirects`` of them;
- the answer is 200, of an allowed content type of the part's modality, within the sizes;
- a request fetches each distinct URL once, at most ``max_items`` of them (`fetch_list`);
  a refusal is a 400 naming the part, never the URL (`refusal`).
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple
from urllib.parse import urljoin, urlsplit

from saltgate.policy.content import ANTHROPIC_CONTENT_ROUTES, MAX_MEDIA_ITEMS, RemoteMedia
from saltgate.policy.errors import AnthropicApiError, ApiError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

REMOTE_MODES: Final = ("refuse", "fetch")
SCHEMES: Final[Mapping[str, int]] = {"http": 80, "https": 443}
MODALITIES: Final = ("image", "audio", "video")
# What vLLM's media loaders decode (PIL for images; librosa/soundfile for audio; PyAV or
# OpenCV for video). Not SVG or other formats that are programs or documents.
DEFAULT_CONTENT_TYPES: Final = (
    "image/png",
    "image/jpeg",
    "image/webp",
    "image/gif",
    "audio/wav",
    "audio/x-wav",
    "audio/wave",
    "audio/mpeg",
    "audio/ogg",
    "audio/flac",
    "audio/webm",
    "audio/mp4",
    "video/mp4",
    "video/webm",
    "video/quicktime",
)
REDIRECT_STATUSES: Final = frozenset({301, 302, 303, 307, 308})
MAX_URL_CHARS: Final = 8192
MIB: Final = 1024 * 1024

# Status and code of each kind of refusal (the shell names the parameter). All 400: the
# request names media this gateway will not take, and a client retrying a 5xx (the OpenAI
# SDKs do) would only make it fetch again; the code tells the kinds apart.
REFUSED: Final = (400, "media_url_refused")
FAILED: Final = (400, "media_fetch_failed")
TOO_LARGE: Final = (400, "media_too_large")
TIMED_OUT: Final = (400, "media_fetch_timeout")
TOO_MANY: Final = (400, "too_many_remote_media")

_LABEL: Final = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")
# WHATWG URL: a host whose last label is a number is an IPv4 address in some spelling.
_NUMERIC_LABEL: Final = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)\Z")
_CGNAT: Final = ipaddress.IPv4Network("100.64.0.0/10")
_THIS_NETWORK: Final = ipaddress.IPv4Network("0.0.0.0/8")
_NAT64: Final = ipaddress.IPv6Network("64:ff9b::/96")
_BROADCAST: Final = ipaddress.IPv4Address("255.255.255.255")


class MediaRefused(Exception):
    """The policy (or the fetch under it) refuses a media URL: why, in words the client
    can act on, with the status and error code to answer. Names no resolved address."""

    def __init__(self, reason: str, kind: tuple[int, str] = REFUSED) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status, self.code = kind


@dataclass(frozen=True, slots=True)
class MediaSettings:
    """[media]: refuse remote media (the default) or fetch it under this policy."""

    remote: str = "refuse"
    hosts: tuple[str, ...] = ()  # allowed hosts ("a.com", "*.a.com"); empty: any public host
    ports: tuple[int, ...] = (80, 443)
    allow_networks: tuple[IPNetwork, ...] = ()  # non-public networks a fetch may reach
    max_item_bytes: int = 20 * MIB
    max_request_bytes: int = 64 * MIB
    timeout_s: float = 10.0  # per request, all its items: slots, resolving, redirects, bodies
    max_redirects: int = 3
    max_items: int = 8  # remote media URLs one request may have fetched (distinct URLs)
    per_tenant_concurrency: int = 4
    max_concurrency: int = 64  # all tenants together, per gateway process
    content_types: tuple[str, ...] = DEFAULT_CONTENT_TYPES  # "type/subtype" or "type/*"
    tls_ca_file: Path | None = None  # https: the CAs to trust; None: the system's store

    @property
    def fetch(self) -> bool:
        return self.remote == "fetch"

    @classmethod
    def from_table(cls, table: Mapping[str, Any], base: Path) -> MediaSettings:
        """The settings of a [media] table (a relative tls_ca_file starts at ``base``);
        ValueError("key: what is expected")."""
        unknown = sorted(set(table) - set(_PARSERS))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown key; expected some of {sorted(_PARSERS)}")
        out: dict[str, Any] = {key: _PARSERS[key](table[key]) for key in table}
        if "tls_ca_file" in out:
            out["tls_ca_file"] = base / out["tls_ca_file"]
        settings = cls(**out)
        if settings.per_tenant_concurrency > settings.max_concurrency:
            raise ValueError("per_tenant_concurrency: must not be more than max_concurrency")
        if settings.max_item_bytes > settings.max_request_bytes:
            raise ValueError("max_item_bytes: must not be more than max_request_bytes")
        return settings


def _remote(value: object) -> str:
    if value not in REMOTE_MODES:
        raise ValueError(f"remote: expected one of {', '.join(REMOTE_MODES)}")
    return str(value)


def _hosts(value: object) -> tuple[str, ...]:
    return tuple(_host_pattern(p) for p in _strings(value, "hosts"))


def _ports(value: object) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise ValueError("ports: expected a non-empty list of port numbers")
    if not all(_integer(p) and 1 <= p <= 65535 for p in value):
        raise ValueError("ports: every entry must be a port number, 1 to 65535")
    return tuple(value)


def _networks(value: object) -> tuple[IPNetwork, ...]:
    try:
        return tuple(ipaddress.ip_network(n) for n in _strings(value, "allow_networks"))
    except ValueError as exc:
        raise ValueError(f"allow_networks: {exc} (expected CIDRs, e.g. 10.0.0.0/8)") from None


def _count(key: str, low: int = 1, high: int | None = None) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < low or value > top:
            upto = f" to {high}" if high is not None else " or more"
            raise ValueError(f"{key}: expected an integer, {low}{upto}")
        return value

    top = high if high is not None else 2**63

    return parse


def _timeout(value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 600:
        raise ValueError("timeout_s: expected seconds, more than 0 and at most 600")
    return float(value)


def _content_types(value: object) -> tuple[str, ...]:
    return tuple(_content_type(t) for t in _strings(value, "content_types"))


def _file(value: object) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError("tls_ca_file: expected a file name")
    return Path(value)


_PARSERS: Final[Mapping[str, Callable[[object], object]]] = {
    "remote": _remote,
    "hosts": _hosts,
    "ports": _ports,
    "allow_networks": _networks,
    "max_item_bytes": _count("max_item_bytes"),
    "max_request_bytes": _count("max_request_bytes"),
    "timeout_s": _timeout,
    "max_redirects": _count("max_redirects", 0, 10),
    "max_items": _count("max_items", 1, MAX_MEDIA_ITEMS),
    "per_tenant_concurrency": _count("per_tenant_concurrency"),
    "max_concurrency": _count("max_concurrency"),
    "content_types": _content_types,
    "tls_ca_file": _file,
}


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value: object, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{key}: expected a list of non-empty strings")
    return value


def _host_pattern(pattern: str) -> str:
    """A host on the allow-list: a DNS name, ``*.`` and a DNS name, or an IP literal."""
    lower = pattern.lower().rstrip(".")
    name = lower.removeprefix("*.")
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        if not _valid_name(name):
            raise ValueError(
                f"hosts: {pattern!r} is not a host name, *.name, or IP address"
            ) from None
        return lower
    if name != lower:
        raise ValueError(f"hosts: {pattern!r}: a wildcard goes with a name, not an address")
    return str(ipaddress.ip_address(name.strip("[]")))


def _content_type(value: str) -> str:
    lower = value.lower()
    top, sep, sub = lower.partition("/")
    if top not in MODALITIES or not sep or not sub or ";" in sub or " " in sub:
        raise ValueError(
            f"content_types: {value!r}: expected image/..., audio/... or video/... (or type/*)"
        )
    return lower


def _valid_name(name: str) -> bool:
    labels = name.split(".")
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in labels)


# -- URLs ---------------------------------------------------------------------------------


class MediaUrl(NamedTuple):
    """A media URL the policy accepted, in the parts a fetch uses: connect to the checked
    address of ``host`` on ``port``, send ``target`` with ``authority`` as Host (and
    ``host`` as the TLS name)."""

    scheme: str
    host: str  # lower case, no trailing dot; an IPv6 literal without brackets
    port: int
    target: str  # path and query, "/" at least; never a fragment
    literal: IPAddress | None  # the address, when the host is an IP literal

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == SCHEMES[self.scheme] else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.target}"


def parse_url(url: str, settings: MediaSettings) -> MediaUrl:
    """``url`` as a fetch may use it, or MediaRefused saying which rule it breaks."""
    if len(url) > MAX_URL_CHARS:
        raise MediaRefused(f"the media URL is longer than {MAX_URL_CHARS} characters")
    if not url.isascii() or not url.isprintable() or " " in url or "\\" in url:
        raise MediaRefused(
            "the media URL has spaces, backslashes, control or non-ASCII characters "
            "(percent-encode them; a non-ASCII host in its xn-- form)"
        )
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise MediaRefused("the media URL cannot be parsed (host or port)") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise MediaRefused("a media URL must be http:// or https://")
    if "@" in parts.netloc:
        raise MediaRefused("a media URL must not carry credentials (user@host)")
    host, literal = _host(parts.netloc, parts.hostname)
    port = port if port is not None else SCHEMES[scheme]
    if port not in settings.ports:
        raise MediaRefused(f"port {port} is not allowed for media URLs")
    if settings.hosts and not host_allowed(host, settings.hosts):
        raise MediaRefused(f"the host {host} is not on this gateway's media allow-list")
    if literal is not None:
        check_address(literal, settings)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return MediaUrl(scheme, host, port, target, literal)


def _host(netloc: str, hostname: str | None) -> tuple[str, IPAddress | None]:
    if not hostname or "%" in hostname:
        raise MediaRefused("a media URL needs a host (a DNS name or an IP address)")
    if netloc.startswith("["):
        try:
            return hostname, ipaddress.IPv6Address(hostname)
        except ValueError:
            raise MediaRefused("the media URL's [address] is not an IPv6 address") from None
    host = hostname.rstrip(".") if hostname.endswith(".") and len(hostname) > 1 else hostname
    try:
        return host, ipaddress.IPv4Address(host)
    except ValueError:
        pass
    if not _valid_name(host):
        raise MediaRefused("the media URL's host is not a valid host name")
    if _NUMERIC_LABEL.match(host.rsplit(".", 1)[-1]):
        raise MediaRefused(
            "the media URL's host is a number: write an IPv4 address in dotted decimal "
            "(1.2.3.4), not in another spelling"
        )
    return host, None


def host_allowed(host: str, patterns: Iterable[str]) -> bool:
    """Whether ``host`` is on the allow-list: equal to an entry, or under a ``*.`` one."""
    for pattern in patterns:
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]):
                return True
        elif host == pattern:
            return True
    return False


# -- addresses ----------------------------------------------------------------------------


def address_class(address: IPAddress) -> str | None:
    """Why ``address`` is not public (a class name), or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            inner = address_class(embedded)
            return None if inner is None else f"{inner} (IPv4 inside IPv6)"
    for name, test in _CLASSES:
        if test(address):
            return name
    return None


# In this order: the first that holds names the class.
_CLASSES: Final[tuple[tuple[str, Callable[[IPAddress], bool]], ...]] = (
    ("unspecified", lambda a: a.is_unspecified or a in _THIS_NETWORK),
    ("loopback", lambda a: a.is_loopback),
    ("link-local", lambda a: a.is_link_local),
    ("multicast or broadcast", lambda a: a.is_multicast or a == _BROADCAST),
    ("shared (CGNAT)", lambda a: a in _CGNAT),
    ("site-local", lambda a: isinstance(a, ipaddress.IPv6Address) and a.is_site_local),
    ("private", lambda a: a.is_private),
    ("reserved", lambda a: a.is_reserved or not a.is_global),
)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries: IPv4-mapped, NAT64, 6to4."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


_NEVER: Final = ("unspecified", "multicast or broadcast")


def check_address(address: IPAddress, settings: MediaSettings) -> None:
    """Refuse an address that is not public, unless in ``allow_networks`` (never the
    unspecified, multicast and broadcast ones: no media server is there)."""
    kind = address_class(address)
    if kind is None:
        return
    if not kind.startswith(_NEVER):
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        for candidate in (address, mapped):
            if candidate is not None and any(
                candidate.version == net.version and candidate in net
                for net in settings.allow_networks
            ):
                return
    raise MediaRefused(f"the media host resolves to a non-public address ({kind})")


def check_addresses(addresses: Iterable[IPAddress], settings: MediaSettings) -> None:
    """Every address a name resolved to must pass (the first refused one says why)."""
    found = False
    for address in addresses:
        check_address(address, settings)
        found = True
    if not found:
        raise MediaRefused("the media host does not resolve", FAILED)


# -- answers ------------------------------------------------------------------------------


def redirect(
    current: MediaUrl, location: str | None, hops: int, settings: MediaSettings
) -> MediaUrl:
    """The URL a redirect leads to, checked as a new URL; ``hops`` redirects were
    followed before this one."""
    if hops >= settings.max_redirects:
        raise MediaRefused(f"the media URL redirects more than {settings.max_redirects} times")
    if not location:
        raise MediaRefused("the media server redirected without a Location", FAILED)
    if not location.isascii() or not location.isprintable() or "\\" in location:
        raise MediaRefused("the media server redirected to an invalid URL", FAILED)
    target = parse_url(urljoin(current.url, location), settings)
    if current.scheme == "https" and target.scheme == "http":
        raise MediaRefused("the media URL redirects from https to http")
    return target


def check_status(status: int) -> None:
    """A media answer other than 200 (redirects aside) is not media."""
    if status != 200:
        raise MediaRefused(f"the media server answered HTTP {status}", FAILED)


def media_type(header: str | None, modality: str, settings: MediaSettings) -> str:
    """The media type of an answer for a part of ``modality``, if allowed."""
    mime = (header or "").partition(";")[0].strip().lower()
    if not mime:
        raise MediaRefused("the media server sent no Content-Type")
    if mime.partition("/")[0] != modality:
        raise MediaRefused(f"the media is {mime}, not {modality}")
    top = mime.partition("/")[0]
    if mime not in settings.content_types and f"{top}/*" not in settings.content_types:
        raise MediaRefused(f"media of type {mime} is not accepted")
    return mime


def check_declared_size(content_length: str | None, limit: int) -> None:
    """Refuse at once an answer that says it is over ``limit`` bytes."""
    if content_length is not None and content_length.strip().isdigit():
        check_size(int(content_length), limit)


def check_size(size: int, limit: int) -> None:
    if size > limit:
        raise MediaRefused(f"the media is over {limit} bytes", TOO_LARGE)


def check_request_size(total: int, limit: int) -> None:
    """The media of one request together (max_request_bytes)."""
    if total > limit:
        raise MediaRefused(f"the request's media are over {limit} bytes together", TOO_LARGE)


def check_encoding(content_encoding: str | None) -> None:
    """The fetch asks for identity; an encoded answer would be inlined undecoded."""
    if content_encoding is not None and content_encoding.strip().lower() not in ("", "identity"):
        raise MediaRefused("the media server sent an encoded answer (Content-Encoding)", FAILED)


class Media(NamedTuple):
    """Fetched media: its type and bytes."""

    mime: str
    data: bytes

    @property
    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


# -- a request ----------------------------------------------------------------------------


def refusal(route: str, param: str, refused: MediaRefused) -> ApiError:
    """The answer to a refused media URL: the part, the reason (no URL: it may carry a
    signed token), in Anthropic's shape on its routes."""
    message = (
        f"Invalid '{param}': {refused.reason}. This gateway fetches media URLs under its "
        "egress policy; media it will not fetch can be sent inline as a data: URL (base64)."
    )
    kind = AnthropicApiError if route in ANTHROPIC_CONTENT_ROUTES else ApiError
    return kind(refused.status, message, param=param, code=refused.code)


def fetch_list(
    route: str, items: Sequence[RemoteMedia], settings: MediaSettings
) -> list[RemoteMedia]:
    """What a request's remote media takes to fetch: each distinct URL once, in body
    order, at most ``max_items`` of them; ApiError naming the part otherwise (a URL asked
    as two modalities is refused: one answer has one type)."""
    first: dict[str, RemoteMedia] = {}
    for item in items:
        seen = first.get(item.url)
        if seen is None:
            if len(first) == settings.max_items:
                raise refusal(
                    route,
                    item.param,
                    MediaRefused(
                        f"a request may name at most {settings.max_items} remote media URLs",
                        TOO_MANY,
                    ),
                )
            first[item.url] = item
        elif seen.modality != item.modality:
            raise refusal(
                route,
                item.param,
                MediaRefused(f"the same URL is {seen.param}, as {seen.modality}"),
            )
    return list(first.values())
