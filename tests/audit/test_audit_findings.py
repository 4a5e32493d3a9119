"""Every finding of `saltgate audit deployment` says what to do: operators act on the fix
column alone, and it was empty for most findings (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import saltgate.audit
from saltgate.audit.findings import NOTHING_TO_CHANGE, Finding, Severity

pytestmark = pytest.mark.unit

AUDIT = Path(saltgate.audit.__file__).parent


def constructions() -> list[tuple[str, ast.Call]]:
    """Every `Finding(...)` written in the audit's modules: each kind of finding."""
    return [
        (f"{path.name}:{node.lineno}", node)
        for path in sorted(AUDIT.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding"
    ]


def test_every_finding_but_an_ok_one_is_written_with_its_fix() -> None:
    """Read from the source, so a finding no test happens to reach is checked too: an
    explicit fix (fifth argument, or a tuple spread from a helper), unless its severity
    is written Severity.OK; an empty literal anywhere is refused."""
    found = constructions()
    assert len(found) > 60  # the reader finds them (the audit writes about 80)
    for where, call in found:
        severity = ast.unparse(call.args[2]) if len(call.args) > 2 else ""
        fix = call.args[4:] or [k.value for k in call.keywords if k.arg == "fix"]
        spread = any(isinstance(a, ast.Starred) for a in call.args)
        assert fix or spread or severity == "Severity.OK", f"{where}: no fix"
        for value in fix:
            assert not (isinstance(value, ast.Constant) and not str(value.value).strip()), where


@pytest.mark.parametrize("severity", [s for s in Severity if s is not Severity.OK])
def test_a_finding_without_its_fix_is_refused(severity: Severity) -> None:
    """At run time too: the default is an ok finding's alone, and no fix is empty."""
    with pytest.raises(ValueError, match="needs its fix"):
        Finding("check", "target", severity, "summary")
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="needs its fix"):
            Finding("check", "target", severity, "summary", empty)
    assert Finding("check", "target", severity, "summary", "do this").fix == "do this"


def test_an_ok_finding_says_there_is_nothing_to_change() -> None:
    assert Finding("check", "target", Severity.OK, "fine").fix == NOTHING_TO_CHANGE
    with pytest.raises(ValueError, match="needs its fix"):
        Finding("check", "target", Severity.OK, "fine", "")
