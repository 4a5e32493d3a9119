"""The `saltgate-bench` command: one sub-command per benchmark (docs/benchmarks.md).

Each benchmark module gives HELP, add_arguments(parser) and run(args). Its parsers are
saltgate's (saltgate.cli.Parser), so `--help` shows every default as `saltgate`'s does.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from saltgate.cli.common import Parser

BENCHMARKS = {
    "replay": "saltgate_bench.replay",
    "fairness": "saltgate_bench.fairness",
    "overhead": "saltgate_bench.overhead",
    "sim-capacity": "saltgate_bench.sim_capacity",
    "limits": "saltgate_bench.limits",
    "usage-queries": "saltgate_bench.usage_queries",
}


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = Parser(
        prog="saltgate-bench", description="saltgate's benchmarks (docs/benchmarks.md)."
    )
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.func
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
