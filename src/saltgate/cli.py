"""The `saltgate` command: one entry point, a subcommand per tool."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pathlib import Path

    from saltgate.admin.service import AdminService, Caller, KeyView, LimitsChange, Page
    from saltgate.config import GatewayConfig
    from saltgate.governance.limits import Limits
    from saltgate.kvevents.settings import KvRelaySettings, KvUpstream
    from saltgate.store.settings import StoreSettings

Command = Callable[[argparse.Namespace], int]
T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows each option's default, so nobody reads the code to learn it; except
    where the help text already speaks of its default, or there is none (unset, off, empty)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if "default" in (action.help or "") or default is None or default is False:
            return action.help
        if default == [] or default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Every saltgate parser: its sub-parsers are of this class too (argparse makes them of
    the parent's), so one formatter covers every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.sim.server import SimConfig

    d = SimConfig()
    p = sub.add_parser("sim", help="run a simulated vLLM replica (OpenAI API, prefix cache)")
    p.add_argument("--host", default=d.host, help="address to listen on")
    p.add_argument("--port", type=int, default=d.port, help="port to listen on")
    p.add_argument("--model", default=d.model, help="served model name")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV-cache capacity")
    p.add_argument(
        "--hash-algo",
        choices=("sha256", "sha256_cbor"),
        default=d.hash_algo,
        help="block hash, as vLLM's --prefix-caching-hash-algo",
    )
    p.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1")
    on_off = argparse.BooleanOptionalAction
    p.add_argument(
        "--enable-prompt-tokens-details",
        action=on_off,
        default=d.enable_prompt_tokens_details,
        help="report cached tokens in usage (vLLM's flag; on by default here, off in vLLM)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=on_off,
        default=d.enable_prefix_caching,
        help="cache prompt blocks (vLLM's flag; on by default in both)",
    )
    p.add_argument("--kv-events-endpoint", default=None, help="ZMQ endpoint, e.g. tcp://*:5557")
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="ZMQ endpoint answering replay requests for missed KV events",
    )
    p.add_argument("--kv-events-topic", default=d.kv_events_topic, help="KV-event topic")
    p.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=d.prefill_ms_per_1k_tokens,
        help="simulated prefill time of uncached prompt tokens (one step at a time)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="prompt tokens one prefill step computes, running prefills first (vLLM's "
        "chunked prefill; 0: one whole prompt per step)",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most tokens of a step one running prefill takes (vLLM's; 0: no cap)",
    )
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=d.decode_ms_per_token,
        help="simulated time per output token",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=d.max_concurrency, help="requests run at once"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest prompt plus output, in tokens",
    )
    p.add_argument("--tls-cert", default=None, help="serve https with this PEM certificate")
    p.add_argument("--tls-key", default=None, help="its PEM private key (else in --tls-cert)")
    p.add_argument(
        "--tls-client-ca", default=None, help="require client certificates from this CA (mTLS)"
    )
    p.set_defaults(func=_run_sim)


def _run_sim(args: argparse.Namespace) -> int:
    from saltgate.sim.run import serve_forever
    from saltgate.sim.server import SimConfig

    config = SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        hash_algo=args.hash_algo,
        api_key=args.api_key,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        decode_ms_per_token=args.decode_ms_per_token,
        max_concurrency=args.max_concurrency,
        max_model_len=args.max_model_len,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )
    return serve_forever(config)


def _add_gateway(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the gateway from a configuration file")
    p.add_argument("--config", required=True, help="TOML file (see docs/config.md)")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="worker processes serving the one port (1: a single process; docs/workers.md)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="validate the configuration and the files it names, then exit without serving "
        "(exit status 0 if valid, 2 if not; no network)",
    )
    p.set_defaults(func=_run_serve)

    p = sub.add_parser("up", help="run the gateway on its embedded default: simulated replicas")
    p.add_argument("--port", type=int, default=8000, help="gateway port (metrics on port+1)")
    p.add_argument("--replicas", type=int, default=2, help="how many simulated replicas")
    p.add_argument("--state-dir", default=".state", help="tenants, keys, usage, master key")
    p.set_defaults(func=_run_up)


def _state_dir_arg(p: argparse.ArgumentParser, *, nested: bool = False) -> None:
    """Where the store is: the gateway's config ([store]), or a state directory (SQLite).

    `nested`: a sub-command of a command that takes them too (`usage prune`); left out,
    they keep what was given before the sub-command instead of resetting it.
    """
    default = argparse.SUPPRESS if nested else None
    p.add_argument(
        "--config", default=default, help="the gateway's TOML file: its [store] (docs/store.md)"
    )
    p.add_argument(
        "--state-dir",
        default=default,
        help="directory holding saltgate.db, without --config (default .state)",
    )


def _add_admin(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.governance.priority import DEFAULT_PRIORITY, PRIORITIES

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
        help="set a tenant's rate limits, budget and fair-share weight (replacing the old "
        "ones), or --clear them",
    )
    p.add_argument("name", help="the tenant's name")
    _limit_args(p)
    _state_dir_arg(p)
    p.set_defaults(func=_tenants_set_limits)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ksub.add_parser("create", help="mint an API key (printed once, stored as a hash)")
    p.add_argument("tenant", help="the tenant's name")
    p.add_argument(
        "--priority",
        choices=PRIORITIES,
        default=DEFAULT_PRIORITY,
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
        help="set a key's own limits, which narrow its tenant's (replacing the old), or --clear",
    )
    p.add_argument("key_id", help="the key's id, as `keys list` shows it (key_...)")
    _limit_args(p)
    _state_dir_arg(p)
    p.set_defaults(func=_keys_set_limits)


def _add_admin_plane(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`admin-tokens` and `audit-log` (docs/admin-api.md)."""
    tokens = sub.add_parser(
        "admin-tokens",
        help="create, list and revoke admin tokens (the admin API's; docs/admin-api.md)",
    )
    asub = tokens.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = asub.add_parser("create", help="mint an admin token (printed once, stored as a hash)")
    p.add_argument(
        "--scopes", required=True, help="comma-separated scopes, or all (docs/admin-api.md)"
    )
    p.add_argument("--tenant", help="pin the token to this tenant (name or id)")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_create)
    p = asub.add_parser("list", help="list admin tokens (never the tokens), with last use")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_list)
    p = asub.add_parser("revoke", help="revoke an admin token by its id (refused at once)")
    p.add_argument("token_id", help="the token's id, as `admin-tokens list` shows it (adm_...)")
    _state_dir_arg(p)
    p.set_defaults(func=_admin_tokens_revoke)

    log = sub.add_parser("audit-log", help="check the audit log's hash chain")
    lsub = log.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = lsub.add_parser(
        "verify",
        help="recompute the chain of hashes; exit status 1 naming the first broken entry",
    )
    p.add_argument(
        "--expect",
        metavar="SEQ:HASH",
        help="a head kept outside the store (printed by an earlier verify): entry SEQ must "
        "still have HASH, so entries cut from the end are detected",
    )
    _state_dir_arg(p)
    p.set_defaults(func=_audit_log_verify)


