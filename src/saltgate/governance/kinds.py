"""The vocabulary of governance, typed: limit kinds, priority bands, subjects.

Pure data. Each enum's values are the spellings stored in the database, written in JSON
and metric labels and sent to Redis, so a value never changes; code compares and keys by
the members (a `StrEnum` member equals, and hashes as, its string).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final, NamedTuple


class LimitKind(StrEnum):
    """A kind of limit a tenant or key can be held to (docs/limits.md)."""

    REQUESTS = "requests"
    INPUT_TOKENS = "input_tokens"
    OUTPUT_TOKENS = "output_tokens"
    CONCURRENCY = "concurrency"
    BUDGET = "budget"

    @property
    def script_code(self) -> str:
        """The Redis admission script's code for the kind: w (a sliding window of a
        minute), b (a budget, a sliding period) or c (concurrency leases)."""
        return _SCRIPT_CODES[self]


_SCRIPT_CODES: Final = {
    LimitKind.REQUESTS: "w",
    LimitKind.INPUT_TOKENS: "w",
    LimitKind.OUTPUT_TOKENS: "w",
    LimitKind.CONCURRENCY: "c",
    LimitKind.BUDGET: "b",
}
# The kinds counted per minute, in the order their quotas are reported.
WINDOWED: Final = (LimitKind.REQUESTS, LimitKind.INPUT_TOKENS, LimitKind.OUTPUT_TOKENS)


class Band(StrEnum):
    """An API key's priority band (issue 23), fixed when the key is created.

    When the replicas are saturated, every waiting request of a higher band goes before
    any of a lower one, and tenants are served fairly within a band. Keys are interactive
    unless created as batch, so an operator marks the traffic that can wait, not the
    traffic that cannot. Declared highest first.
    """

    INTERACTIVE = "interactive"
    BATCH = "batch"


BANDS: Final = tuple(Band)  # released strictly in this order
DEFAULT_BAND: Final = Band.INTERACTIVE


_BY_NAME: Final = {band.value: band for band in Band}


def band_of(priority: str) -> Band:
    """The band a key's stored priority names; anything unknown is interactive (the
    store's CHECK admits only the two). A dict lookup: it runs for every queued request."""
    return _BY_NAME.get(priority, DEFAULT_BAND)


class Scope(StrEnum):
    """Whose a limit is: the tenant's (every key of it) or one key's."""

    TENANT = "tenant"
    KEY = "key"


class Subject(NamedTuple):
    """Whom a limit holds: a tenant or a key, by id."""

    scope: Scope
    id: str
