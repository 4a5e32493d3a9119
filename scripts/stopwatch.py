"""Time the steps of `make test` and print them as a table (docs/testing.md keeps the budget).

    stopwatch.py FILE NAME -- COMMAND...   run COMMAND; add NAME, its seconds and exit status
                                           to FILE; if it failed, print the table and fail too
    stopwatch.py FILE --table              print FILE's steps and their total

The standard library only: it runs before the project's environment exists.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ONE_TIME = "one-time setup"  # a step the budget leaves out once done (docs/testing.md)


def record(steps: Path, name: str, command: list[str]) -> int:
    started = time.monotonic()
    status = subprocess.call(command)  # noqa: S603 - the Makefile's own commands
    steps.parent.mkdir(parents=True, exist_ok=True)
    with steps.open("a") as out:
        out.write(f"{name}\t{time.monotonic() - started:.1f}\t{status}\n")
    if status != 0:
        print_table(steps)
    return status


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {round(seconds % 60):02d} s"


def print_table(steps: Path) -> None:
    rows = [line.split("\t") for line in steps.read_text().splitlines() if line]
    budgeted_label = f"in all but the {ONE_TIME}"
    width = max(len(budgeted_label), *(len(name) for name, _, _ in rows))
    print(f"\n{steps.name}: each step's wall time")
    for name, seconds, status in rows:
        failed = "" if status == "0" else f"  FAILED (exit {status})"
        print(f"  {name:<{width}}  {float(seconds):7.1f} s{failed}")
    total = sum(float(seconds) for _, seconds, _ in rows)
    budgeted = sum(float(seconds) for name, seconds, _ in rows if name != ONE_TIME)
    print(f"  {'in all':<{width}}  {total:7.1f} s  ({minutes(total)})")
    print(f"  {budgeted_label:<{width}}  {budgeted:7.1f} s  ({minutes(budgeted)})")


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "--table":
        print_table(Path(argv[0]))
        return 0
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    return record(Path(argv[0]), argv[1], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
