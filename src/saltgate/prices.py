"""Per-model prices, as the config file's ``[prices.MODEL]`` tables give them (or the
store's, set over the admin API or `saltgate prices set`, which take precedence), and the
integer arithmetic that bills a request with them.

Pure: the types, the parser and the cost. The gateway prices each request when it records
it (gateway/exchange.py) and the store keeps every price version it used
(store/pricing.py); docs/billing.md says how the pieces fit.

Money is integers: a price is held in micro-dollars per million tokens, which is
pico-dollars per token, so tokens x price is exact; a request's cost is rounded once, to
the nearest micro-dollar (half up), and reports only add those integers.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

_PRICE_FIELDS = {
    "input": "input_per_mtok",
    "cached_input": "cached_input_per_mtok",
    "output": "output_per_mtok",
}
MICRO = 1_000_000  # micro-dollars per dollar; also pico-dollars per micro-dollar
PRICE_FIELDS = tuple(_PRICE_FIELDS.values())
_DECIMAL = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?")
# What a price set at run time may be at most: the store keeps 64-bit integers.
MAX_PER_MTOK = 1_000_000_000
# A model's name as a price set at run time may give it: as clients send them
# ("meta-llama/Llama-3.1-8B", "qwen2.5:7b"), nothing that could be read as markup or SQL.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}")


def micro_per_mtok(value: float) -> int:
    """USD per million tokens as whole micro-dollars per million tokens (exact, from the
    number's shortest decimal form); ValueError past six decimal places."""
    scaled = Decimal(repr(value)) * MICRO
    if scaled != scaled.to_integral_value():
        raise ValueError(f"{value!r} has more than 6 decimal places (USD per million tokens)")
    return int(scaled)


@dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens for uncached input, cached input and output."""

    input_per_mtok: float
    cached_input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        for name in PRICE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"price {name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"price {name} must be finite and >= 0, got {value!r}")
            try:
                micro_per_mtok(value)
            except ValueError as exc:
                raise ValueError(f"price {name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class PriceVersion:
    """One model's price as requests are billed with it: micro-dollars per million tokens.

    `version` is a hash of the model and the three prices, so every gateway given the same
    price names it alike without asking anyone, and a changed price is a new version.
    """

    version: str
    model: str
    input: int
    cached_input: int
    output: int

    @classmethod
    def of(cls, model: str, price: Price) -> PriceVersion:
        return cls.of_micro(
            model,
            micro_per_mtok(price.input_per_mtok),
            micro_per_mtok(price.cached_input_per_mtok),
            micro_per_mtok(price.output_per_mtok),
        )

    @classmethod
    def of_micro(cls, model: str, input: int, cached_input: int, output: int) -> PriceVersion:
        """From amounts already in micro-dollars per million tokens (the store's rows):
        the same version as `of` gives the same price, wherever it was set."""
        amounts = (int(input), int(cached_input), int(output))
        text = "\0".join((model, *map(str, amounts))).encode()
        return cls("pv_" + hashlib.sha256(text).hexdigest()[:16], model, *amounts)

    def cost_micro_usd(self, prompt: int, cached: int | None, completion: int) -> int:
        """A request's cost. Unknown cached tokens (None) bill the whole prompt at the
        input price, an upper bound; over-reported cached tokens never make uncached
        input negative."""
        known = cached or 0
        pico = (
            max(prompt - known, 0) * self.input
            + known * self.cached_input
            + completion * self.output
        )
        return (pico + MICRO // 2) // MICRO


def _require_exactly(given: Mapping[str, object], names: Sequence[str], lead: str) -> None:
    """Refuse a price with a field missing or unknown (a forgotten cached price must be
    an error, not a silent full-price or free default). ValueError naming both."""
    unknown = sorted(set(given) - set(names))
    missing = sorted(set(names) - set(given))
    if unknown or missing:
        raise ValueError(
            f"{lead} {', '.join(names)} (USD per million tokens); "
            f"missing {missing}, unknown {unknown}"
        )


def price_from_fields(given: Mapping[str, object]) -> Price:
    """A price as the admin API takes it: exactly ``input_per_mtok``,
    ``cached_input_per_mtok`` and ``output_per_mtok``, each a number or a decimal string
    ("1.5"); validated as `Price` is (finite, >= 0, at most 6 decimals). ValueError."""
    _require_exactly(given, PRICE_FIELDS, "give exactly")
    amounts: dict[str, object] = {}
    for name in PRICE_FIELDS:
        value = given[name]
        if isinstance(value, str):
            if not _DECIMAL.fullmatch(value.strip()):
                raise ValueError(f"price {name} must be a decimal number >= 0 like 1.5")
            value = float(value.strip())
        amounts[name] = value
    price = Price(**amounts)  # type: ignore[arg-type]  # Price checks the types
    for name in PRICE_FIELDS:
        if getattr(price, name) > MAX_PER_MTOK:
            raise ValueError(f"price {name} is over {MAX_PER_MTOK} USD per million tokens")
    return price


def price_versions(prices: Mapping[str, Price]) -> dict[str, PriceVersion]:
    """Each priced model's current version."""
    return {model: PriceVersion.of(model, price) for model, price in prices.items()}


class PriceBook:
    """The prices requests are reserved and billed at, one object for the gateway's meter
    and its limits: the configuration's, with those set through the store over them
    (docs/billing.md). The key snapshot hands it the store's each time it reloads
    (store/tenants.py, store/postgres.py), so a price set through the store bills the
    next request; a request takes its price when it is recorded, so one in flight may
    bill either. ``by_model``: the current prices, replaced whole (never changed in place)."""

    __slots__ = ("_configured", "by_model")

    def __init__(self, configured: Mapping[str, PriceVersion] | None = None) -> None:
        self._configured: dict[str, PriceVersion] = dict(configured or {})
        self.by_model: Mapping[str, PriceVersion] = self._configured

    def stored(self, prices: Mapping[str, PriceVersion]) -> None:
        """The store's prices as of a reloaded snapshot, over the configuration's."""
        self.by_model = {**self._configured, **prices}


def parse_prices(config: Mapping[str, Mapping[str, object]]) -> dict[str, Price]:
    """Build prices from config: ``{model: {"input": x, "cached_input": y, "output": z}}``.

    All three are required, so a forgotten cached price is an error rather than a silent
    full-price (or free) default.
    """
    prices: dict[str, Price] = {}
    for model, entry in config.items():
        _require_exactly(entry, sorted(_PRICE_FIELDS), f"prices for model {model!r}: need exactly")
        try:
            prices[model] = Price(**{_PRICE_FIELDS[k]: v for k, v in entry.items()})  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"prices for model {model!r}: {exc}") from None
    return prices
