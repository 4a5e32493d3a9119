"""`saltgate tenants` and `keys`: tenants, their API keys and their limits, through the
admin service (saltgate.admin.service holds every rule)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from saltgate.admin.service import AdminService, Caller, KeyView, LimitsChange, Page
    from saltgate.governance.limits import Limits

from saltgate.cli.common import _PAGE, _every, _state_dir_arg, _with_service


def _add_admin(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.governance.kinds import BANDS, DEFAULT_BAND

    tenants = sub.add_parser(
        "tenants", help="create, list and rotate tenants, and choose the models they may use"
    )
    tsub = tenants.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = tsub.add_parser("create", help="create a tenant")
    p.add_argument("name", help="the tenant's name (unique)")
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_create)
    p = tsub.add_parser("list", help="list tenants")
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_list)
    p = tsub.add_parser("rotate-salt", help="move a tenant to a fresh cache namespace")
    p.add_argument("name", help="the tenant's name")
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_rotate)
    p = tsub.add_parser(
        "set-models",
        help="let a tenant use only some models (m1,m2), or every model again (--all)",
    )
    p.add_argument("name", help="the tenant's name")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("models", nargs="?", help="comma-separated model names, e.g. m1,m2")
    which.add_argument("--all", action="store_true", help="every model (clears the list)")
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_set_models)
    p = tsub.add_parser(
        "set-limits",
        help="set a tenant's rate limits, budget and fair-share weight (those given; the "
        "others are kept), or --clear them",
    )
    p.add_argument("name", help="the tenant's name")
    _limit_args(p, tenant=True)
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_set_limits)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ksub.add_parser("create", help="mint an API key (printed once, stored as a hash)")
    p.add_argument("tenant", help="the tenant's name")
    p.add_argument(
        "--priority",
        choices=BANDS,
        default=DEFAULT_BAND.value,
        help="the key's band when the replicas are saturated: interactive requests go first",
    )
    _state_dir_arg(p)
    p.set_defaults(func=_keys_create)
    p = ksub.add_parser("list", help="list key ids (never the keys)")
    p.add_argument("tenant", nargs="?", help="only this tenant's keys (default: every tenant)")
    _state_dir_arg(p)
    p.set_defaults(func=_keys_list)
    p = ksub.add_parser("revoke", help="revoke a key by its id")
    p.add_argument("key_id", help="the key's id, as `keys list` shows it (key_...)")
    _state_dir_arg(p)
    p.set_defaults(func=_keys_revoke)
    p = ksub.add_parser(
        "set-limits",
        help="set a key's own limits, which narrow its tenant's (those given; the others are "
        "kept), or --clear them",
    )
    p.add_argument("key_id", help="the key's id, as `keys list` shows it (key_...)")
    _limit_args(p, tenant=False)
    _state_dir_arg(p)
    p.set_defaults(func=_keys_set_limits)


def _limit_args(p: argparse.ArgumentParser, *, tenant: bool) -> None:
    """The options of `tenants set-limits` and `keys set-limits` (docs/limits.md); a
    tenant's also set its weight (docs/fairness.md), a key's refuse one in words."""
    p.add_argument("--rpm", type=int, help="requests in any 60 s window")
    p.add_argument("--input-tpm", type=int, help="uncached input tokens in any 60 s window")
    p.add_argument("--output-tpm", type=int, help="output tokens in any 60 s window")
    p.add_argument("--concurrency", type=int, help="requests in flight at once")
    p.add_argument("--budget-usd", help="spend in any --budget-period, priced as billed")
    p.add_argument("--budget-period", help="the budget's period, e.g. 30d, 7d, 24h")
    p.add_argument(
        "--weight",
        help="the tenant's fair share of saturated replicas (default 1; 2: twice a tenant "
        "of 1's; docs/fairness.md)"
        if tenant
        else argparse.SUPPRESS,  # refused in words: a key has its tenant's share
    )
    p.add_argument(
        "--clear",
        action="append",
        nargs="?",
        const="all",
        metavar="KIND",
        help="remove one kind: rpm, input_tpm, output_tpm, concurrency, budget"
        + (", weight (back to 1)" if tenant else "")
        + " (repeatable); alone and without KIND: every limit"
        + (" (the weight stays)" if tenant else "")
        + ". Kinds not named are kept",
    )


def _tenants_create(args: argparse.Namespace) -> int:
    async def create(service: AdminService, caller: Caller) -> str:
        return f"created tenant {(await service.tenants_create(caller, args.name)).name}"

    return _with_service(args, create)


def _tenants_list(args: argparse.Namespace) -> int:
    async def show(service: AdminService, caller: Caller) -> str:
        tenants = await _every(
            lambda after: service.tenants_list(caller, after=after, limit=_PAGE), lambda t: t.id
        )
        rows = [
            f"{t.id}\t{t.name}\tepoch {t.epoch}\tmodels {_models_label(t.models)}"
            f"\tlimits {_limits_label(t.limits)}\tweight {t.weight:g}"
            + ("" if t.archived_at is None else "\tarchived")
            for t in sorted(tenants, key=lambda t: t.name)
        ]
        return "\n".join(rows)

    return _with_service(args, show)


def _tenants_rotate(args: argparse.Namespace) -> int:
    async def rotate(service: AdminService, caller: Caller) -> str:
        tenant = await service.tenants_rotate_salt(caller, args.name)
        return f"tenant {args.name} moved to epoch {tenant.epoch}"

    return _with_service(args, rotate)


def _tenants_set_models(args: argparse.Namespace) -> int:
    from saltgate.admin.service import TenantChange

    models = None if args.all else tuple(m.strip() for m in args.models.split(",") if m.strip())

    async def apply(service: AdminService, caller: Caller) -> str:
        change = TenantChange(set_models=True, models=models)
        t = await service.tenants_update(caller, args.name, change)
        return f"tenant {t.name} may use models {_models_label(t.models)}"

    return _with_service(args, apply)


def _tenants_set_limits(args: argparse.Namespace) -> int:
    async def apply(service: AdminService, caller: Caller) -> str:
        change, weight = _limits_from_args(args, tenant=True)
        t = await service.tenants_limits(caller, args.name, change, weight)
        return (
            f"tenant {t.name} limits {_limits_label(t.limits)}\tweight {t.weight:g}\n"
            f"{_enforced(args, t.limits)}"
        )

    return _with_service(args, apply)


def _keys_set_limits(args: argparse.Namespace) -> int:
    async def apply(service: AdminService, caller: Caller) -> str:
        change, _ = _limits_from_args(args, tenant=False)
        k = await service.keys_limits(caller, args.key_id, change)
        return f"key {k.id} limits {_limits_label(k.limits)}\n{_enforced(args, k.limits)}"

    return _with_service(args, apply)


def _enforced(args: argparse.Namespace, limits: Limits | None) -> str:
    """What the gateways enforce of these limits, in words: by the config given (its
    [limits] share and [cluster]), else a gateway alone on the state directory's host."""
    from saltgate.config import load_config
    from saltgate.governance.limits import enforced_note

    config = load_config(args.config) if args.config else None
    if config is None:
        return enforced_note(limits, gateways=1, cluster=False)
    return enforced_note(limits, gateways=config.limits_share, cluster=config.cluster is not None)


