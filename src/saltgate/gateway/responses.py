"""Responses kept on replicas, each its owner's only (`[responses] store = true`;
docs/fields.md, "Responses state").

vLLM's store answers anyone who names a response id. With the store on, the gateway
records who made each response and which replica holds it (the store's `responses`
table, so a restart and every gateway of a fleet know it), and lets only that tenant
continue it (`previous_response_id`, sent to the holding replica) or read, delete or
cancel it by id. Any other id, another tenant's included, gets the gateway's own answer
for an unknown id, the same bytes either way, and reaches no replica.
"""

from __future__ import annotations

import re
import time
from typing import Final

from saltgate.admin.store import AdminStore
from saltgate.policy.errors import ApiError
from saltgate.store.db import Database
from saltgate.store.settings import StoreSettings

BY_ID: Final = b"/v1/responses/"
_CANCEL: Final = "/cancel"
# The response's id: the first "id" of a whole answer, and of a stream's response.created.
_ID: Final = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9_-]{1,200})"')
_SAFE_ID: Final = re.compile(r"[A-Za-z0-9_-]{1,200}")


def response_id_in(data: bytes) -> str | None:
    """The response id an answer (or a stream's first events) carries, if any."""
    found = _ID.search(data)
    return None if found is None else found.group(1).decode()


def unknown_response(response_id: str) -> ApiError:
    """What an id that is not the caller's gets: vLLM's answer for an unknown id (the
    id echoed only when it is one a response could have)."""
    shown = response_id if _SAFE_ID.fullmatch(response_id) else "..."
    return ApiError(
        404,
        f"Response with id '{shown}' not found.",
        type="invalid_request_error",
        param="response_id",
    )


def by_id(method: bytes, path: bytes) -> tuple[str, bool] | None:
    """(id, cancel) for GET or DELETE /v1/responses/{id} and POST .../{id}/cancel; None
    for any other request."""
    if not path.startswith(BY_ID):
        return None
    rest = path[len(BY_ID) :].partition(b"?")[0].decode("utf-8", "replace")
    cancel = rest.endswith(_CANCEL)
    ident = rest[: -len(_CANCEL)] if cancel else rest
    if not ident or "/" in ident:
        return None
    if (method == b"POST") != cancel or method not in (b"GET", b"DELETE", b"POST"):
        return None
    return ident, cancel


class ResponseOwners:
    """The store's `responses` table, on its own thread."""

    def __init__(self, settings: StoreSettings) -> None:
        self._store = AdminStore(settings)

    async def record(self, response_id: str, tenant_id: str, replica: str) -> None:
        def write(db: Database) -> None:
            with db.transaction():
                db.execute(
                    "INSERT INTO responses (id, tenant_id, replica, created_at) "
                    "VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (response_id, tenant_id, replica, time.time()),
                )

        await self._store.run(write)

    async def replica_of(self, response_id: str, tenant_id: str) -> str | None:
        """The replica holding the tenant's response; None if the id is not the tenant's."""

        def read(db: Database) -> str | None:
            rows = db.query(
                "SELECT replica FROM responses WHERE id = ? AND tenant_id = ?",
                (response_id, tenant_id),
            )
            return str(rows[0][0]) if rows else None

        return await self._store.run(read)

    async def forget(self, response_id: str) -> None:
        def delete(db: Database) -> None:
            with db.transaction():
                db.execute("DELETE FROM responses WHERE id = ?", (response_id,))

        await self._store.run(delete)

    async def aclose(self) -> None:
        await self._store.aclose()
