"""The `unit` mark's guard (tests/support/unit.py): a marked test that reaches the network
or starts a process fails, even when the code under test swallows the refusal; the same
test unmarked passes, and a marked test may still run an asyncio loop and write files."""

from __future__ import annotations

import pytest

TESTS = """
import asyncio
import multiprocessing
import socket
import subprocess
import sys

import pytest


def swallowed(action):
    try:
        action()
    except Exception:
        pass


def test_connect():
    swallowed(lambda: socket.create_connection(("127.0.0.1", 9), timeout=1))


def test_listen_v6():
    swallowed(lambda: socket.socket(socket.AF_INET6))


def test_subprocess():
    swallowed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=False))


def test_spawn():
    swallowed(lambda: multiprocessing.get_context("spawn").Process(target=print).start())


def test_loop_and_files(tmp_path):
    asyncio.run(asyncio.sleep(0))
    (tmp_path / "f").write_text("x")
"""


def run(pytester: pytest.Pytester, marked: bool) -> pytest.RunResult:
    pytester.makepyfile(
        TESTS.replace("import pytest\n", "import pytest\n\npytestmark = pytest.mark.unit\n")
        if marked
        else TESTS
    )
    pytester.makeini("[pytest]\nmarkers =\n    unit: no network, no process\n")
    return pytester.runpytest_inprocess("-p", "tests.support.unit", "-p", "no:cacheprovider")


def test_a_unit_test_reaching_out_fails_naming_what_it_did(pytester: pytest.Pytester) -> None:
    result = run(pytester, marked=True)
    result.assert_outcomes(passed=1, failed=4)
    result.stdout.fnmatch_lines(
        [
            "*_ test_connect _*",
            "a test marked `unit` opened an internet socket (AF_INET): drop the mark*",
            "*_ test_listen_v6 _*",
            "a test marked `unit` opened an internet socket (AF_INET6): drop the mark*",
            "*_ test_subprocess _*",
            "a test marked `unit` started a process (subprocess.Popen): drop the mark*",
            "*_ test_spawn _*",
            "a test marked `unit` started a process (_posixsubprocess.fork_exec): drop the mark*",
        ]
    )


def test_the_same_tests_unmarked_pass(pytester: pytest.Pytester) -> None:
    run(pytester, marked=False).assert_outcomes(passed=5)
