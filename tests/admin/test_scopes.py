"""The admin plane's pure rules: scope names, minting a subset, tenant pinning, routes."""

from __future__ import annotations

import pytest

from saltgate.admin.scopes import (
    ADMIN_TOKENS_WRITE,
    KEYS_WRITE,
    ROUTES,
    SCOPES,
    TENANTS_READ,
    match,
    may_mint,
    may_see,
    parse_scopes,
)

pytestmark = pytest.mark.unit


def test_parse_scopes() -> None:
    assert parse_scopes("all") == frozenset(SCOPES)
    assert parse_scopes(" tenants:read , keys:write ") == {TENANTS_READ, KEYS_WRITE}
    assert parse_scopes(["keys:write"]) == {KEYS_WRITE}
    with pytest.raises(ValueError, match="unknown scopes tenants:rule"):
        parse_scopes("tenants:read,tenants:rule")
    with pytest.raises(ValueError, match="unknown scopes"):
        parse_scopes(" , ")
    with pytest.raises(ValueError, match="list of names"):
        parse_scopes([1])


def test_a_pasted_secret_is_not_echoed() -> None:
    secret = "sgadm_" + "A" * 51
    with pytest.raises(ValueError) as err:
        parse_scopes(secret)
    assert secret not in str(err.value) and "A" * 10 not in str(err.value)


def test_a_token_mints_only_a_subset_pinned_as_it_is() -> None:
    own = frozenset({KEYS_WRITE, ADMIN_TOKENS_WRITE})
    assert may_mint(own, None, frozenset({KEYS_WRITE}), None) is None
    assert may_mint(own, None, own, "tn_x") is None  # unpinned may pin
    refused = may_mint(own, None, frozenset({KEYS_WRITE, TENANTS_READ}), None)
    assert refused is not None and "not tenants:read" in refused
    assert may_mint(own, "tn_a", own, "tn_a") is None
    assert may_mint(own, "tn_a", own, None) is not None  # a pinned token cannot unpin
    assert may_mint(own, "tn_a", own, "tn_b") is not None


def test_pinning() -> None:
    assert may_see(None, "tn_a") and may_see(None, None)
    assert may_see("tn_a", "tn_a")
    assert not may_see("tn_a", "tn_b") and not may_see("tn_a", None)


def test_match_routes() -> None:
    m = match("GET", "/admin/v1/tenants/tn_0123/keys")
    assert m is not None and m.route is not None
    assert (m.route.name, m.params) == ("keys_list", {"tenant_id": "tn_0123"})
    wrong = match("PATCH", "/admin/v1/tenants")
    assert wrong is not None and wrong.route is None and set(wrong.allowed) == {"GET", "POST"}
    for path in ("/admin/v1/nope", "/admin/v1/tenants/a/b/c", "/admin/v2/tenants", "/metrics"):
        assert match("GET", path) is None
    assert match("GET", "/admin/v1/keys/..%2f") is None  # not a segment a route takes
    assert match("GET", "/admin/v1/tenants/") is None  # an empty id


def test_a_price_route_takes_the_rest_of_the_path_as_the_model() -> None:
    """Model names hold slashes and colons: the last {model+} takes the rest, decoded once."""
    for path, model in (
        ("/admin/v1/prices/m", "m"),
        ("/admin/v1/prices/meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("/admin/v1/prices/qwen2.5%3A7b", "qwen2.5:7b"),
    ):
        m = match("PUT", path)
        assert m is not None and m.route is not None, path
        assert (m.route.name, m.params) == ("prices_set", {"model": model})
    assert match("PUT", "/admin/v1/prices/") is None  # no model
    assert match("PUT", "/admin/v1/prices/" + "m" * 1025) is None
    listing = match("PUT", "/admin/v1/prices")
    assert listing is not None and listing.route is None and listing.allowed == ("GET",)


def test_every_route_is_unique_and_scoped_with_a_known_scope() -> None:
    assert len({(r.method, r.pattern) for r in ROUTES}) == len(ROUTES)
    assert len({r.name for r in ROUTES}) == len(ROUTES)
    assert all(r.scope in SCOPES for r in ROUTES if r.name not in ("me", "openapi"))
