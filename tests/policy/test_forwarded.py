"""The client's address from X-Forwarded-For, read only from trusted proxies (pure: no
sockets)."""

from __future__ import annotations

import pytest

from saltgate.policy.forwarded import (
    HOP_CACHE,
    MAX_HOPS,
    TrustedProxies,
    client_address,
    parse_address,
)

pytestmark = pytest.mark.unit

BALANCERS = TrustedProxies.parse(["127.0.0.1", "10.0.0.0/8", "fd00::/8"])


def xff(*values: str) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"gw"), *((b"x-forwarded-for", v.encode()) for v in values)]


def test_an_untrusted_peer_cannot_choose_its_address() -> None:
    headers = xff("6.6.6.6")
    assert client_address("203.0.113.9", headers, BALANCERS) == "203.0.113.9"
    # Positive control: the same header from a trusted balancer is read.
    assert client_address("10.1.2.3", headers, BALANCERS) == "6.6.6.6"
    # Nobody trusted (the default): the header is never read.
    assert client_address("10.1.2.3", headers, TrustedProxies()) == "10.1.2.3"


def test_the_rightmost_untrusted_hop_is_the_client() -> None:
    # The client wrote 6.6.6.6 itself; the first balancer appended what it saw, 198.51.100.7,
    # and a second balancer (10.0.0.5) appended the first one.
    headers = xff("6.6.6.6, 198.51.100.7", "10.0.0.5")
    assert client_address("127.0.0.1", headers, BALANCERS) == "198.51.100.7"


def test_every_hop_trusted_gives_the_leftmost() -> None:
    assert client_address("127.0.0.1", xff("10.0.0.9, 10.0.0.5"), BALANCERS) == "10.0.0.9"


def test_without_the_header_a_trusted_peer_is_the_client() -> None:
    assert client_address("127.0.0.1", xff(), BALANCERS) == "127.0.0.1"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("", "10.0.0.5"),  # empty: nothing said
        ("   ,  ", "10.0.0.5"),
        ("garbage", "10.0.0.5"),
        ("6.6.6.6, garbage", "10.0.0.5"),  # the walk stops at what it cannot read
        ("6.6.6.6, unknown, 10.0.0.9", "10.0.0.9"),  # ... at the last trusted hop reached
        ("1.2.3.4\nforged=line", "10.0.0.5"),
        ("999.1.1.1", "10.0.0.5"),
        ("fe80::1%eth0 evil", "10.0.0.5"),  # a zone is free text: refused
        ("1.2.3.4:80", "1.2.3.4"),  # a port some proxies append
        ("[2001:db8::1]:8080", "2001:db8::1"),
        ("[2001:db8::1]", "2001:db8::1"),
        ("2001:DB8::1", "2001:db8::1"),  # written as parsed, not as sent
        ("::ffff:198.51.100.7", "198.51.100.7"),  # IPv4-mapped
        ("[2001:db8::1]x", "10.0.0.5"),
        ("1.2.3.4:http", "10.0.0.5"),
    ],
)
def test_malformed_and_unusual_headers(header: str, expected: str) -> None:
    assert client_address("10.0.0.5", xff(header), BALANCERS) == expected


def test_ipv6_peers_and_proxies() -> None:
    assert client_address("fd00::7", xff("2001:db8::9"), BALANCERS) == "2001:db8::9"
    assert client_address("::ffff:10.0.0.5", xff("203.0.113.1"), BALANCERS) == "203.0.113.1"
    assert client_address("2001:db8::2", xff("203.0.113.1"), BALANCERS) == "2001:db8::2"


def test_a_padded_header_is_walked_only_so_far() -> None:
    hops = ["6.6.6.6"] + ["10.0.0.1"] * (10 * MAX_HOPS)
    assert client_address("127.0.0.1", xff(", ".join(hops)), BALANCERS) == "10.0.0.1"
    # Positive control: within the limit, the untrusted hop is found.
    hops = ["6.6.6.6"] + ["10.0.0.1"] * (MAX_HOPS - 1)
    assert client_address("127.0.0.1", xff(", ".join(hops)), BALANCERS) == "6.6.6.6"


def test_the_result_is_always_an_address() -> None:
    for header in ("a" * 10_000, "\x00", "1.2.3.4, <script>", "é"):
        found = client_address("127.0.0.1", xff(header), BALANCERS)
        assert parse_address(found) is not None


def test_what_is_remembered_is_bounded_and_changes_nothing() -> None:
    trusted = TrustedProxies.parse(["10.0.0.0/8"])
    for i in range(HOP_CACHE + 10):
        client = f"198.51.{i // 256}.{i % 256}"
        assert client_address("10.0.0.5", xff(client), trusted) == client
        assert len(trusted._hops) <= HOP_CACHE
    assert client_address("10.0.0.5", xff("198.51.0.1"), trusted) == "198.51.0.1"  # again
    assert trusted == TrustedProxies.parse(["10.0.0.0/8"])  # the memory is not the value


@pytest.mark.parametrize(
    ("items", "problem"),
    [(["10.0.0.1/8"], "host bits"), (["not-an-ip"], "not-an-ip"), (["10.0.0.0/33"], "10.0.0.0/33")],
)
def test_trusted_proxies_are_addresses_or_cidrs(items: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        TrustedProxies.parse(items)
