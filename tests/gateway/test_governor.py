"""The one object of governance in the request path (gateway/governor.py), in process: a
request without limits and queue gets no pass, one with limits is admitted or refused as
a whole, and its pass frees what it holds when it settles, once.

Through a running gateway: tests/gateway/test_limits.py and test_fairshare.py."""

from __future__ import annotations

import asyncio

import pytest

from saltgate.derivations.derive import ROUTE_CHAT
from saltgate.gateway.admission import Admission
from saltgate.gateway.governor import Governance
from saltgate.gateway.usage import Usage
from saltgate.governance.limits import Limits
from saltgate.policy.errors import ApiError
from saltgate.prices import PriceBook
from saltgate.store.tenants import Principal

pytestmark = pytest.mark.unit


def principal(limits: Limits | None) -> Principal:
    return Principal("tn_1", "alice", "key_1", 0, limits=limits)


def test_no_limits_and_no_queue_means_no_pass() -> None:
    async def main() -> None:
        governance = Governance(Admission(PriceBook()), None)
        assert await governance.enter(principal(None), ROUTE_CHAT, "m", 100, None) is None
        weighted = Principal("tn_1", "alice", "key_1", 0, weight=2.0)  # a weight is no limit
        assert await governance.enter(weighted, ROUTE_CHAT, "m", 100, None) is None

    asyncio.run(main())


def test_a_pass_holds_its_lease_until_it_settles_and_settles_once() -> None:
    async def main() -> None:
        admission = Admission(PriceBook())
        governance = Governance(admission, None)
        alice = principal(Limits(concurrency=1, output_tpm=3000))
        first = await governance.enter(alice, ROUTE_CHAT, "m", 100, 1000)
        assert first is not None and first.headers is not None
        assert dict(first.headers)[b"x-ratelimit-remaining-tokens"] == b"2000"
        with pytest.raises(ApiError) as refused:
            await governance.enter(alice, ROUTE_CHAT, "m", 100, 1000)
        assert refused.value.status == 429 and "concurrent requests" in refused.value.message
        first.settle(Usage(prompt_tokens=10, cached_tokens=0, completion_tokens=10), 0)
        first.settle(None, None)  # a second ending: nothing more is freed or corrected
        second = await governance.enter(alice, ROUTE_CHAT, "m", 100, 1000)
        assert second is not None and second.headers is not None
        # 10 used by the first (corrected from 1000), 1000 reserved by the second.
        assert dict(second.headers)[b"x-ratelimit-remaining-tokens"] == b"1990"

    asyncio.run(main())


def test_a_pass_settles_input_tokens_as_the_uncached_ones() -> None:
    """`--input-tpm` counts uncached input (docs/limits.md): the prompt estimate reserved
    is corrected to the prompt the replica metered less what it had cached."""

    async def main() -> None:
        governance = Governance(Admission(PriceBook()), None)
        alice = principal(Limits(input_tpm=1000))
        first = await governance.enter(alice, ROUTE_CHAT, "m", 400, None)
        assert first is not None and first.headers is not None
        reserved = 1000 - int(dict(first.headers)[b"x-ratelimit-remaining-tokens"])
        first.settle(Usage(prompt_tokens=300, cached_tokens=250, completion_tokens=5), 0)
        second = await governance.enter(alice, ROUTE_CHAT, "m", 400, None)
        assert second is not None and second.headers is not None
        remaining = int(dict(second.headers)[b"x-ratelimit-remaining-tokens"])
        assert remaining == 1000 - 50 - reserved  # 300 - 250 used, the second's reserved

    asyncio.run(main())
