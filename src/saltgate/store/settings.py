"""Where the store lives: the `[store]` table read into a typed value (pure: no I/O).

The store package builds connections from a `StoreSettings`; the configuration parser
only validates. A password is never part of the settings: the URL may not carry one, and
`password_file` / `password_env` name where it is read when a connection is made (so a
rotated password file is picked up at the next connection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from saltgate.tables import check_keys, toml_string

Backend = Literal["sqlite", "postgresql"]

DB_FILENAME = "saltgate.db"
MASTER_KEY_FILENAME = "master.key"  # in a state directory, beside the database
SPOOL_DIRNAME = "spool"
_KEYS = {"url", "password_file", "password_env", "spool_dir"}
_POSTGRES_SCHEMES = {"postgresql", "postgres"}


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """A parsed `[store]` table; `url` is as written (it never holds a password)."""

    backend: Backend
    url: str
    sqlite_path: Path | None = None  # sqlite: the database file
    password_file: Path | None = None  # postgresql: read at each connection
    password_env: str | None = None
    spool_dir: Path | None = None  # postgresql: usage records wait here while it is down
    # The master key, whose K_audit keys the audit log (store/audit.py): the gateway's
    # master_key_file; for a state directory, its master.key.
    master_key_file: Path | None = None

    @classmethod
    def sqlite(cls, path: Path) -> StoreSettings:
        """The embedded default: one SQLite file (``state_dir/saltgate.db``), the master
        key beside it."""
        return cls(
            "sqlite",
            f"sqlite:///{path}",
            sqlite_path=path,
            master_key_file=path.parent / MASTER_KEY_FILENAME,
        )

    @classmethod
    def in_state_dir(cls, state_dir: Path) -> StoreSettings:
        return cls.sqlite(state_dir / DB_FILENAME)

    @classmethod
    def from_table(cls, table: Mapping[str, Any], base: Path, state_dir: Path) -> StoreSettings:
        """Validate `[store]`; relative paths start at `base` (the config file's directory).

        Raises ValueError("<key>: <what is wrong>").
        """
        check_keys(table, _KEYS)
        for key in _KEYS & set(table):
            if not isinstance(table[key], str) or not table[key]:
                raise ValueError(f"{key}: expected a non-empty string")

        def path(key: str) -> Path | None:
            if key not in table:
                return None
            value = Path(table[key])
            return value if value.is_absolute() else base / value

        url: str | None = table.get("url")
        if url is None or url.startswith("sqlite:"):
            extra = sorted({"password_file", "password_env", "spool_dir"} & set(table))
            if extra:
                raise ValueError(f"{extra[0]}: only for a postgresql:// url")
            if url is None:
                return cls.in_state_dir(state_dir)
            return cls("sqlite", url, sqlite_path=_sqlite_path(url, base))
        _check_postgres_url(url)
        if "password_file" in table and "password_env" in table:
            raise ValueError("password_file: give password_file or password_env, not both")
        return cls(
            "postgresql",
            url,
            password_file=path("password_file"),
            password_env=table.get("password_env"),
            spool_dir=path("spool_dir") or state_dir / SPOOL_DIRNAME,
        )

    def describe(self) -> str:
        """The URL for messages and logs (it never holds a password)."""
        return self.url

    def toml(self) -> str:
        """These settings as a `[store]` table (paths absolute), for generated configs."""
        url = f"sqlite:///{self.sqlite_path}" if self.backend == "sqlite" else self.url
        lines = [f"url = {toml_string(url)}"]
        for key, value in (
            ("password_file", self.password_file),
            ("password_env", self.password_env),
            ("spool_dir", self.spool_dir),
        ):
            if value is not None:
                lines.append(f"{key} = {toml_string(str(value))}")
        return "[store]\n" + "\n".join(lines) + "\n"


def _sqlite_path(url: str, base: Path) -> Path:
    """``sqlite:///rel/path`` is relative to `base`, ``sqlite:////abs/path`` absolute
    (the convention SQLAlchemy and dj-database-url use)."""
    parts = urlsplit(url)
    if parts.netloc or parts.query or parts.fragment or not url.startswith("sqlite:///"):
        raise ValueError(
            f"url: {url!r} is not a SQLite URL: use sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    rest = url[len("sqlite:///") :]
    if not rest or rest.endswith("/"):
        raise ValueError(f"url: {url!r} names no database file")
    path = Path(rest)
    return path if path.is_absolute() else base / path


def _check_postgres_url(url: str) -> None:
    """A libpq URL without an inline password; its query (sslmode, ...) passes through."""
    parts = urlsplit(url)
    if parts.scheme not in _POSTGRES_SCHEMES:
        scheme = f"{parts.scheme}:" if parts.scheme.isalnum() else "(none)"
        raise ValueError(
            f"url: unsupported scheme {scheme}; use sqlite:///path/saltgate.db or "
            "postgresql://user@host:5432/dbname"
        )
    userinfo, at, _ = parts.netloc.rpartition("@")
    if at and ":" in userinfo:
        raise ValueError(
            "url: do not put the password in the URL; use password_file or password_env "
            "(the URL with its password is not shown)"
        )
    if any(key == "password" for key, _ in parse_qsl(parts.query, keep_blank_values=True)):
        raise ValueError(
            "url: do not put the password in the URL; use password_file or password_env "
            "(the URL with its password is not shown)"
        )
    if parts.fragment:
        raise ValueError("url: a PostgreSQL URL takes no #fragment")
