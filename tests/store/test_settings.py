"""`[store]`: URLs for both backends, passwords never inline, and the connection string."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from saltgate.config import ConfigError, load_config
from saltgate.store.errors import StoreError
from saltgate.store.postgres import conninfo
from saltgate.store.settings import StoreSettings

pytestmark = pytest.mark.unit

REPLICA = '[[replicas]]\nurl = "http://127.0.0.1:8100"\n'


def _load(tmp_path: Path, text: str) -> StoreSettings:
    path = tmp_path / "g.toml"
    path.write_text('[gateway]\nstate_dir = "st"\n' + REPLICA + text)
    return dataclasses.replace(load_config(path).store_settings, master_key_file=None)


def test_no_store_section_is_sqlite_in_the_state_dir(tmp_path: Path) -> None:
    settings = _load(tmp_path, "")
    assert settings.backend == "sqlite"
    assert settings.sqlite_path == tmp_path / "st" / "saltgate.db"
    assert _load(tmp_path, "[store]\n") == settings


def test_sqlite_urls_relative_and_absolute(tmp_path: Path) -> None:
    rel = _load(tmp_path, '[store]\nurl = "sqlite:///data/sg.db"\n')
    assert rel.backend == "sqlite" and rel.sqlite_path == tmp_path / "data" / "sg.db"
    absolute = _load(tmp_path, '[store]\nurl = "sqlite:////var/lib/sg.db"\n')
    assert absolute.sqlite_path == Path("/var/lib/sg.db")


def test_postgres_url_with_password_source_and_spool(tmp_path: Path) -> None:
    settings = _load(
        tmp_path,
        '[store]\nurl = "postgresql://sg@db.internal:5433/saltgate?sslmode=verify-full"\n'
        'password_file = "pg.pass"\n',
    )
    assert settings.backend == "postgresql"
    assert settings.password_file == tmp_path / "pg.pass"
    assert settings.spool_dir == tmp_path / "st" / "spool"
    assert settings.describe() == "postgresql://sg@db.internal:5433/saltgate?sslmode=verify-full"


@pytest.mark.parametrize(
    ("store", "needle"),
    [
        ('url = "postgresql://sg:hunter2secret@db/x"', "do not put the password in the URL"),
        ('url = "postgresql://sg@db/x?password=hunter2secret"', "do not put the password"),
        ('password = "hunter2secret"', "do not put secrets in the config file"),
        ('url = "mysql://db/x"', "unsupported scheme mysql:"),
        ('url = "sqlite://host/x.db"', "not a SQLite URL"),
        ('url = "sqlite:///"', "names no database file"),
        ('url = "postgresql://db/x"\npassword_file = "a"\npassword_env = "B"', "not both"),
        ('url = "sqlite:///x.db"\npassword_env = "B"', "password_env: only for a postgresql"),
        ('url = "postgresql://db/x"\npool = 3', "pool: unknown key"),
        ("url = 5", "url: expected a non-empty string"),
    ],
)
def test_bad_store_tables_name_the_problem(tmp_path: Path, store: str, needle: str) -> None:
    with pytest.raises(ConfigError, match="store\\.") as err:
        _load(tmp_path, f"[store]\n{store}\n")
    assert needle in str(err.value)
    assert "hunter2secret" not in str(err.value)


def test_outage_grace_is_a_gateway_setting(tmp_path: Path) -> None:
    path = tmp_path / "g.toml"
    path.write_text("[gateway]\nstore_outage_grace_s = 5\n" + REPLICA)
    assert load_config(path).store_outage_grace_s == 5
    path.write_text("[gateway]\nstore_outage_grace_s = 0\n" + REPLICA)
    with pytest.raises(ConfigError, match="store_outage_grace_s: must be positive"):
        load_config(path)
    path.write_text(REPLICA)
    assert load_config(path).store_outage_grace_s == 60


def test_conninfo_reads_the_password_at_connect_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pw = tmp_path / "pg.pass"
    pw.write_text("first-password\n")
    base = StoreSettings(
        "postgresql", "postgresql://sg@db:5433/x?sslmode=require&connect_timeout=9"
    )
    from_file = StoreSettings(base.backend, base.url, password_file=pw)
    params = conninfo_to_dict(conninfo(from_file))
    assert params["password"] == "first-password"
    assert (params["sslmode"], params["connect_timeout"]) == ("require", "9")  # the URL wins
    assert params["application_name"] == "saltgate" and params["keepalives"] == "1"
    pw.write_text("rotated-password\n")  # a rotated file is read at the next connection
    assert conninfo_to_dict(conninfo(from_file))["password"] == "rotated-password"

    from_env = StoreSettings(base.backend, base.url, password_env="SG_TEST_PG_PASSWORD")
    with pytest.raises(StoreError, match="SG_TEST_PG_PASSWORD is not set"):
        conninfo(from_env)
    monkeypatch.setenv("SG_TEST_PG_PASSWORD", "env-password")
    assert conninfo_to_dict(conninfo(from_env))["password"] == "env-password"

    missing = StoreSettings(base.backend, base.url, password_file=tmp_path / "nope")
    with pytest.raises(StoreError, match=r"password_file: cannot read .*nope"):
        conninfo(missing)


@pytest.mark.parametrize(
    "settings",
    [
        StoreSettings.sqlite(Path("/var/lib/saltgate/sg.db")),
        StoreSettings(
            "postgresql",
            "postgresql://sg@db:5432/x?sslmode=require",
            password_file=Path("/run/secrets/pg"),
            spool_dir=Path("/var/spool/saltgate"),
        ),
        StoreSettings(
            "postgresql", "postgresql://sg@db/x", password_env="PGPASS", spool_dir=Path("/s")
        ),
    ],
)
def test_generated_store_tables_read_back_the_same(tmp_path: Path, settings: StoreSettings) -> None:
    """Benchmarks and tests write `[store]` tables with `toml()`; they must mean the same."""
    assert _load(tmp_path, settings.toml()) == dataclasses.replace(settings, master_key_file=None)
