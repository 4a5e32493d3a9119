"""The typed vocabulary of governance keeps the spellings already stored and sent.

A kind, band or scope is written to the database (a key's priority, a limit's name in
metric labels), to Redis (its keys and the admission script's codes) and to the host
arbiter's lines: renaming a member must not change any of them.
"""

from __future__ import annotations

import re

import pytest

from saltgate.gateway.shared_limits import ADMIT_SCRIPT
from saltgate.governance.kinds import BANDS, WINDOWED, Band, LimitKind, Scope, Subject, band_of
from saltgate.store.schema import KEY_PRIORITY

pytestmark = pytest.mark.unit


def test_the_values_are_the_stored_spellings() -> None:
    assert [str(k) for k in LimitKind] == [
        "requests",
        "input_tokens",
        "output_tokens",
        "concurrency",
        "budget",
    ]
    assert f"sg:lim:{Scope.KEY}:k1:{LimitKind.BUDGET}" == "sg:lim:key:k1:budget"
    assert [str(b) for b in BANDS] == ["interactive", "batch"], "highest band first"
    assert WINDOWED == (LimitKind.REQUESTS, LimitKind.INPUT_TOKENS, LimitKind.OUTPUT_TOKENS)


def test_the_bands_are_the_ones_the_store_admits() -> None:
    """The SQL CHECK on api_keys.priority names exactly the bands."""
    (sql,) = KEY_PRIORITY.statements
    check = re.search(r"CHECK \(priority IN \(([^)]*)\)\)", sql)
    assert check is not None
    assert tuple(s.strip(" '") for s in check.group(1).split(",")) == BANDS


def test_script_codes_are_the_ones_the_admission_script_knows() -> None:
    assert {k: k.script_code for k in LimitKind} == {
        LimitKind.REQUESTS: "w",
        LimitKind.INPUT_TOKENS: "w",
        LimitKind.OUTPUT_TOKENS: "w",
        LimitKind.CONCURRENCY: "c",
        LimitKind.BUDGET: "b",
    }
    for code in "wbc":
        assert f"kind == '{code}'" in ADMIT_SCRIPT


def test_a_stored_priority_names_its_band_and_anything_else_is_interactive() -> None:
    assert band_of("batch") is Band.BATCH
    assert band_of("interactive") is Band.INTERACTIVE
    assert band_of("urgent") is Band.INTERACTIVE


def test_a_subject_is_keyed_as_the_pair_it_was() -> None:
    """Subjects key dicts that also meet plain pairs read back from JSON (the arbiter)."""
    subject = Subject(Scope.TENANT, "tn_1")
    assert subject == ("tenant", "tn_1") and hash(subject) == hash(("tenant", "tn_1"))