def _limits_from_args(
    args: argparse.Namespace, *, tenant: bool
) -> tuple[LimitsChange, float | None]:
    """The change the options give: an edit (the limits named set, the kinds in --clear
    removed, every other kept), or none at all for a bare --clear; and the tenant's weight
    when --weight or --clear weight names it (1), else None (kept); through the parsers the
    API and the console use. ConfigError (one line on stderr) when wrong."""
    from saltgate.config import ConfigError
    from saltgate.governance.limits import LimitError, parse_limits_edit
    from saltgate.governance.weight import WEIGHT, split_weight

    given = {
        "rpm": args.rpm,
        "input_tpm": args.input_tpm,
        "output_tpm": args.output_tpm,
        "concurrency": args.concurrency,
        "budget_usd": args.budget_usd,
        "budget_period": args.budget_period,
        "weight": args.weight,
    }
    named: dict[str, object] = {k: v for k, v in given.items() if v not in (None, "")}
    clear = set(args.clear or ())
    if "all" in clear:
        if named or len(clear) > 1:
            raise ConfigError("set-limits: give --clear alone to remove every limit")
        return None, None
    if not named and not clear:
        raise ConfigError(
            "set-limits: give at least one of --rpm, --input-tpm, --output-tpm, "
            "--concurrency, --budget-usd, --budget-period, "
            + ("--weight, " if tenant else "")
            + "--clear"
        )
    if WEIGHT in clear:  # back to the default: a weight of None, as split_weight takes it
        if WEIGHT in named:
            raise ConfigError("set-limits: weight is both set and cleared")
        clear.discard(WEIGHT)
        named[WEIGHT] = None
    try:
        given_limits, weight = split_weight(named, tenant=tenant)
        return parse_limits_edit(given_limits, clear), weight
    except LimitError as exc:
        raise ConfigError(f"set-limits: {exc}") from None


def _limits_label(limits: Limits | None) -> str:
    from saltgate.governance.limits import limits_label

    return limits_label(limits)


def _models_label(models: tuple[str, ...] | None) -> str:
    return "all" if models is None else ",".join(models)


def _keys_create(args: argparse.Namespace) -> int:
    async def create(service: AdminService, caller: Caller) -> str:
        minted = await service.keys_create(caller, args.tenant, args.priority)
        print(f"created {minted.key.id} ({args.priority}) for {args.tenant}", file=sys.stderr)
        return minted.value

    return _with_service(args, create)


def _keys_list(args: argparse.Namespace) -> int:
    async def show(service: AdminService, caller: Caller) -> str:
        if args.tenant is None:
            tenants = await _every(
                lambda after: service.tenants_list(caller, after=after, limit=_PAGE),
                lambda t: t.id,
            )
            refs = [t.id for t in tenants]
        else:
            refs = [args.tenant]
        keys = []
        for ref in refs:

            def page(after: str, ref: str = ref) -> Awaitable[Page[KeyView]]:
                return service.keys_list(caller, ref, after=after, limit=_PAGE)

            keys += [view.key for view in await _every(page, lambda v: v.key.id)]
        rows = []
        for k in sorted(keys, key=lambda k: k.created_at):
            state = "revoked" if k.revoked_at is not None else "active"
            limits = _limits_label(k.limits)
            rows.append(f"{k.id}\t{k.tenant_id}\t{state}\tpriority {k.priority}\tlimits {limits}")
        return "\n".join(rows)

    return _with_service(args, show)


def _keys_revoke(args: argparse.Namespace) -> int:
    async def revoke(service: AdminService, caller: Caller) -> str:
        return f"revoked {(await service.keys_revoke(caller, args.key_id)).id}"

    return _with_service(args, revoke)
