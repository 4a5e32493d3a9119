#!/usr/bin/env python3
"""Hunt flaky tests: run the suite (or a selection) N times and count each test's failures.

A test that fails one run in twenty blocks landings at random and teaches everyone to read
red as noise, so a change that touches timing is run many times before it is trusted, some
of the runs beside CPU hogs (CI's machine is as busy as a developer's). Each run is a fresh
pytest process writing a JUnit report; the table at the end names every test that failed
at least once, with its failures out of N and the first line of its first failure.

    python3 scripts/flakes.py --runs 10 --hogs 2 -- tests/kvevents -m "not vllm"
    make flakes RUNS=10 HOGS=2 SELECT="tests/kvevents"

`--build pure|compiled` sets SALTGATE_EXPECT_BUILD, which the suite checks against the
build installed in .venv (install the other one first: `make install-compiled`).
`--json FILE` writes every run's outcome per test, for comparing a hunt before and after.
Exit status: 0 when every run passed, 1 when any test failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_S = 30.0
"""A test slower than this must say why (docs/testing.md); the report lists each one."""


@dataclass
class Outcome:
    """One test's result in one run."""

    passed: bool
    seconds: float
    message: str = ""


@dataclass
class Run:
    """One pytest process: its exit status, wall time and every test's outcome."""

    index: int
    status: int
    seconds: float
    outcomes: dict[str, Outcome] = field(default_factory=dict)


def test_id(case: ET.Element) -> str:
    """The pytest node id of a JUnit test case (xunit1 keeps the file)."""
    name = case.get("name", "?")
    path = case.get("file")
    classname = case.get("classname", "")
    if path is None:
        return f"{classname}::{name}"
    module = Path(path).with_suffix("").as_posix().replace("/", ".")
    inner = classname[len(module) :].lstrip(".")
    return "::".join(part for part in (path, inner.replace(".", "::"), name) if part)


def read_report(path: Path) -> dict[str, Outcome]:
    """Every test case of a JUnit report; a report pytest never wrote yields nothing."""
    if not path.exists():
        return {}
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):  # noqa: S314 (our own pytest's)
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        lines = [] if problem is None else (problem.get("message") or "").splitlines()
        outcomes[test_id(case)] = Outcome(
            passed=problem is None,
            seconds=float(case.get("time", "0")),
            message=lines[0] if lines else "",
        )
    return outcomes


def start_hogs(count: int) -> list[subprocess.Popen[bytes]]:
    """Busy loops, one per core asked for, in their own process group each."""
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        for _ in range(count)
    ]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run_once(index: int, pytest_args: list[str], build: str | None, folder: Path) -> Run:
    report = folder / f"run-{index}.xml"
    env = dict(os.environ)
    if build is not None:
        env["SALTGATE_EXPECT_BUILD"] = build
    command = [
        str(ROOT / ".venv" / "bin" / "pytest"),
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={report}",
        *pytest_args,
    ]
    started = time.monotonic()
    with open(folder / f"run-{index}.log", "wb") as log:
        pytest = subprocess.Popen(  # noqa: S603 (pytest with the caller's own arguments)
            command, cwd=ROOT, env=env, stdout=log, stderr=log
        )
        try:
            status = pytest.wait()
        except BaseException:
            # Stopped (Ctrl-C, SIGTERM): pytest tears its fixtures down on SIGINT, so the
            # servers they started (real vLLM among them) do not outlive the hunt.
            pytest.send_signal(signal.SIGINT)
            try:
                pytest.wait(60)
            except subprocess.TimeoutExpired:  # it was started with SIGINT ignored
                pytest.kill()
                pytest.wait()
            raise
    return Run(index, status, time.monotonic() - started, read_report(report))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def failure_table(runs: list[Run]) -> list[tuple[str, int, int, str]]:
    """(test, failures, runs it ran in, first failure message), worst first."""
    failures: collections.Counter[str] = collections.Counter()
    seen: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    for run in runs:
        for test, outcome in run.outcomes.items():
            seen[test] += 1
            if not outcome.passed:
                failures[test] += 1
                first.setdefault(test, outcome.message)
    return sorted(
        ((test, failures[test], seen[test], first[test]) for test in failures),
        key=lambda row: (-row[1], row[0]),
    )


def time_report(runs: list[Run]) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Median seconds per part (the folder under tests/) and every test slower than SLOW_S
    at its median, from the runs that ran it."""
    per_test: dict[str, list[float]] = collections.defaultdict(list)
    for run in runs:
        for test, outcome in run.outcomes.items():
            per_test[test].append(outcome.seconds)
    medians = {test: sorted(times)[len(times) // 2] for test, times in per_test.items()}
    parts: dict[str, float] = collections.defaultdict(float)
    for test, seconds in medians.items():
        path = test.split("::")[0].split("/")
        parts["/".join(path[:2]) if len(path) > 2 else path[0]] += seconds
    slow = sorted(((test, s) for test, s in medians.items() if s > SLOW_S), key=lambda row: -row[1])
    return dict(sorted(parts.items(), key=lambda row: -row[1])), slow


def print_report(runs: list[Run], hogs: int) -> None:
    print(f"\n{len(runs)} runs, {hogs} CPU hogs")
    for run in runs:
        failed = sum(not o.passed for o in run.outcomes.values())
        print(
            f"  run {run.index}: exit {run.status}, {len(run.outcomes)} tests, "
            f"{failed} failed, {run.seconds:.0f} s"
        )
    table = failure_table(runs)
    if table:
        print("\nfailures (test, failed/ran, first message):")
        for test, failed, ran, message in table:
            print(f"  {failed}/{ran}  {test}\n         {message[:160]}")
    else:
        print("\nno test failed")
    parts, slow = time_report(runs)
    print("\nmedian seconds per part:")
    for part, seconds in parts.items():
        print(f"  {seconds:8.1f}  {part}")
    if slow:
        print(f"\ntests over {SLOW_S:.0f} s (median):")
        for test, seconds in slow:
            print(f"  {seconds:8.1f}  {test}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--runs", type=int, default=10, help="how many pytest runs")
    parser.add_argument("--hogs", type=int, default=0, help="busy loops beside every run")
    parser.add_argument("--build", choices=("pure", "compiled"), help="SALTGATE_EXPECT_BUILD")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    parser.add_argument("--keep", type=Path, help="keep the runs' logs and reports here")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs")
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="flakes-"))
    folder.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    hogs = start_hogs(args.hogs)
    runs: list[Run] = []
    try:
        for index in range(1, args.runs + 1):
            run = run_once(index, args.pytest_args, args.build, folder)
            runs.append(run)
            failed = [t for t, o in run.outcomes.items() if not o.passed]
            print(
                f"run {index}/{args.runs}: exit {run.status}, {len(run.outcomes)} tests, "
                f"{run.seconds:.0f} s" + (f", failed: {' '.join(failed)}" if failed else ""),
                flush=True,
            )
            if run.status != 0 and not failed:
                print(f"  pytest failed outside any test: see {folder}/run-{index}.log")
    finally:
        stop(hogs)
    print_report(runs, args.hogs)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "hogs": args.hogs,
                    "build": args.build,
                    "runs": [
                        {
                            "status": run.status,
                            "seconds": round(run.seconds, 1),
                            "outcomes": {
                                t: {"passed": o.passed, "seconds": o.seconds, "message": o.message}
                                for t, o in run.outcomes.items()
                            },
                        }
                        for run in runs
                    ],
                },
                indent=1,
            )
        )
    print(f"logs and reports: {folder}")
    return 0 if all(run.status == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
