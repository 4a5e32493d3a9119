"""The Responses API's server-side state, kept off the replicas (issue 40; docs/fields.md).

With its store on (VLLM_ENABLE_RESPONSES_API_STORE=1) vLLM keeps each response under its
id and answers anyone who names it: a `previous_response_id` continues that conversation
(its prompt built from the stored one), and GET, DELETE and cancel act on it, with no
owner check: an id is a bearer capability across tenants. Through saltgate the replicas
keep nothing: every /v1/responses request is forwarded with `store: false`, the fields
that only make sense with stored state are refused with a 400 that says why, and the
routes by id are not served (the gateway's 404 for an unknown route).

Pure: the request policy calls `check`; `request.prepare` sets `store`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from saltgate.derivations.derive import ROUTE_RESPONSES
from saltgate.policy.errors import ApiError, invalid_request, invalid_type

# Forwarded on every /v1/responses request, replacing the client's: vLLM's default is true.
STORE: Final = "store"
_NO_STATE: Final = "this deployment keeps no response state on its replicas"


def check(route: str, body: Mapping[str, Any], *, keeps: bool = False) -> str | None:
    """Refuse what needs a stored response (400 naming the parameter); with `keeps`
    ([responses] store), the id a request continues, for the gateway to check its owner."""
    if route != ROUTE_RESPONSES:
        return None
    previous = body.get("previous_response_id")
    if keeps and previous is not None:
        if not isinstance(previous, str) or not previous:
            raise invalid_type("previous_response_id", "a string")
    elif previous is not None:
        raise _refused(
            f"'previous_response_id' is not accepted: {_NO_STATE}. Send the conversation "
            "so far in 'input'.",
            "previous_response_id",
        )
    if body.get("background") not in (None, False):
        raise _refused(
            f"'background' is not accepted: a background response is kept to be fetched "
            f"later, and {_NO_STATE}. Stream the response instead.",
            "background",
        )
    return previous if keeps else None


def _refused(message: str, param: str) -> ApiError:
    return invalid_request(message, param=param, code="response_state_refused")
