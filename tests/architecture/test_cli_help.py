"""`saltgate ... --help` describes every argument of every command and shows its default.

The walk covers every sub-parser `build_parser()` makes (the tools' too: audit), and
`saltgate-bench`'s (benchmarks/), so an argument added without a help text, or a parser
made without saltgate's formatter, fails here rather than reaching an operator as a bare
`--foo FOO`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from saltgate.cli import build_parser
from saltgate.cli.common import HelpFormatter, Parser
from saltgate_bench.cli import build_parser as build_bench_parser

pytestmark = pytest.mark.unit


def parsers(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command path, parser) of ``parser`` and every sub-parser under it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def undocumented(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """What --help would show bare: arguments and sub-commands without a help text, and
    parsers that would not show defaults."""
    found = []
    for where, p in parsers(parser, path):
        if p.formatter_class is not HelpFormatter:
            name = getattr(p.formatter_class, "__name__", repr(p.formatter_class))
            found.append(f"{where}: formatter {name}")
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {a.dest for a in action._choices_actions if a.help}
                found += [f"{where} {name}" for name in action.choices if name not in helped]
            elif not isinstance(action, argparse._HelpAction) and not action.help:
                found.append(f"{where}: {'/'.join(action.option_strings) or action.dest}")
    return found


def test_every_argument_of_every_command_has_a_help_text_and_its_default() -> None:
    assert undocumented(build_parser(), "saltgate") == []
    assert undocumented(build_bench_parser(), "saltgate-bench") == []


def test_help_shows_a_default_once_and_only_when_there_is_one() -> None:
    commands = dict(parsers(build_parser(), "saltgate"))
    sim = commands["saltgate sim"].format_help()
    assert sim.count("(default: 8100)") == 1  # --port
    assert "(default: None)" not in sim  # --api-key has none to show
    serve = commands["saltgate serve"].format_help()
    assert "(default: 1)" in serve  # --workers
    assert "(default: False)" not in serve  # --check is a switch


def test_an_undocumented_argument_is_caught() -> None:
    """Positive control: the walk finds a bare argument, a bare sub-command and a parser
    made without the formatter, however deep."""
    parser = Parser(prog="x")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("documented", help="has help")
    p.add_argument("--fine", default=1, help="described")
    p.add_argument("--bare", default=2)
    inner = p.add_subparsers(dest="action")
    inner.add_parser("quiet")
    sub.add_parser("plain", help="made by hand", formatter_class=argparse.HelpFormatter)
    assert undocumented(parser, "x") == [
        "x documented: --bare",
        "x documented quiet",
        "x plain: formatter HelpFormatter",
    ]
