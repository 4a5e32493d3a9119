"""Prices set through the store (table model_prices), on both backends: set, override
the config's, clear back to it, each change audited and its version kept in `prices`;
and a gateway's key snapshot (KeyIndex on SQLite, PgKeyIndex on PostgreSQL) picks a
change up within a second, as it does keys (docs/billing.md)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from tests.support.waiting import eventually

from saltgate.cli import main
from saltgate.prices import Price, PriceBook, PriceVersion, price_from_fields
from saltgate.store.audit import Actor, list_entries, verify_chain
from saltgate.store.backends import open_database
from saltgate.store.errors import InvalidInputError, PriceNotFoundError
from saltgate.store.model_prices import PriceStore, effective_prices
from saltgate.store.postgres import PgKeyIndex
from saltgate.store.settings import StoreSettings
from saltgate.store.tenants import KeyIndex

CONFIG = {"m": Price(1.0, 0.1, 2.0), "only-config": Price(3.0, 0.3, 4.0)}


def test_a_store_price_overrides_the_config_and_clearing_it_reverts(
    store_settings: StoreSettings,
) -> None:
    db = open_database(store_settings)
    try:
        prices = PriceStore(db, Actor("cli:tester", "req-1"))
        assert [(p.version.model, p.source) for p in effective_prices(CONFIG, {})] == [
            ("m", "config"),
            ("only-config", "config"),
        ]
        set_m = prices.set("m", price_from_fields(_fields("1.5", 0.15, 6)))
        assert set_m.version == PriceVersion.of_micro("m", 1_500_000, 150_000, 6_000_000)
        assert set_m.version == PriceVersion.of("m", Price(1.5, 0.15, 6.0))  # one naming
        prices.set("meta-llama/Llama-3.1-8B", Price(0.0, 0.0, 0.25))  # a model without config
        shown = {p.version.model: p.to_dict() for p in effective_prices(CONFIG, prices.stored())}
        assert shown["m"] == {
            "object": "model_price",
            "model": "m",
            "input_per_mtok": "1.500000",
            "cached_input_per_mtok": "0.150000",
            "output_per_mtok": "6.000000",
            "version": set_m.version.version,
            "source": "store",
            "updated_at": set_m.updated_at,
        }
        assert shown["only-config"]["source"] == "config"
        assert shown["meta-llama/Llama-3.1-8B"]["output_per_mtok"] == "0.250000"
        # The version is in the `prices` table from the moment it is set.
        versions = {v for (v,) in db.query("SELECT version FROM prices")}
        assert set_m.version.version in versions

        again = prices.set("m", Price(2.0, 0.2, 8.0))
        assert prices.clear("m") == again
        assert [
            p.source for p in effective_prices(CONFIG, prices.stored()) if p.version.model == "m"
        ] == ["config"]
        with pytest.raises(PriceNotFoundError):
            prices.clear("m")
        with pytest.raises(InvalidInputError, match="invalid model name"):
            prices.set("no spaces", Price(1.0, 1.0, 1.0))

        entries = [e for e in list_entries(db) if e.resource_type == "model_price"]
        assert [e.action for e in entries] == [
            "price.set",
            "price.set",
            "price.set",
            "price.cleared",
        ]
        first, replaced, cleared = entries[0], entries[2], entries[3]
        assert (first.actor, first.request_id, first.tenant_id) == ("cli:tester", "req-1", None)
        assert (
            first.before is None and json.loads(first.after or "")["input_per_mtok"] == "1.500000"
        )
        assert json.loads(replaced.before or "")["version"] == set_m.version.version
        assert json.loads(cleared.before or "")["output_per_mtok"] == "8.000000"
        assert cleared.after is None
        assert verify_chain(db).ok
    finally:
        db.close()


def _fields(i: object, c: object, o: object) -> dict[str, object]:
    return {"input_per_mtok": i, "cached_input_per_mtok": c, "output_per_mtok": o}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("given", "problem"),
    [
        (_fields(-1, 0, 0), ">= 0"),
        (_fields("nan", 0, 0), "decimal number"),
        (_fields(float("inf"), 0, 0), "finite"),
        (_fields("1.0000001", 0, 0), "6 decimal places"),
        (_fields(1e-7, 0, 0), "6 decimal places"),
        (_fields("1e3", 0, 0), "decimal number"),
        (_fields(True, 0, 0), "must be a number"),
        (_fields(None, 0, 0), "must be a number"),
        (_fields(1e20, 0, 0), "over"),
        ({"input_per_mtok": 1, "output_per_mtok": 1}, "missing"),
        ({**_fields(1, 1, 1), "currency": "EUR"}, "unknown"),
    ],
)
def test_a_price_is_validated_as_the_config_validates_it(
    given: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        price_from_fields(given)


@pytest.mark.unit
def test_numbers_and_decimal_strings_give_the_same_price() -> None:
    assert price_from_fields(_fields("1.5", "0.15", "6")) == price_from_fields(
        _fields(1.5, 0.15, 6)
    )


@pytest.mark.unit
def test_a_sqlite_key_index_reloads_prices_with_its_keys(tmp_path: Path) -> None:
    settings = StoreSettings.in_state_dir(tmp_path / "state")
    db = open_database(settings)
    assert settings.sqlite_path is not None
    configured = {
        "m": PriceVersion.of("m", Price(1, 0, 1)),
        "c": PriceVersion.of("c", Price(2, 0, 2)),
    }
    book = PriceBook(configured)  # the gateway's: its meter and limits bill at it
    index = KeyIndex(settings.sqlite_path, max_staleness=0.0, book=book)
    try:
        assert book.by_model == configured
        PriceStore(db).set("m", Price(1.5, 0.15, 6.0))
        assert index.refresh_if_changed()
        # The reload hands the book the store's prices over the configuration's.
        assert book.by_model == {**configured, "m": PriceVersion.of("m", Price(1.5, 0.15, 6.0))}
        PriceStore(db).clear("m")
        assert index.refresh_if_changed()
        assert book.by_model == configured
    finally:
        index.close()
        db.close()


def test_a_postgres_gateway_hears_of_a_price_by_notify(pg_store: StoreSettings) -> None:
    db = open_database(pg_store)
    prices = PriceStore(db)

    async def run() -> None:
        book = PriceBook()
        # Only NOTIFY can be this fast.
        index = PgKeyIndex(pg_store, check_interval_s=30.0, book=book)
        await index.start()
        try:
            assert dict(book.by_model) == {}
            await asyncio.to_thread(prices.set, "m", Price(1.5, 0.15, 6.0))
            start = time.monotonic()
            # The gateway's book follows the reload.
            await eventually(lambda: "m" in book.by_model, timeout_s=1.0, what="new price")
            assert time.monotonic() - start < 1.0
            assert book.by_model["m"] == PriceVersion.of("m", Price(1.5, 0.15, 6.0))
            await asyncio.to_thread(prices.clear, "m")
            await eventually(lambda: "m" not in book.by_model, timeout_s=1.0, what="cleared")
            assert dict(book.by_model) == {}
        finally:
            await index.aclose()

    try:
        asyncio.run(run())
    finally:
        db.close()


def test_prices_cli(
    store_settings: StoreSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`saltgate prices list|set|clear` on either backend: the config's price, the
    store's over it, back to the config's; bad prices are one line on stderr; each change
    in the audit log as the CLI's."""
    config = tmp_path / "gateway.toml"
    config.write_text(
        f'[gateway]\nstate_dir = "{tmp_path / "state"}"\n{store_settings.toml()}'
        '[[replicas]]\nurl = "http://127.0.0.1:1"\n'
        "[prices.m]\ninput = 1.0\ncached_input = 0.1\noutput = 2.0\n"
    )
    c = ("--config", str(config))

    def saltgate(*args: str) -> tuple[int, str, str]:
        code = main([*args, *c])
        out, err = capsys.readouterr()
        return code, out.strip(), err.strip()

    config_version = PriceVersion.of("m", CONFIG["m"]).version
    line = f"m\tinput 1.000000\tcached_input 0.100000\toutput 2.000000\t{config_version}\tconfig"
    assert saltgate("prices", "list") == (0, line, "")
    code, out, err = saltgate(
        "prices", "set", "m", "--input", "1.5", "--cached-input", "0.15", "--output", "6"
    )
    new = PriceVersion.of("m", Price(1.5, 0.15, 6.0)).version
    assert (code, err) == (0, "") and out.endswith(f"\t{new}\tstore")
    assert saltgate("prices", "list")[1] == out
    code, _, err = saltgate(
        "prices", "set", "m", "--input", "-1", "--cached-input", "0", "--output", "0"
    )
    assert code == 1 and "decimal number >= 0" in err
    assert saltgate("prices", "clear", "m")[:2] == (0, "cleared the store's price of m")
    assert saltgate("prices", "list")[1] == line
    code, _, err = saltgate("prices", "clear", "m")
    assert code == 1 and "no price is set in the store for model 'm'" in err
    db = open_database(store_settings)
    try:
        entries = [e for e in list_entries(db) if e.resource_type == "model_price"]
        assert [e.action for e in entries] == ["price.set", "price.cleared"]
        assert all(e.actor.startswith("cli:") for e in entries)
    finally:
        db.close()
