"""Every spec v1 label lives in derivations/labels.py and is documented in docs/spec.md.

A label written anywhere else in the code could drift from the spec unseen; one missing
from the page could not be reimplemented. The vectors catch a changed value; this
catches a label added or moved without its documentation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from saltgate.derivations import labels

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "saltgate"
LABEL_TEXT = re.compile(r"saltgate/v1/[a-z0-9-]+")


def _labels() -> dict[str, str]:
    out = {}
    for name, value in vars(labels).items():
        if name.isupper() and isinstance(value, bytes | str):
            out[name] = value.decode("ascii") if isinstance(value, bytes) else value
    return out


def test_every_label_is_documented_and_every_documented_label_exists() -> None:
    found = _labels()
    spec = (ROOT / "docs" / "spec.md").read_text(encoding="utf-8")
    table = spec[spec.index("## 10. Labels") :]
    for name, value in found.items():
        assert f"| `{value}` |" in table, f"{name} ({value}) is missing from docs/spec.md"
    documented = set(LABEL_TEXT.findall(spec))
    assert documented == {v for v in found.values() if v.startswith("saltgate/v1/")}


def test_labels_appear_nowhere_else_in_the_code() -> None:
    for path in SRC.rglob("*.py"):
        if path == SRC / "derivations" / "labels.py":
            continue
        hits = LABEL_TEXT.findall(path.read_text(encoding="utf-8"))
        assert not hits, (
            f"{path.relative_to(ROOT)} spells out {hits}: use saltgate.derivations.labels"
        )


def test_no_label_is_a_prefix_of_another() -> None:
    """Domains are followed by lp-framed fields; a label that prefixed another could let
    one derivation's input be read as the other's."""
    values = [v for v in _labels().values() if v.startswith("saltgate/v1/")]
    assert len(values) >= 9
    for a in values:
        for b in values:
            assert a == b or not b.startswith(a), (a, b)
