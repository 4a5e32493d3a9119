"""Helpers for the configuration file's tables, shared by the sections that parse them.

Pure and neutral: `[store]` (store/settings.py) and `[cluster]` (routing/cluster.py) both
read a table that may name a password, and both write themselves back as TOML for
generated configs; neither should import the other's package to do so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def check_keys(table: Mapping[str, Any], known: set[str] | frozenset[str]) -> None:
    """A table that names a password (`[store]`, `[cluster]`) refuses an inline one and
    keys it does not know. Raises ValueError("<key>: <what is wrong>")."""
    if "password" in table:
        raise ValueError(
            "password: do not put secrets in the config file; use password_file or password_env"
        )
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key; expected some of {sorted(known)}")


def toml_string(value: str) -> str:
    """A TOML basic string: JSON's escapes are all TOML's too."""
    return json.dumps(value, ensure_ascii=True)
