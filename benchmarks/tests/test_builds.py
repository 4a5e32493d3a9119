"""`saltgate-bench overhead --build`: which build the benchmarked gateway runs.

`make test` runs this once on each build: a compiled install serves both builds (the
pure one from its own .py files), a pure install only the pure one.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from saltgate.buildinfo import COMPILED, build_kind
from saltgate_bench.builds import build_path, with_build
from saltgate_bench.procs import BenchError


def gateway_module_file(path: Path | None) -> str:
    probe = "import saltgate.gateway.server as m; print(m.__file__)"
    argv = with_build(path, [sys.executable, "-c", probe])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


def test_each_build_runs_as_asked_or_says_how_to_get_it(tmp_path: Path) -> None:
    if build_kind() == COMPILED:
        assert build_path("compiled", tmp_path) is None
        assert gateway_module_file(None).strip().endswith(".so")
        pure = build_path("pure", tmp_path)
        assert pure is not None
        assert gateway_module_file(pure).strip() == str(pure / "saltgate/gateway/server.py")
    else:
        assert build_path("pure", tmp_path) is None
        assert gateway_module_file(None).strip().endswith(".py")
        with pytest.raises(BenchError, match="make install-compiled"):
            build_path("compiled", tmp_path)
