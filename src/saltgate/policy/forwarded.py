"""The client's address: the TCP peer, or what a trusted balancer says in X-Forwarded-For.

Behind a balancer every connection comes from the balancer, so the access log would name
it for every request. A balancer appends the address it received the request from to
`X-Forwarded-For`; anyone else can write anything there. So the header is read only when
the peer is a configured trusted proxy (`[gateway] trusted_proxies`), and then from the
right: the rightmost address that is not itself a trusted proxy is the client (a chain of
trusted proxies each appended the hop before it; what lies left of the first untrusted
hop was written by the client and proves nothing). From an untrusted peer the header is
ignored, so a client cannot choose the address it is logged under.

What is returned is always an address parsed here (or the peer as the socket gave it),
never header text, so nothing a client sends reaches a log line through it. The header
is never forwarded to a replica (policy/headers.py: x-forwarded-* are not on the list).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

XFF: Final = b"x-forwarded-for"
# Hops read from the right at most: a chain of proxies is a few long; a longer header is
# a client padding it, and is not walked to its end.
MAX_HOPS: Final = 32
# Hops classified are remembered (the balancers', the clients' that come back): parsing
# and matching with the standard library costs microseconds, a hit a dict lookup. Cleared
# when full, so a client sending new addresses costs the parse, never memory.
HOP_CACHE: Final = 4096


@dataclass(frozen=True, slots=True)
class TrustedProxies:
    """The networks whose connections may say who the client is; empty: nobody's."""

    networks: tuple[IPNetwork, ...] = ()
    # text -> (the address as written back, trusted?), None if not an address
    _hops: dict[str, tuple[str, bool] | None] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def parse(cls, items: Sequence[str]) -> TrustedProxies:
        """Addresses or CIDRs ("127.0.0.1", "10.0.0.0/8", "::1"); ValueError naming the
        one that is not (host bits set in a CIDR are refused: a likely typo)."""
        networks = []
        for item in items:
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=True))
            except ValueError as exc:
                raise ValueError(f"{item!r} is not an IP address or CIDR ({exc})") from None
        return cls(tuple(networks))

    def trusts(self, address: IPAddress) -> bool:
        return any(address in network for network in self.networks)

    def hop(self, text: str) -> tuple[str, bool] | None:
        """`text` as an address written back by this module, and whether it is trusted;
        None when it is no address (`parse_address`). Remembered."""
        if text in self._hops:
            return self._hops[text]
        address = parse_address(text)
        found = None if address is None else (str(address), self.trusts(address))
        if len(self._hops) >= HOP_CACHE:
            self._hops.clear()
        self._hops[text] = found
        return found


def client_address(
    peer: str, headers: Iterable[tuple[bytes, bytes]], trusted: TrustedProxies
) -> str:
    """The client's address for the log: `peer` unless it is a trusted proxy, else the
    rightmost X-Forwarded-For hop that is not trusted (see the module docstring).

    A malformed hop ends the walk: the client is then the last trusted proxy reached,
    the nearest address known to be true. Every hop trusted: the leftmost one.
    """
    if not trusted.networks:
        return peer
    hop = trusted.hop(peer)
    if hop is None or not hop[1]:
        return peer
    values = [value for name, value in headers if name == XFF]
    if not values:
        return hop[0]
    # Several X-Forwarded-For fields are one list, in order (RFC 9110, section 5.3).
    entries = b",".join(values).rsplit(b",", MAX_HOPS)
    for entry in reversed(entries[-MAX_HOPS:]):
        found = trusted.hop(entry.decode("ascii", "replace"))
        if found is None:
            break
        hop = found
        if not hop[1]:
            break
    return hop[0]


def parse_address(text: str) -> IPAddress | None:
    """An address as proxies write it ("1.2.3.4", "1.2.3.4:80", "2001:db8::1",
    "[2001:db8::1]:80"), IPv4-mapped IPv6 as IPv4; None for anything else, a zone
    ("fe80::1%eth0") included: its text after % is free-form, and means nothing off the
    host that wrote it."""
    text = text.strip()
    if "%" in text:
        return None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not (rest[:1] == ":" and _is_port(rest[1:]))):
            return None
        text = host
    elif text.count(":") == 1:
        text, _, port = text.partition(":")
        if not _is_port(port):
            return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and 0 < len(text) <= 5
