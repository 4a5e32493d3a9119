"""Per-model prices, as the config file's ``[prices.MODEL]`` tables give them.

Pure: the type and its parser. The usage report (store/pricing.py) applies them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

_PRICE_FIELDS = {
    "input": "input_per_mtok",
    "cached_input": "cached_input_per_mtok",
    "output": "output_per_mtok",
}


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens for uncached input, cached input and output."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "cached_input_per_mtok", "output_per_mtok"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"price {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"price {name} must be finite and >= 0, got {value!r}")

    def cost(self, prompt: int, cached: int, completion: int) -> float:
        """USD for one request (or for token sums)."""
        return self.cost_split(max(prompt - cached, 0), cached, completion)

    def cost_split(self, uncached: int, cached: int, completion: int) -> float:
        """USD given uncached input tokens directly (for sums floored per request)."""
        return (
            uncached * self.input_per_mtok
            + cached * self.cached_input_per_mtok
            + completion * self.output_per_mtok
        ) / 1_000_000


def parse_prices(config: Mapping[str, Mapping[str, object]]) -> dict[str, Price]:
    """Build prices from config: ``{model: {"input": x, "cached_input": y, "output": z}}``.

    All three are required, so a forgotten cached price is an error rather than a silent
    full-price (or free) default.
    """
    prices: dict[str, Price] = {}
    for model, entry in config.items():
        unknown = sorted(set(entry) - set(_PRICE_FIELDS))
        missing = sorted(set(_PRICE_FIELDS) - set(entry))
        if unknown or missing:
            raise ValueError(
                f"prices for model {model!r}: need exactly {sorted(_PRICE_FIELDS)} "
                f"(USD per million tokens); missing {missing}, unknown {unknown}"
            )
        try:
            prices[model] = Price(**{_PRICE_FIELDS[k]: v for k, v in entry.items()})  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"prices for model {model!r}: {exc}") from None
    return prices
