"""What every command group shares: the parser classes, the store and service helpers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from saltgate.admin.service import AdminService, Caller, Page
    from saltgate.config import GatewayConfig
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
        help="directory holding saltgate.db, without --config (default: .state, if it "
        "holds one; none is created)",
    )


def _store_settings(args: argparse.Namespace) -> tuple[StoreSettings, GatewayConfig | None]:
    """The store the admin commands work on, and the config file if one was given."""
    from pathlib import Path

    from saltgate.config import ConfigError, load_config
    from saltgate.store.settings import StoreSettings

    config = load_config(args.config) if args.config else None
    if args.state_dir is None:
        if config is not None:
            return config.store_settings, config
        default = StoreSettings.in_state_dir(Path(DEFAULT_STATE_DIR))
        if default.sqlite_path is None or not default.sqlite_path.exists():
            # A fresh store here would not be the gateway's: a token or key made in it
            # would be refused there (issue 43). Only an existing one is taken by default.
            raise ConfigError(
                f"no store named and none in ./{DEFAULT_STATE_DIR}: give --config FILE (the "
                "gateway's configuration) or --state-dir DIR; nothing was created"
            )
        return default, None
    if config is not None and config.store is not None:
        raise ConfigError(
            f"--state-dir: {args.config} names its store ({config.store.describe()}); "
            "give --config or --state-dir, not both"
        )
    return StoreSettings.in_state_dir(Path(args.state_dir)), config


DEFAULT_STATE_DIR = ".state"  # the gateway's default state_dir, beside its config
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
        return store_exit_status(exc)
    if out:
        print(printable(out))
    return 0


def store_exit_status(error: Exception) -> int:
    """A command's exit status on an error: 2 for a store at another schema version (as
    for a configuration error: a restart will not fix it; `saltgate store migrate` or
    another saltgate will), else 1."""
    from saltgate.store.errors import SchemaVersionError

    return 2 if isinstance(error, SchemaVersionError) else 1


def printable(text: str) -> str:
    """Text safe for a terminal: control and format characters (escapes, bidi overrides)
    are shown escaped (\\x1b, \\u202e), tabs and newlines kept as the layout's own. A
    stored name can come from a tenant's pinned token: it must not drive the terminal."""
    import unicodedata

    return "".join(
        c if c in "\t\n" or unicodedata.category(c)[0] != "C" else ascii(c)[1:-1] for c in text
    )
