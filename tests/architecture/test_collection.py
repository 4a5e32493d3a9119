"""Every folder of tests is collected by a bare `pytest` (what `make test` runs): a folder
that pytest's `norecursedirs` skips would pass by never running. pytest's default list
holds `dist` and `build`, which kept tests/dist out of the suite unnoticed."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]


def test_no_folder_of_tests_is_skipped_by_norecursedirs(pytestconfig: pytest.Config) -> None:
    patterns = pytestconfig.getini("norecursedirs")
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    skipped = sorted(
        str(folder.relative_to(TESTS))
        for folder in folders
        for part in folder.relative_to(TESTS).parts
        if any(fnmatch.fnmatch(part, pattern) for pattern in patterns)
    )
    assert skipped == [], f"tests never collected (norecursedirs {patterns}): {skipped}"


def test_the_check_reads_what_pytest_applies(pytestconfig: pytest.Config, tmp_path: Path) -> None:
    """The control: in a project of one test under tests/dist, pytest with its default
    `norecursedirs` collects nothing; with ours it collects the test."""
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")
    (tmp_path / "tests" / "dist").mkdir(parents=True)
    (tmp_path / "tests" / "dist" / "test_one.py").write_text("def test_one():\n    pass\n")

    def collected(*options: str) -> tuple[int, str]:
        run = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        done = subprocess.run(
            [*run, *options], check=False, cwd=tmp_path, capture_output=True, text=True
        )
        return done.returncode, done.stdout

    assert collected()[0] == pytest.ExitCode.NO_TESTS_COLLECTED
    ours = " ".join(pytestconfig.getini("norecursedirs"))
    status, listed = collected("-o", f"norecursedirs={ours}")
    assert status == pytest.ExitCode.OK and "tests/dist/test_one.py::test_one" in listed
