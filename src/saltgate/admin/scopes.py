"""Who may do what on the admin plane: scopes, the route table, tenant pinning (pure).

Every admin route is one row of ROUTES with the one scope it needs, so the check is made
in one place (saltgate.admin.service) by every operation, and a test walks the table.
A token pinned to a tenant sees and changes only that tenant; a token mints only tokens
with a subset of its own scopes, pinned as it is (LiteLLM's admin-plane escalation,
docs/admin-api.md, came from an unchecked grant).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote

USAGE_READ: Final = "usage:read"
TENANTS_READ: Final = "tenants:read"
TENANTS_WRITE: Final = "tenants:write"
KEYS_WRITE: Final = "keys:write"
LIMITS_WRITE: Final = "limits:write"
PRICES_WRITE: Final = "prices:write"
AUDIT_LOG_READ: Final = "audit_log:read"
ADMIN_TOKENS_WRITE: Final = "admin_tokens:write"
SCOPES: Final = (
    USAGE_READ,
    TENANTS_READ,
    TENANTS_WRITE,
    KEYS_WRITE,
    LIMITS_WRITE,
    PRICES_WRITE,
    AUDIT_LOG_READ,
    ADMIN_TOKENS_WRITE,
)
ALL: Final = "all"  # on the CLI and in the API: every scope

PREFIX: Final = "/admin/v1/"


def scopes_label(scopes: Iterable[str]) -> str:
    return ",".join(sorted(scopes)) or "(none)"


def parse_scopes(given: str | Iterable[object]) -> frozenset[str]:
    """``all`` or scope names (comma-separated, or a list); ValueError naming the unknown
    (only names shaped like scopes are echoed: a pasted secret is not)."""
    if not isinstance(given, str | list | tuple | set | frozenset):
        raise ValueError(f"scopes must be {ALL}, comma-separated names, or a list of names")
    wanted = set()
    for name in given.split(",") if isinstance(given, str) else given:
        if not isinstance(name, str):
            raise ValueError("scopes must be a list of names")
        if name.strip():
            wanted.add(name.strip())
    if ALL in wanted:
        return frozenset(SCOPES)
    unknown = wanted - set(SCOPES)
    if unknown or not wanted:
        shown = scopes_label(u for u in unknown if re.fullmatch(r"[a-z_:]{1,40}", u))
        raise ValueError(f"unknown scopes {shown}: give {ALL} or some of {scopes_label(SCOPES)}")
    return frozenset(wanted)


def may_mint(
    own: frozenset[str], own_tenant: str | None, wanted: frozenset[str], tenant: str | None
) -> str | None:
    """None if a token with scopes `own`, pinned to `own_tenant`, may mint a token with
    `wanted`, pinned to `tenant`; else why not."""
    extra = wanted - own
    if extra:
        return f"a token can mint only a subset of its own scopes; not {scopes_label(extra)}"
    if own_tenant is not None and tenant != own_tenant:
        return "a token pinned to a tenant can mint only tokens pinned to the same tenant"
    return None


def may_see(pinned: str | None, tenant_id: str | None) -> bool:
    """Whether a token pinned to `pinned` (None: unpinned) may see or change what belongs
    to `tenant_id` (None: to no tenant, e.g. an unpinned token or the whole store)."""
    return pinned is None or pinned == tenant_id


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    pattern: str  # under PREFIX; {name} matches one path segment, a last {name+} the rest
    scope: str | None  # None: any admin token (who am I)
    name: str  # the operation's name in saltgate.admin.service (and api's handler)


ROUTES: Final = (
    Route("GET", "me", None, "me"),
    Route("GET", "openapi.json", None, "openapi"),  # this table as OpenAPI (admin/openapi.py)
    Route("GET", "tenants", TENANTS_READ, "tenants_list"),
    Route("POST", "tenants", TENANTS_WRITE, "tenants_create"),
    Route("GET", "tenants/{tenant_id}", TENANTS_READ, "tenants_get"),
    Route("POST", "tenants/{tenant_id}", TENANTS_WRITE, "tenants_update"),
    Route("POST", "tenants/{tenant_id}/archive", TENANTS_WRITE, "tenants_archive"),
    Route("POST", "tenants/{tenant_id}/rotate_salt", TENANTS_WRITE, "tenants_rotate_salt"),
    Route("PUT", "tenants/{tenant_id}/limits", LIMITS_WRITE, "tenants_limits"),
    Route("PATCH", "tenants/{tenant_id}/limits", LIMITS_WRITE, "tenants_limits_edit"),
    Route("GET", "tenants/{tenant_id}/keys", TENANTS_READ, "keys_list"),
    Route("POST", "tenants/{tenant_id}/keys", KEYS_WRITE, "keys_create"),
    Route("GET", "keys/{key_id}", TENANTS_READ, "keys_get"),
    Route("DELETE", "keys/{key_id}", KEYS_WRITE, "keys_revoke"),
    Route("POST", "keys/{key_id}/rotate", KEYS_WRITE, "keys_rotate"),
    Route("PUT", "keys/{key_id}/limits", LIMITS_WRITE, "keys_limits"),
    Route("PATCH", "keys/{key_id}/limits", LIMITS_WRITE, "keys_limits_edit"),
    Route("GET", "audit_logs", AUDIT_LOG_READ, "audit_logs_list"),
    Route("GET", "admin_tokens", ADMIN_TOKENS_WRITE, "admin_tokens_list"),
    Route("POST", "admin_tokens", ADMIN_TOKENS_WRITE, "admin_tokens_create"),
    Route("DELETE", "admin_tokens/{token_id}", ADMIN_TOKENS_WRITE, "admin_tokens_revoke"),
    # Usage and costs (saltgate.admin.usage), from the rollups.
    Route("GET", "usage/completions", USAGE_READ, "usage_completions"),
    Route("GET", "usage/completions.csv", USAGE_READ, "usage_completions_csv"),
    Route("GET", "usage/reconcile", USAGE_READ, "usage_reconcile"),
    Route("GET", "costs", USAGE_READ, "costs"),
    # Prices: read as costs are; set through the store over the config's (docs/billing.md).
    Route("GET", "prices", USAGE_READ, "prices_list"),
    Route("PUT", "prices/{model+}", PRICES_WRITE, "prices_set"),
    Route("DELETE", "prices/{model+}", PRICES_WRITE, "prices_clear"),
)

NAMED: Final = {route.name: route for route in ROUTES}


def refusal(granted: frozenset[str], operation: str) -> str | None:
    """None if a token holding `granted` may run `operation` (a row's name); else why not."""
    scope = NAMED[operation].scope
    if scope is not None and scope not in granted:
        return f"this admin token lacks the scope {scope}"
    return None


SEGMENT: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")
MAX_TAIL: Final = 1024


def _match_tail(want: list[str], parts: list[str]) -> dict[str, str] | None:
    """A pattern ending in {name+}: a model name, the rest of the path, slashes and all
    ("meta-llama/Llama-3.1-8B"), percent-decoded once ("qwen2.5%3A7b"); the handler says
    if it is no valid name."""
    head = len(want) - 1
    tail = unquote("/".join(parts[head:]))
    if len(parts) <= head or not tail or len(tail) > MAX_TAIL:
        return None
    params = _match_pattern("/".join(want[:-1]), parts[:head])
    return None if params is None else {**params, want[-1][1:-2]: tail}


def _match_pattern(pattern: str, parts: list[str]) -> dict[str, str] | None:
    want = pattern.split("/")
    if want[-1].endswith("+}"):
        return _match_tail(want, parts)
    if len(want) != len(parts):
        return None
    params = {}
    for w, p in zip(want, parts, strict=True):
        if w.startswith("{"):
            if not SEGMENT.fullmatch(p):
                return None
            params[w[1:-1]] = p
        elif w != p:
            return None
    return params


@dataclass(frozen=True, slots=True)
class Match:
    route: Route | None  # None: the path exists, not with this method (see `allowed`)
    params: dict[str, str]
    allowed: tuple[str, ...] = ()


def match(method: str, path: str) -> Match | None:
    """The route for a request; None when the path is no admin route (404)."""
    if not path.startswith(PREFIX):
        return None
    parts = path[len(PREFIX) :].split("/")
    allowed = []
    for route in ROUTES:
        params = _match_pattern(route.pattern, parts)
        if params is None:
            continue
        if route.method == method:
            return Match(route, params)
        allowed.append(route.method)
    return Match(None, {}, tuple(allowed)) if allowed else None


# The admin listener's own data (its /metrics, the console's fleet page and TTFT) counts
# every tenant's traffic and names the replicas and the store: it is what the usage API
# shows an unpinned usage:read token, so that is what it takes (docs/admin-api.md).
FLEET_SCOPE: Final = USAGE_READ


def may_read_fleet(own: frozenset[str], pinned: str | None) -> str | None:
    """None if a token with scopes `own`, pinned to `pinned`, may read the listener's own
    data (metrics, fleet, TTFT); else why not."""
    if FLEET_SCOPE not in own:
        return f"this admin token lacks the scope {FLEET_SCOPE}"
    if pinned is not None:
        return "every tenant's traffic is not for a token pinned to a tenant"
    return None
