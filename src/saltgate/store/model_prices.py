"""Prices set through the store: the admin API's ``PUT /admin/v1/prices/{model}`` and
`saltgate prices set` write table ``model_prices`` (schema 10), one row per model.

A row overrides the config's ``[prices.MODEL]`` for that model, and deleting it reverts
to the config's price (or to none). A change bumps the auth generation, so every gateway
reloads these rows with its key snapshot (saltgate.store.tenants.KeyIndex on SQLite,
saltgate.store.postgres.PgKeyIndex on PostgreSQL) and bills the next request with them,
within a second, with no restart. Setting a price records its version in the `prices`
table in the same transaction, so a usage record never names a version the store lacks;
records made before keep their cost and version (docs/billing.md). Every change is in
the audit log, before and after.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from saltgate.prices import MODEL_NAME, Price, PriceVersion, price_versions
from saltgate.store import audit
from saltgate.store.audit import Actor
from saltgate.store.db import Database
from saltgate.store.errors import InvalidInputError, PriceNotFoundError
from saltgate.store.ledger import PRICE_INSERT, price_rows
from saltgate.store.pricing import usd

MODEL_PRICES_SQL = (
    "SELECT model, input_micro_usd_per_mtok, cached_input_micro_usd_per_mtok, "
    "output_micro_usd_per_mtok, updated_at FROM model_prices"
)
UPSERT = (
    "INSERT INTO model_prices (model, input_micro_usd_per_mtok, "
    "cached_input_micro_usd_per_mtok, output_micro_usd_per_mtok, updated_at) "
    "VALUES (?, ?, ?, ?, ?) ON CONFLICT (model) DO UPDATE SET "
    "input_micro_usd_per_mtok = excluded.input_micro_usd_per_mtok, "
    "cached_input_micro_usd_per_mtok = excluded.cached_input_micro_usd_per_mtok, "
    "output_micro_usd_per_mtok = excluded.output_micro_usd_per_mtok, "
    "updated_at = excluded.updated_at"
)

Source = Literal["config", "store"]


def store_versions(rows: Iterable[tuple[Any, ...]]) -> dict[str, PriceVersion]:
    """The versions of `MODEL_PRICES_SQL`'s rows, by model: what a gateway bills with."""
    return {str(r[0]): PriceVersion.of_micro(str(r[0]), r[1], r[2], r[3]) for r in rows}


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """A model's price in effect, where it comes from, and when the store's was set."""

    version: PriceVersion
    source: Source
    updated_at: float | None = None  # the store's row; None for the config's

    def to_dict(self) -> dict[str, object]:
        """As the admin API, the console and the audit log show it: exact decimal
        strings of USD per million tokens, never floats."""
        v = self.version
        return {
            "object": "model_price",
            "model": v.model,
            "input_per_mtok": usd(v.input),
            "cached_input_per_mtok": usd(v.cached_input),
            "output_per_mtok": usd(v.output),
            "version": v.version,
            "source": self.source,
            "updated_at": self.updated_at,
        }


def effective_prices(
    config: Mapping[str, Price], stored: Mapping[str, ModelPrice]
) -> list[ModelPrice]:
    """Every priced model's price in effect, by model name: the store's over the config's."""
    found = {m: ModelPrice(v, "config") for m, v in price_versions(config).items()}
    found.update(stored)
    return [found[m] for m in sorted(found)]


class PriceStore:
    """Set, clear and read the store's prices, on either backend; every change in the
    audit log, as made by `actor`, in the change's own transaction."""

    def __init__(self, db: Database, actor: Actor | None = None) -> None:
        self._db = db
        self.actor = actor or Actor.cli()

    def stored(self) -> dict[str, ModelPrice]:
        """The prices set through the store, by model."""
        return {p.version.model: p for p in map(_row, self._db.query(MODEL_PRICES_SQL))}

    def _get(self, model: str) -> ModelPrice | None:
        rows = self._db.query(MODEL_PRICES_SQL + " WHERE model = ?", (model,))
        return _row(rows[0]) if rows else None

    def set(self, model: str, price: Price) -> ModelPrice:
        """Set `model`'s price (replacing the store's, overriding the config's)."""
        _check_model(model)
        version = PriceVersion.of(model, price)
        now = time.time()
        after = ModelPrice(version, "store", now)
        with self._db.transaction():
            before = self._get(model)
            self._db.execute(
                UPSERT, (model, version.input, version.cached_input, version.output, now)
            )
            self._db.execute_many(PRICE_INSERT, price_rows([version], now))
            self._audit("price.set", model, before, after)
        return after

    def clear(self, model: str) -> ModelPrice:
        """Delete `model`'s store price (the config's applies again); the price deleted."""
        _check_model(model)
        with self._db.transaction():
            before = self._get(model)
            if before is None:
                raise PriceNotFoundError(f"no price is set in the store for model {model!r}")
            self._db.execute("DELETE FROM model_prices WHERE model = ?", (model,))
            self._audit("price.cleared", model, before, None)
        return before

    def _audit(
        self, action: str, model: str, before: ModelPrice | None, after: ModelPrice | None
    ) -> None:
        audit.append(
            self._db,
            self.actor,
            action,
            "model_price",
            model,
            tenant_id=None,
            before=None if before is None else before.to_dict(),
            after=None if after is None else after.to_dict(),
        )


def _check_model(model: str) -> None:
    """A name is a name (never echoed: a pasted secret would be)."""
    if not MODEL_NAME.fullmatch(model):
        raise InvalidInputError(
            "invalid model name: 1-256 characters of [A-Za-z0-9._:/@+-], starting with a "
            "letter or digit"
        )


def _row(row: tuple[Any, ...]) -> ModelPrice:
    (version,) = store_versions([row]).values()
    return ModelPrice(version, "store", float(row[4]))
