"""The Responses state policy (policy/responses.py, issue 40): off, the fields that need a
stored response are refused; with [responses] store on (`keeps`), the id a request
continues is handed back for the gateway's owner check, and only a non-empty string is."""

from __future__ import annotations

from typing import Any

import pytest

from saltgate.policy.errors import ApiError
from saltgate.policy.responses import check

pytestmark = pytest.mark.unit

RESPONSES = "/v1/responses"


def _refusal(body: dict[str, Any], *, keeps: bool = False) -> ApiError:
    with pytest.raises(ApiError) as caught:
        check(RESPONSES, body, keeps=keeps)
    return caught.value


def test_off_refuses_what_needs_a_stored_response() -> None:
    for body, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
    ):
        refused = _refusal(body)
        assert refused.status == 400
        assert refused.param == param and refused.code == "response_state_refused"
    assert check(RESPONSES, {"input": "hi", "background": False}) is None


def test_kept_hands_back_the_continued_id_for_the_owner_check() -> None:
    assert check(RESPONSES, {"previous_response_id": "resp_1"}, keeps=True) == "resp_1"
    assert check(RESPONSES, {"input": "hi"}, keeps=True) is None
    for bad in ("", 7, ["resp_1"]):
        refused = _refusal({"previous_response_id": bad}, keeps=True)
        assert refused.status == 400 and refused.code == "invalid_type"
    # background stays refused with the store on: no GET-polling for it.
    assert _refusal({"background": True}, keeps=True).param == "background"


def test_other_routes_are_not_its_business() -> None:
    body = {"previous_response_id": "resp_1", "background": True}
    assert check("/v1/chat/completions", body) is None
    assert check("/v1/chat/completions", body, keeps=True) is None
