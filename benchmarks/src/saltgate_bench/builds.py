"""The gateway build a benchmark runs (`--build compiled|pure`).

One install holds one build (saltgate/buildinfo.py). The compiled wheel also carries
every .py file it was compiled from, so from a compiled install both builds of the same
source can run: the installed package as it is, or its .py files copied without the
extensions, first on the gateway's PYTHONPATH. From a pure install only the pure build
can: the compiled one needs `make install-compiled`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from saltgate.buildinfo import COMPILED, PURE, build_kind, describe, package_dir
from saltgate_bench.procs import BenchError

BUILDS = {"compiled": COMPILED, "pure": PURE}


def build_path(build: str, workdir: Path) -> Path | None:
    """A directory to put first on the gateway's PYTHONPATH so that it runs ``build``
    ("compiled" or "pure"), or None when the installed saltgate is that build."""
    installed = build_kind()
    if installed == BUILDS[build]:
        return None
    if build == "compiled" or installed != COMPILED:
        raise BenchError(
            f"--build {build}: the installed saltgate is {describe()}; "
            "`make install-compiled` installs the compiled build, which can run both"
        )
    target = workdir / "pure-build"
    shutil.copytree(
        package_dir(),
        target / "saltgate",
        ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__", "_build.json"),
    )
    check_build(target, build)
    return target


def with_build(path: Path | None, argv: Sequence[str]) -> list[str]:
    """``argv`` (a Python command) run with ``path`` first on its PYTHONPATH."""
    return list(argv) if path is None else ["env", f"PYTHONPATH={path}", *argv]


def check_build(path: Path, build: str) -> None:
    """Ask an interpreter set up as the gateway will be which build it imports."""
    probe = "from saltgate.buildinfo import build_kind; print(build_kind())"
    argv = with_build(path, [sys.executable, "-c", probe])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)  # noqa: S603
    if done.stdout.strip() != BUILDS[build]:
        raise BenchError(
            f"--build {build}: the gateway would import {done.stdout.strip() or done.stderr}"
        )
