"""A tenant's fair-share weight (governance/weight.py): one parser for every front end,
bounded; taken apart from the limits it was once stored with; refused on a key."""

from __future__ import annotations

import math

import pytest

from saltgate.governance.limits import LimitError, parse_limits
from saltgate.governance.weight import (
    DEFAULT_WEIGHT,
    KEY_WEIGHT_REFUSED,
    MAX_WEIGHT,
    MIN_WEIGHT,
    parse_weight,
    sane_weight,
    split_weight,
)

pytestmark = pytest.mark.unit


def test_parse_weight_takes_numbers_and_text_and_empty_is_the_default() -> None:
    assert parse_weight(2) == 2.0 and parse_weight(" 0.5") == 0.5 and parse_weight("100") == 100
    assert parse_weight(None) == parse_weight("") == DEFAULT_WEIGHT == 1.0


@pytest.mark.parametrize(
    "bad",
    # 5e-324 made the fair queue's counters inf then NaN (issue 41 finding 1); 1e308
    # outweighed every other tenant.
    [0, -1, 5e-324, "5e-324", 1e308, 100.5, "nan", math.inf, "abc", True, [2]],
)
def test_parse_weight_refuses_what_is_out_of_bounds(bad: object) -> None:
    with pytest.raises(LimitError) as info:
        parse_weight(bad)
    assert str(info.value).startswith("weight must be a number from 0.01 to 100 ")
    assert info.value.field == "weight"


def test_a_weight_among_the_limits_is_taken_apart_for_a_tenant_and_refused_for_a_key() -> None:
    """What the front ends were given (`--weight`, "weight" in a limits body, the form's
    field) goes to the tenant's setting; the rest is parsed as limits, unchanged."""
    given = {"rpm": "60", "weight": "2.5"}
    limits, weight = split_weight(given, tenant=True)
    assert (parse_limits(limits), weight) == (parse_limits({"rpm": 60}), 2.5)
    assert given == {"rpm": "60", "weight": "2.5"}  # the caller's mapping is left alone
    assert split_weight({"rpm": 1}, tenant=True) == ({"rpm": 1}, None)  # absent: kept
    assert split_weight({"weight": None}, tenant=True) == ({}, DEFAULT_WEIGHT)  # null: 1
    assert split_weight({"rpm": 1}, tenant=False) == ({"rpm": 1}, None)
    for value in (2, None):
        with pytest.raises(LimitError, match="a key cannot set it") as info:
            split_weight({"weight": value}, tenant=False)
        assert str(info.value) == KEY_WEIGHT_REFUSED and info.value.field == "weight"


@pytest.mark.parametrize(
    ("stored", "bounded"),
    [(5e-324, MIN_WEIGHT), (1e308, MAX_WEIGHT), (2.0, 2.0), (0.0, 1.0), (math.nan, 1.0)],
)
def test_any_stored_weight_reaches_the_queue_bounded(stored: float, bounded: float) -> None:
    """A weight stored before the bounds (or past them by hand) reaches the queue held
    within them; one the queue cannot divide by is 1."""
    assert sane_weight(stored) == bounded
