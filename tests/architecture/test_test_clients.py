"""Tests make their httpx clients through tests/support/http.py.

A bare `httpx.AsyncClient(...)` parses the CA bundle on the event loop that also runs a
test's simulated replicas; beside CPU hogs that stalls them long enough to fail their
health probes (tests/support/http.py says how it was found).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parents[1]
ALLOWED = {TESTS / "support" / "http.py"}


def bare_clients(root: Path) -> list[str]:
    return [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path not in ALLOWED and path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "httpx.AsyncClient(" in line
    ]


def test_no_test_makes_a_bare_httpx_client() -> None:
    assert bare_clients(TESTS) == []


def test_the_scan_finds_a_bare_client(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text("import httpx\nc = httpx.AsyncClient(timeout=1)\n")
    assert bare_clients(tmp_path) == ["test_x.py:2"]
