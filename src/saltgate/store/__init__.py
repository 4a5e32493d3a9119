"""Persistent state: tenants and hashed API keys, the usage ledger, prices and reports.

One SQLite file (``state_dir/saltgate.db``, WAL) holds all of it, so the CLI and a running
gateway share it across processes without a server.
"""

from saltgate.prices import Price, parse_prices
from saltgate.store.ledger import Ledger, LedgerError, LedgerStats, UsageRecord
from saltgate.store.pricing import (
    TenantUsage,
    UsageFormat,
    format_usage,
    parse_since,
    usage_report,
)
from saltgate.store.tenants import (
    DB_FILENAME,
    ApiKeyInfo,
    KeyIndex,
    KeyNotFoundError,
    KeyRevokedError,
    Principal,
    StoreError,
    Tenant,
    TenantExistsError,
    TenantNotFoundError,
    TenantStore,
    db_path,
    hash_api_key,
    open_db,
)

__all__ = [
    "DB_FILENAME",
    "ApiKeyInfo",
    "KeyIndex",
    "KeyNotFoundError",
    "KeyRevokedError",
    "Ledger",
    "LedgerError",
    "LedgerStats",
    "Price",
    "Principal",
    "StoreError",
    "Tenant",
    "TenantExistsError",
    "TenantNotFoundError",
    "TenantStore",
    "TenantUsage",
    "UsageFormat",
    "UsageRecord",
    "db_path",
    "format_usage",
    "hash_api_key",
    "open_db",
    "parse_prices",
    "parse_since",
    "usage_report",
]
