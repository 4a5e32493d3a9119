"""Store errors: each message is safe to show (no key, password or salt) and says what to do."""

from __future__ import annotations


class StoreError(Exception):
    """A store operation failed for a reason the operator can act on (message is safe)."""


class TenantExistsError(StoreError):
    """`create_tenant` was given a name that is already taken."""


class TenantNotFoundError(StoreError):
    """No tenant has the given name or id."""


class KeyNotFoundError(StoreError):
    """No API key has the given key id."""


class KeyRevokedError(StoreError):
    """The key id names a key that was already revoked."""


class ConflictError(StoreError):
    """A write broke a uniqueness or reference constraint (either backend)."""


class StoreUnavailableError(StoreError):
    """The store has been unreachable for longer than the gateway may serve without it."""
