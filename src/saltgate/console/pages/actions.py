"""The console's forms: each POST calls the admin service, then shows a page."""

from __future__ import annotations

from saltgate.admin import scopes
from saltgate.console.common import LIMIT_FIELDS, Form, Refusal
from saltgate.console.core import ConsoleCore
from saltgate.console.html import url
from saltgate.console.security import Session
from saltgate.governance.kinds import DEFAULT_BAND
from saltgate.governance.limits import LimitError, parse_limits
from saltgate.governance.weight import WEIGHT, split_weight
from saltgate.http import Response
from saltgate.prices import price_from_fields


async def create_tenant(console: ConsoleCore, session: Session, _: str, form: Form) -> Response:
    name = form.one("name")
    made = await console.do(session, lambda caller: console.service.tenants_create(caller, name))
    to = "" if isinstance(made, Refusal) else url(f"tenants/{made.id}", {"done": "tenant-created"})
    return console.after(made, to)


async def set_limits(console: ConsoleCore, session: Session, tenant: str, form: Form) -> Response:
    names = [k for k, _ in LIMIT_FIELDS] + [WEIGHT]
    try:  # the form replaces the limits; its weight field (empty: 1) sets the weight
        given, weight = split_weight({k: form.one(k) for k in names}, tenant=True)
        limits = parse_limits(given)
    except LimitError as exc:
        return console.plain(400, f"{str(exc).capitalize()}.")
    done = await console.do(
        session, lambda caller: console.service.tenants_limits(caller, tenant, limits, weight)
    )
    return console.after(done, url(f"tenants/{tenant}", {"done": "limits-saved"}))


async def rotate_salt(console: ConsoleCore, session: Session, tenant: str, _: Form) -> Response:
    done = await console.do(
        session, lambda caller: console.service.tenants_rotate_salt(caller, tenant)
    )
    back = {"done": "salt-rotated"}
    return console.after(done, url(f"tenants/{tenant}", back))


async def create_key(console: ConsoleCore, session: Session, _: str, form: Form) -> Response:
    tenant = form.one("tenant")
    made = await console.do(
        session, lambda caller: console.service.keys_create(caller, tenant, DEFAULT_BAND.value)
    )
    return console.shown_once(made, "New API key", url("keys", {"tenant": tenant}))


async def revoke_key(console: ConsoleCore, session: Session, key: str, _: Form) -> Response:
    done = await console.do(session, lambda caller: console.service.keys_revoke(caller, key))
    tenant = "" if isinstance(done, Refusal) else done.tenant_id
    return console.after(done, url("keys", {"tenant": tenant, "done": "key-revoked"}))


async def rotate_key(console: ConsoleCore, session: Session, key: str, form: Form) -> Response:
    try:
        grace = float(form.one("grace_period_s") or 86400)
    except ValueError:
        return console.plain(400, "The grace period is a number of seconds.")
    made = await console.do(session, lambda caller: console.service.keys_rotate(caller, key, grace))
    tenant = "" if isinstance(made, Refusal) else made.key.tenant_id
    return console.shown_once(made, "Rotated API key", url("keys", {"tenant": tenant}))


async def create_admin_token(
    console: ConsoleCore, session: Session, _: str, form: Form
) -> Response:
    try:
        wanted = scopes.parse_scopes(form.values.get("scopes") or [])
    except ValueError as exc:
        return console.plain(400, str(exc))
    tenant = form.one("tenant_id") or session.tenant_id
    made = await console.do(
        session, lambda caller: console.service.admin_tokens_create(caller, wanted, tenant)
    )
    return console.shown_once(made, "New admin token", url("admin-tokens"))


async def revoke_admin_token(
    console: ConsoleCore, session: Session, token_id: str, _: Form
) -> Response:
    done = await console.do(
        session, lambda caller: console.service.admin_tokens_revoke(caller, token_id)
    )
    return console.after(done, url("admin-tokens", {"done": "admin-token-revoked"}))


async def set_price(console: ConsoleCore, session: Session, _: str, form: Form) -> Response:
    model = form.one("model")
    fields = ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok")
    try:
        price = price_from_fields({f: form.one(f) for f in fields})
    except ValueError as exc:
        return console.plain(400, str(exc))
    done = await console.do(
        session, lambda caller: console.service.prices_set(caller, model, price)
    )
    return console.after(done, url("prices", {"done": "price-set"}))


async def clear_price(console: ConsoleCore, session: Session, _: str, form: Form) -> Response:
    model = form.one("model")
    done = await console.do(session, lambda caller: console.service.prices_clear(caller, model))
    back = {"done": "price-cleared"}
    return console.after(done, url("prices", back))
