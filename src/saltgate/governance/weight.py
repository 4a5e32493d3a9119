"""A tenant's weight: its fair share of saturated replicas (docs/fairness.md).

A tenant setting beside its limits, not a limit: it limits nothing, so it is stored in its
own column (``tenants.weight``) and travels on the principal, not in the limits. The front
ends still take it where operators gave it before, among a tenant's limits (``--weight``,
``"weight"`` in the admin API's limits body, the console's limits form): `split_weight`
takes it out of what they were given before the limits are parsed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from typing import Final

from saltgate.governance.limits import LimitError, shown_value

WEIGHT: Final = "weight"
DEFAULT_WEIGHT: Final = 1.0
MIN_WEIGHT: Final = 0.01
MAX_WEIGHT: Final = 100.0

KEY_WEIGHT_REFUSED: Final = (
    "weight is a tenant's fair share of the replicas: set it on the tenant, a key cannot set it"
)


def sane_weight(weight: float) -> float:
    """A weight the fair queue can divide by: a non-finite or non-positive one is 1, any
    other is held within [MIN_WEIGHT, MAX_WEIGHT] (5e-324 would make a charge inf)."""
    if not (math.isfinite(weight) and weight > 0):
        return DEFAULT_WEIGHT
    return min(max(float(weight), MIN_WEIGHT), MAX_WEIGHT)


def parse_weight(value: object) -> float:
    """A weight as any front end has it (a JSON number, form or option text); None or
    empty (a JSON null, an empty field) is the default, 1. LimitError naming ``weight``
    when it is not a number from MIN_WEIGHT to MAX_WEIGHT."""
    if value is None or value == "":
        return DEFAULT_WEIGHT
    number = math.nan
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            number = float(value.strip())
    elif isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    if not (math.isfinite(number) and MIN_WEIGHT <= number <= MAX_WEIGHT):
        raise LimitError(
            f"weight must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g} (such as 1, 2 or "
            f"0.5), got {shown_value(value)}",
            WEIGHT,
        )
    return number


def split_weight(
    given: Mapping[str, object], *, tenant: bool
) -> tuple[dict[str, object], float | None]:
    """What an operator gave with limits, apart: the limits, and the weight when named
    (parse_weight: a null or empty one is 1), else None (the weight is kept). A weight
    given for a key: LimitError KEY_WEIGHT_REFUSED (keys share their tenant's share)."""
    limits = dict(given)
    if WEIGHT not in limits:
        return limits, None
    value = limits.pop(WEIGHT)
    if not tenant:
        raise LimitError(KEY_WEIGHT_REFUSED, WEIGHT)
    return limits, parse_weight(value)
