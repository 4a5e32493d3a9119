"""The `saltgate` command: one entry point, a subcommand per tool (a module per command group)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence

from saltgate.cli.admin_tokens import _add_admin_plane
from saltgate.cli.common import Command, Parser
from saltgate.cli.epp import _add_epp
from saltgate.cli.prices import _add_prices
from saltgate.cli.relay import _add_kv_relay, _add_proxy
from saltgate.cli.serving import _add_gateway, _add_sim
from saltgate.cli.tenants import _add_admin
from saltgate.cli.usage import _add_store, _add_usage


def _add_audit(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from saltgate.audit.command import add_audit_parser

    add_audit_parser(sub)


class _Version(argparse.Action):
    """`--version`: the version, which build runs (saltgate/buildinfo.py) and the store
    schema it reads and writes (what `store status` compares a store with before an
    upgrade), looked up only when asked."""

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from saltgate import __version__
        from saltgate.buildinfo import describe
        from saltgate.store.schema import SCHEMA_VERSION

        print(f"saltgate {__version__} ({describe()}; store schema {SCHEMA_VERSION})")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="saltgate", description="A secure prompt-caching gateway for multi-tenant LLMs."
    )
    parser.add_argument(
        "--version",
        action=_Version,
        nargs=0,
        help="the version, whether it is compiled, and its store schema",
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
    _add_epp(sub)
    return parser


# The install that brings what a command needs (pyproject.toml, docs/install.md): a tool's
# extra, or else the server's dependencies, which saltgate-client leaves out.
SERVER_INSTALL = "saltgate"
TOOL_EXTRAS = {
    "audit": ("numpy", "scipy", "matplotlib", "tqdm", "yaml"),
    "epp": ("grpc", "grpc_health", "xds"),
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
    # Checked before the tool starts: it would otherwise fail after minutes of work. An
    # action that runs on the runtime install alone (`audit deployment`) says so.
    extra = () if getattr(args, "runtime_only", False) else TOOL_EXTRAS.get(args.command, ())
    for module in extra:
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
