"""Store errors: each message is safe to show (no key, password or salt) and says what to do."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed for a reason the operator can act on (message is safe)."""


class InvalidInputError(StoreError):
    """A value given to a store operation is not valid (a name, a list, a period)."""


class TenantExistsError(StoreError):
    """`create_tenant` was given a name that is already taken."""


class TenantNotFoundError(StoreError):
    """No tenant has the given name or id."""


class TenantArchivedError(StoreError):
    """The tenant was archived: it can no longer change or get keys."""


class KeyExpiredError(StoreError):
    """The key id names a key whose rotation grace period has ended."""


class KeyNotFoundError(StoreError):
    """No API key has the given key id."""


class KeyRevokedError(StoreError):
    """The key id names a key that was already revoked."""


class TokenNotFoundError(StoreError):
    """No admin token has the given id."""


class TokenRevokedError(StoreError):
    """The admin token id names a token that was already revoked."""


class PriceNotFoundError(StoreError):
    """The model has no price set through the store (its price, if any, is the config's)."""


class ConflictError(StoreError):
    """A write broke a uniqueness or reference constraint (either backend)."""


class StoreUnavailableError(StoreError):
    """The store has been unreachable for longer than the gateway may serve without it."""


class SchemaVersionError(StoreError):
    """The store's schema is not the version this saltgate uses: older (`saltgate store
    migrate` brings it up, explicitly) or newer (a newer saltgate migrated it). Nothing was
    changed. The CLI exits 2 on it, as on a configuration error."""