def _add_prices(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`prices`: the store's prices, over the config's [prices] (docs/billing.md)."""
    prices = sub.add_parser(
        "prices",
        help="list the prices in effect, set a model's in the store (over the config's), "
        "or clear it",
    )
    psub = prices.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = psub.add_parser("list", help="every priced model: USD per million tokens, version, source")
    _state_dir_arg(p)
    p.set_defaults(func=_prices_list)
    p = psub.add_parser(
        "set", help="set a model's price in the store; gateways bill with it within a second"
    )
    p.add_argument("model", help="the model's name, as requests give it")
    for option, what in (
        ("--input", "uncached input"),
        ("--cached-input", "cached input"),
        ("--output", "output"),
    ):
        p.add_argument(
            option, required=True, help=f"USD per million {what} tokens (at most 6 decimals)"
        )
    _state_dir_arg(p)
    p.set_defaults(func=_prices_set)
    p = psub.add_parser(
        "clear", help="delete a model's store price: the config's applies again (or none)"
    )
    p.add_argument("model", help="the model's name")
    _state_dir_arg(p)
    p.set_defaults(func=_prices_clear)


def _limit_args(p: argparse.ArgumentParser) -> None:
    """The options of `tenants set-limits` and `keys set-limits` (docs/limits.md)."""
    p.add_argument("--rpm", type=int, help="requests in any 60 s window")
    p.add_argument("--input-tpm", type=int, help="uncached input tokens in any 60 s window")
    p.add_argument("--output-tpm", type=int, help="output tokens in any 60 s window")
    p.add_argument("--concurrency", type=int, help="requests in flight at once")
    p.add_argument("--budget-usd", help="spend in any --budget-period, priced as billed")
    p.add_argument("--budget-period", help="the budget's period, e.g. 30d, 7d, 24h")
    p.add_argument(
        "--weight",
        help="a tenant's fair share of saturated replicas (default 1; 2: twice a tenant of "
        "1's; tenants only, docs/fairness.md)",
    )
    p.add_argument(
        "--clear",
        action="append",
        nargs="?",
        const="all",
        metavar="KIND",
        help="remove one kind: rpm, input_tpm, output_tpm, concurrency, budget, weight "
        "(repeatable); alone and without KIND: every limit. Kinds not named are kept",
    )


def _add_usage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "usage",
        help="usage and recorded cost per tenant (or --group-by); docs/billing.md",
    )
    _state_dir_arg(p)
    p.add_argument(
        "--since", help="from (inclusive): a duration back (24h, 7d) or an ISO date/time, UTC"
    )
    p.add_argument(
        "--until", help="to (exclusive): a duration back or an ISO date/time, UTC (default: no end)"
    )
    p.add_argument(
        "--group-by",
        default="tenant",
        help="any of tenant,key,model,day, comma-separated",
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument(
        "--json", action="store_const", const="json", dest="fmt", help="JSON instead of a table"
    )
    fmt.add_argument(
        "--csv", action="store_const", const="csv", dest="fmt", help="CSV instead of a table"
    )
    p.set_defaults(func=_usage, fmt="table")
    usub = p.add_subparsers(
        dest="action", metavar="prune", help="optional: delete old records (prune --help)"
    )
    p = usub.add_parser(
        "prune",
        help="delete usage records older than a date (export them first; docs/upgrading.md)",
        description="Deletes the usage records with ts < --before. Without --yes it only says "
        "how many would go. Export them first: saltgate usage --until DATE --csv.",
    )
    p.add_argument(
        "--before",
        required=True,
        metavar="DATE",
        help="delete records before this (exclusive): an ISO date/time, UTC, or a duration "
        "back (400d)",
    )
    p.add_argument("--yes", action="store_true", help="delete (default: only count)")
    p.add_argument(
        "--force",
        action="store_true",
        help=f"allow a --before within the last {PRUNE_PROTECTED_DAYS} days",
    )
    _state_dir_arg(p, nested=True)
    p.set_defaults(func=_usage_prune)


def _add_store(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    store = sub.add_parser("store", help="copy a store to another (SQLite, PostgreSQL)")
    ssub = store.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ssub.add_parser(
        "copy",
        help="copy tenants, hashed keys, prices and usage into a new store",
        description="Copies tenants, hashed API keys (every key keeps working), prices and "
        "the usage ledger from one store to another, in one transaction on the destination, "
        "then counts both. A PostgreSQL password comes from the --*-password-* options, or "
        "as libpq finds it (PGPASSWORD, ~/.pgpass), never from the URL. docs/upgrading.md.",
    )
    for end, what in (("from", "the store to copy"), ("to", "the new store")):
        p.add_argument(
            f"--{end}",
            required=True,
            metavar="URL",
            help=f"{what}: sqlite:///path/saltgate.db or postgresql://user@host:5432/db",
        )
        pw = p.add_mutually_exclusive_group()
        pw.add_argument(f"--{end}-password-file", metavar="FILE", help="its password, in a file")
        pw.add_argument(
            f"--{end}-password-env", metavar="VAR", help="its password, in this variable"
        )
    p.add_argument(
        "--since",
        metavar="T",
        help="a second pass: only usage from then on (a duration back or an ISO date/time, "
        "UTC), into the store an earlier copy filled; rows already there are skipped",
    )
    p.set_defaults(func=_store_copy)


def _run_serve(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError, load_config
    from saltgate.runtime import StartError
    from saltgate.store.errors import StoreError

    if args.workers < 1:
        print("saltgate serve: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        config = load_config(args.config)
        if args.check:  # like `nginx -t`: the files only, never the network
            from saltgate.serving.check import check_config

            print(f"saltgate: config {args.config} is valid ({check_config(config)})")
            return 0
    except (ConfigError, StoreError) as exc:
        print(f"saltgate serve: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:  # --check: a port taken now
        print(f"saltgate serve: {exc.strerror}", file=sys.stderr)
        return 1
    if args.workers > 1:
        from saltgate.serving.supervisor import serve_workers

        return serve_workers(config, args.workers)
    from saltgate.serving.run import serve

    return serve(config)


def _run_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from saltgate.demo import up

    if args.replicas < 1:
        print("saltgate up: --replicas must be at least 1", file=sys.stderr)
        return 2
    return up(args.port, args.replicas, Path(args.state_dir))


def _store_settings(args: argparse.Namespace) -> tuple[StoreSettings, GatewayConfig | None]:
    """The store the admin commands work on, and the config file if one was given."""
    from pathlib import Path

    from saltgate.config import ConfigError, load_config
    from saltgate.store.settings import StoreSettings

    config = load_config(args.config) if args.config else None
    if args.state_dir is None:
        if config is not None:
            return config.store_settings, config
        return StoreSettings.in_state_dir(Path(".state")), None
    if config is not None and config.store is not None:
        raise ConfigError(
            f"--state-dir: {args.config} names its store ({config.store.describe()}); "
            "give --config or --state-dir, not both"
        )
    return StoreSettings.in_state_dir(Path(args.state_dir)), config


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
            f"\tlimits {_limits_label(t.limits)}" + ("" if t.archived_at is None else "\tarchived")
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
        t = await service.tenants_limits(caller, args.name, _limits_from_args(args))
        return f"tenant {t.name} limits {_limits_label(t.limits)}"

    return _with_service(args, apply)


def _keys_set_limits(args: argparse.Namespace) -> int:
    async def apply(service: AdminService, caller: Caller) -> str:
        k = await service.keys_limits(caller, args.key_id, _limits_from_args(args))
        return f"key {k.id} limits {_limits_label(k.limits)}"

    return _with_service(args, apply)


def _limits_from_args(args: argparse.Namespace) -> LimitsChange:
    """The change the options give: an edit (the limits named set, the kinds in --clear
    removed, every other kept), or none at all for a bare --clear; through the parser the
    API and the console use. ConfigError (one line on stderr) when wrong."""
    from saltgate.config import ConfigError
    from saltgate.governance.limits import parse_limits_edit

    given = {
        "rpm": args.rpm,
        "input_tpm": args.input_tpm,
        "output_tpm": args.output_tpm,
        "concurrency": args.concurrency,
        "budget_usd": args.budget_usd,
        "budget_period": args.budget_period,
        "weight": args.weight,
    }
    named = {k: v for k, v in given.items() if v not in (None, "")}
    clear = set(args.clear or ())
    if "all" in clear:
        if named or len(clear) > 1:
            raise ConfigError("set-limits: give --clear alone to remove every limit")
        return None
    if not named and not clear:
        raise ConfigError(
            "set-limits: give at least one of --rpm, --input-tpm, --output-tpm, "
            "--concurrency, --budget-usd, --budget-period, --weight, --clear"
        )
    try:
        return parse_limits_edit(named, clear)
    except ValueError as exc:
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


_PAGE = 100  # the service's pages, read to the end for a command's whole list


async def _every(page: Callable[[str], Awaitable[Page[T]]], last_id: Callable[[T], str]) -> list[T]:
    """Every item of a keyset-paged list of the admin service."""
    items: list[T] = []
    after = ""
    while True:
        found = await page(after)
        items += found.items
        if not found.has_more or not found.items:
            return items
        after = last_id(found.items[-1])


def _with_service(
    args: argparse.Namespace, action: Callable[[AdminService, Caller], Awaitable[str]]
) -> int:
    """Run an admin operation as the local operator (saltgate.admin.service: the API's
    and the console's rules, every scope, unpinned); a refusal or a store error is one
    line on stderr and exit status 1. The audit log names each change's author: the CLI
    and the OS user running it."""
    import asyncio

    from saltgate.admin.service import AdminService, Caller
    from saltgate.admin.store import AdminStore
    from saltgate.config import ConfigError
    from saltgate.policy.errors import ApiError
    from saltgate.store.errors import StoreError

    async def run(settings: StoreSettings, config: GatewayConfig | None) -> str:
        store = AdminStore(settings)
        try:
            prices = None if config is None else config.prices
            return await action(AdminService(store, None, prices), Caller.operator())
        finally:
            await store.aclose()

    try:
        out = asyncio.run(run(*_store_settings(args)))
    except (StoreError, ConfigError, ValueError, ApiError) as exc:
        print(f"saltgate {args.command}: {exc}", file=sys.stderr)
        return 1
    if out:
        print(printable(out))
    return 0


def printable(text: str) -> str:
    """Text safe for a terminal: control and format characters (escapes, bidi overrides)
    are shown escaped (\\x1b, \\u202e), tabs and newlines kept as the layout's own. A
    stored name can come from a tenant's pinned token: it must not drive the terminal."""
    import unicodedata

    return "".join(
        c if c in "\t\n" or unicodedata.category(c)[0] != "C" else ascii(c)[1:-1] for c in text
    )


def _admin_tokens_create(args: argparse.Namespace) -> int:
    from saltgate.admin.scopes import parse_scopes

    async def create(service: AdminService, caller: Caller) -> str:
        scopes = parse_scopes(args.scopes)
        minted = await service.admin_tokens_create(caller, scopes, args.tenant)
        pinned = "" if args.tenant is None else f", pinned to {args.tenant}"
        print(f"created {minted.token.id} ({','.join(sorted(scopes))}{pinned})", file=sys.stderr)
        return minted.value

    return _with_service(args, create)


def _admin_tokens_list(args: argparse.Namespace) -> int:
    from datetime import UTC, datetime

    def when(ts: float | None) -> str:
        return "never" if ts is None else datetime.fromtimestamp(ts, UTC).isoformat("T", "seconds")

    async def show(service: AdminService, caller: Caller) -> str:
        rows = []
        tokens = await _every(
            lambda after: service.admin_tokens_list(caller, after=after, limit=_PAGE),
            lambda t: t.id,
        )
        for t in tokens:
            state = "revoked" if t.revoked_at is not None else "active"
            rows.append(
                f"{t.id}\t{t.to_dict()['redacted_value']}\t{state}\tscopes "
                f"{','.join(sorted(t.scopes))}\ttenant {t.tenant_id or 'all'}"
                f"\tlast used {when(t.last_used_at)}"
            )
        return "\n".join(rows)

    return _with_service(args, show)


def _admin_tokens_revoke(args: argparse.Namespace) -> int:
    async def revoke(service: AdminService, caller: Caller) -> str:
        return f"revoked {(await service.admin_tokens_revoke(caller, args.token_id)).id}"

    return _with_service(args, revoke)


def _price_line(price: dict[str, object]) -> str:
    return (
        f"{price['model']}\tinput {price['input_per_mtok']}\tcached_input "
        f"{price['cached_input_per_mtok']}\toutput {price['output_per_mtok']}\t"
        f"{price['version']}\t{price['source']}"
    )


def _prices_list(args: argparse.Namespace) -> int:
    async def show(service: AdminService, caller: Caller) -> str:
        return "\n".join(_price_line(p.to_dict()) for p in await service.prices_list(caller))

    return _with_service(args, show)


def _prices_set(args: argparse.Namespace) -> int:
    from saltgate.prices import price_from_fields

    async def apply(service: AdminService, caller: Caller) -> str:
        price = price_from_fields(
            {
                "input_per_mtok": args.input,
                "cached_input_per_mtok": args.cached_input,
                "output_per_mtok": args.output,
            }
        )
        return _price_line((await service.prices_set(caller, args.model, price)).to_dict())

    return _with_service(args, apply)


def _prices_clear(args: argparse.Namespace) -> int:
    async def apply(service: AdminService, caller: Caller) -> str:
        await service.prices_clear(caller, args.model)
        return f"cleared the store's price of {args.model}"

    return _with_service(args, apply)


def _audit_log_verify(args: argparse.Namespace) -> int:
    from saltgate.config import ConfigError
    from saltgate.store.audit import expected_head, head_problem, verify_chain
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError

    try:
        expect = None if args.expect is None else expected_head(args.expect)
        settings, _ = _store_settings(args)
        db = open_database(settings, create=False)
        try:
            check = verify_chain(db)
            problem = None if expect is None else head_problem(db, check, expect)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate audit-log verify: {exc}", file=sys.stderr)
        return 1
    if not check.ok:
        print(
            f"saltgate audit-log verify: entry {check.broken_seq} is broken: {check.reason} "
            f"({check.checked} entries before it are intact)",
            file=sys.stderr,
        )
        return 1
    if problem is not None:
        print(f"saltgate audit-log verify: {problem}", file=sys.stderr)
        return 1
    keyed = (
        f"keyed from entry {check.keyed_from}"
        if check.keyed_from is not None
        else "NOT keyed (written without the master key: rewriting it is not detected)"
    )
    head = "" if check.head is None else f"; head {check.head[0]}:{check.head[1].hex()}"
    print(f"audit log intact: {check.checked} entries, {keyed}{head}")
    return 0


def _usage(args: argparse.Namespace) -> int:
    import time

    from saltgate.config import ConfigError
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.pricing import format_usage, parse_group_by, parse_time, usage_report

    try:
        settings, config = _store_settings(args)
        now = time.time()
        since = parse_time(args.since, now, "--since") if args.since else None
        until = parse_time(args.until, now, "--until") if args.until else None
        if since is not None and until is not None and since >= until:
            raise ValueError("--since must be before --until (the range is [since, until))")
        group_by = parse_group_by(args.group_by)
        db = open_database(settings, create=False)
        try:
            prices = config.prices if config is not None else {}
            rows = usage_report(db, since, prices, until=until, group_by=group_by)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate usage: {exc}", file=sys.stderr)
        return 1
    print(format_usage(rows, args.fmt, group_by))
    return 0


PRUNE_PROTECTED_DAYS = 31  # `usage prune` keeps the last month unless --force


def _usage_prune(args: argparse.Namespace) -> int:
    import time
    from datetime import UTC, datetime

    from saltgate.config import ConfigError
    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.lifecycle import count_usage_before, prune_usage
    from saltgate.store.pricing import parse_time

    try:
        settings, _ = _store_settings(args)
        now = time.time()
        before = parse_time(args.before, now, "--before")
        if before > now:
            raise ValueError(f"--before {args.before!r} is in the future")
        if before > now - PRUNE_PROTECTED_DAYS * 86400 and not args.force:
            raise ValueError(
                f"--before {args.before!r} is within the last {PRUNE_PROTECTED_DAYS} days, "
                "which may not be billed yet; give --force to prune it anyway"
            )
        when = datetime.fromtimestamp(before, UTC).isoformat()
        db = open_database(settings, create=False)
        try:
            if not args.yes:
                n = count_usage_before(db, before)
                print(
                    f"{n} usage records before {when} would be deleted from "
                    f"{db.describe()}. Export them first (saltgate usage --until "
                    f"{args.before} --csv), then run again with --yes."
                )
                return 0
            result = prune_usage(db, before)
        finally:
            db.close()
    except (ConfigError, StoreError, ValueError) as exc:
        print(f"saltgate usage prune: {exc}", file=sys.stderr)
        return 1
    longest_ms = result.longest_transaction_s * 1e3
    print(
        f"deleted {result.deleted} usage records before {when} in {result.seconds:.1f} s "
        f"({len(result.held_s)} transactions, the longest {longest_ms:.1f} ms)"
    )
    return 0


def _store_copy(args: argparse.Namespace) -> int:
    import time
    from datetime import UTC, datetime
    from pathlib import Path

    from saltgate.store.backends import open_database
    from saltgate.store.errors import StoreError
    from saltgate.store.lifecycle import copy_store
    from saltgate.store.pricing import parse_time
    from saltgate.store.settings import StoreSettings

    def settings(end: str) -> StoreSettings:
        table = {"url": getattr(args, end)}
        for key in ("password_file", "password_env"):
            if (value := getattr(args, f"{end}_{key}")) is not None:
                table[key] = value
        try:
            return StoreSettings.from_table(table, Path.cwd(), Path.cwd())
        except ValueError as exc:
            raise ValueError(f"--{end}: {exc}") from None

    def iso(ts: float) -> str:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")

    try:
        source, destination = settings("from"), settings("to")
        if _same_store(source, destination):
            raise ValueError("--from and --to name the same store")
        since = parse_time(args.since, time.time(), "--since") if args.since else None
        src = open_database(source, create=False)
        try:
            dst = open_database(destination)
            try:
                result = copy_store(src, dst, since=since)
            finally:
                dst.close()
        finally:
            src.close()
    except (StoreError, ValueError) as exc:
        print(f"saltgate store copy: {exc}", file=sys.stderr)
        return 1
    print(f"copied {source.describe()} -> {destination.describe()}")
    scope = "" if since is None else f" (usage: ts >= {iso(since)})"
    print(f"{'table':<10} {'source':>12} {'destination':>12}{scope}")
    for c in result.counts:
        print(f"{c.table:<10} {c.source:>12} {c.destination:>12}")
    print("verified: the destination holds every row copied")
    if result.source_gained:
        print(
            f"the source gained {result.source_gained} usage records during the copy: stop "
            "its gateways or point them at the new store, then copy them too"
        )
    # An hour of overlap: rows committed late (a group commit, a spool replay) keep an
    # earlier ts, and rows already copied are skipped anyway.
    since_next = iso(result.started_at - 3600)
    print(f"a second pass copies what the source gains from now: --since {since_next}")
    return 0


def _same_store(a: StoreSettings, b: StoreSettings) -> bool:
    if a.sqlite_path is not None and b.sqlite_path is not None:
        return a.sqlite_path.resolve() == b.sqlite_path.resolve()
    return a.url == b.url


def _add_kv_relay(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "kv-relay",
        help="relay the replicas' KV events, sanitised, to authenticated consumers",
        description="Either --config FILE (the gateway's: replicas' kv_events_* and "
        "[kv_relay]) or the options below. See docs/kv-relay.md.",
    )
    p.add_argument("--config", help="gateway TOML file with a [kv_relay] section")
    p.add_argument("--master-key-file", help="the cluster's master key (without --config)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="ENDPOINT[,REPLAY]",
        help="a replica's KV-event endpoint (and its replay endpoint); repeat per replica",
    )
    p.add_argument("--publish", help="where consumers subscribe, e.g. tcp://127.0.0.1:5600")
    p.add_argument("--replay", help="where consumers ask for replay, e.g. tcp://127.0.0.1:5601")
    p.add_argument(
        "--client-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a consumer's public key, written --client-key=KEY (a Z85 key may begin with '-')",
    )
    p.add_argument("--client-keys-file", help="consumers' public keys, one per line")
    p.add_argument("--replay-window", type=int, help="messages kept for replay")
    p.add_argument(
        "--print-server-key", action="store_true", help="print the public key consumers pin"
    )
    p.add_argument(
        "--allow-plaintext-upstream",
        action="store_true",
        help="accept --upstream endpoints off loopback (no CURVE: salts in clear)",
    )
    p.set_defaults(func=_run_kv_relay)


def _kv_relay_from_args(
    args: argparse.Namespace,
) -> tuple[Path, list[KvUpstream], KvRelaySettings | None]:
    """(master key file, upstreams, settings) from --config or the options; ValueError.

    The settings are None when only --print-server-key was asked for without --config.
    """
    from pathlib import Path

    from saltgate.config import kv_plaintext_remote, kv_relay_settings, load_config
    from saltgate.kvevents.settings import KvUpstream

    if args.config:
        config = load_config(args.config)
        if config.kv_relay is None:
            raise ValueError(f"{args.config} has no [kv_relay] section")
        upstreams = [u for r in config.replicas if (u := r.kv_upstream) is not None]
        return config.master_key_file, upstreams, config.kv_relay
    if not args.master_key_file:
        raise ValueError("give --config FILE, or --master-key-file with the other options")
    key_file = Path(args.master_key_file)
    if args.print_server_key:
        return key_file, [], None
    upstreams = []
    for item in args.upstream:
        endpoint, _, replay = item.partition(",")
        upstreams.append(KvUpstream(endpoint, replay or None))
    if not upstreams:
        raise ValueError("--upstream: give at least one replica's KV-event endpoint")
    remote = [u.endpoint for u in upstreams if kv_plaintext_remote(u)]
    if remote and not args.allow_plaintext_upstream:
        raise ValueError(
            f"--upstream {remote[0]}: off loopback without CURVE, salts and token ids cross "
            "in clear; pin a forwarder's key with --config (kv_events_curve_server_key_file) "
            "or pass --allow-plaintext-upstream"
        )
    table: dict[str, object] = {
        "publish_endpoint": args.publish,
        "replay_endpoint": args.replay,
        "client_keys": args.client_key,
    }
    if args.client_keys_file:
        table["client_keys_file"] = args.client_keys_file
    if args.replay_window is not None:
        table["replay_window"] = args.replay_window
    return key_file, upstreams, kv_relay_settings(table, Path.cwd())


def _run_kv_relay(args: argparse.Namespace) -> int:
    import signal
    import threading

    from saltgate.config import load_master_key
    from saltgate.derivations.derive import derive_subkeys
    from saltgate.kvevents.relay import KvRelay, relay_server_keys

    try:
        key_file, upstreams, settings = _kv_relay_from_args(args)
        k_kv = derive_subkeys(load_master_key(key_file)).kv_events
        if args.print_server_key or settings is None:
            print(relay_server_keys(k_kv).public)
            return 0
        relay = KvRelay(upstreams, k_kv, settings)
        relay.start()
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        print(f"saltgate kv-relay: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"saltgate kv-relay: {relay.describe()}", flush=True)
    while not stop.wait(0.5):
        pass
    relay.close()
    return 0


PROXY_API_KEY_ENV = "SALTGATE_API_KEY"  # where `saltgate proxy` reads its key by default


def _add_proxy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "proxy",
        help="a loopback OpenAI-compatible proxy adding client-keyed caching (EHBP + secret)",
    )
    p.add_argument("--upstream", required=True, help="the gateway's URL (without /v1)")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the tenant API key to send upstream (default: ${PROXY_API_KEY_ENV}, which "
        "unlike an argument is not visible to other local users in the process list)",
    )
    p.add_argument("--port", type=int, default=8788, help="loopback port to listen on")
    p.add_argument(
        "--pin",
        action="append",
        default=[],
        help="accept only this gateway key fingerprint (sha256:...; repeatable); "
        "without it the first key seen is trusted and recorded",
    )
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: argparse.Namespace) -> int:
    from saltgate.client.proxy import ProxyConfig, serve_proxy

    api_key = args.api_key or os.environ.get(PROXY_API_KEY_ENV)
    if not api_key:
        print(
            f"saltgate proxy: no API key: set {PROXY_API_KEY_ENV} (or pass --api-key)",
            file=sys.stderr,
        )
        return 2
    config = ProxyConfig(args.upstream, api_key, args.port, pin=tuple(args.pin))
    return serve_proxy(config)


def _add_audit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.audit.command import add_audit_parser

    add_audit_parser(sub)


class _Version(argparse.Action):
    """`--version`: the version and which build runs (saltgate/buildinfo.py), looked up
    only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from saltgate import __version__
        from saltgate.buildinfo import describe

        print(f"saltgate {__version__} ({describe()})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="saltgate", description="A secure prompt-caching gateway for multi-tenant LLMs."
    )
    parser.add_argument(
        "--version", action=_Version, nargs=0, help="the version, and whether it is compiled"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_gateway(sub)
    _add_admin(sub)
    _add_admin_plane(sub)
    _add_prices(sub)
    _add_usage(sub)
    _add_store(sub)
    _add_needing_modules(sub, "sim", _add_sim)
    _add_kv_relay(sub)
    _add_proxy(sub)
    _add_audit(sub)
    return parser


# The install that brings what a command needs (pyproject.toml, docs/install.md): a tool's
# extra, or else the server's dependencies, which saltgate-client leaves out.
SERVER_INSTALL = "saltgate"
TOOL_EXTRAS = {
    "audit": ("numpy", "scipy", "matplotlib", "tqdm"),
}


def install_hint(command: str) -> str:
    extra = f"saltgate[{command}]" if command in TOOL_EXTRAS else SERVER_INSTALL
    return f"pip install '{extra}'"


def _missing_module(command: str, module: str) -> int:
    print(
        f"saltgate {command}: needs {module}, not installed: {install_hint(command)}",
        file=sys.stderr,
    )
    return 2


def _add_needing_modules(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    add: Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None],
) -> None:
    """Add a command whose arguments come from modules that need the server's dependencies;
    without them (saltgate-client) the command is still listed and says what to install."""
    try:
        add(sub)
    except ModuleNotFoundError as exc:
        if not _third_party(exc):
            raise
        missing = _library(exc)
        p = sub.add_parser(name, help=f"(not installed: {install_hint(name)})", add_help=False)
        # Whatever follows (--help too) gets the same answer: main lets it through.
        p.set_defaults(func=lambda _: _missing_module(name, missing), any_arguments=True)


def _library(exc: ModuleNotFoundError) -> str:
    return str(exc.name).partition(".")[0]


def _third_party(exc: ModuleNotFoundError) -> bool:
    """A library left out of this install, not a saltgate module (that would be a bug)."""
    return exc.name is not None and _library(exc) != "saltgate"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # as parse_args does
    func: Command = args.func
    # Checked before the tool starts: it would otherwise fail after minutes of work.
    for module in TOOL_EXTRAS.get(args.command, ()):
        if importlib.util.find_spec(module) is None:
            return _missing_module(args.command, module)
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as exc:
        if not _third_party(exc):
            raise
        return _missing_module(args.command, _library(exc))


if __name__ == "__main__":
    sys.exit(main())
