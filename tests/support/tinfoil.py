"""The real EHBP client (tinfoil-ehbp) for interop tests, against a saltgate front end that
serves the key config: the gateway, or the EPP through Envoy."""

from __future__ import annotations

import ehbp
import httpx
from tests.support.http import async_client

from saltgate.ehbp.frames import KEYS_PATH


async def tinfoil_client(url: str, api_key: str) -> httpx.AsyncClient:
    """An httpx client on tinfoil-ehbp's transport, given the key config `url` serves
    (fetched first: a refused fetch fails the test there, not in the transport)."""
    async with async_client(timeout=30) as plain:
        offered = await plain.get(url + KEYS_PATH)
    assert offered.status_code == 200, offered.text
    identity = ehbp.ServerIdentity.unmarshal_public_config(offered.content)
    return async_client(
        base_url=url,
        transport=ehbp.AsyncEHBPTransport(identity),
        headers={"authorization": f"Bearer {api_key}"},
        timeout=30,
    )
