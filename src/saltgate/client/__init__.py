"""saltgate's client SDK for client-keyed mode (docs/client-keyed.md).

The client keeps a `user_cache_secret` the operator never sees, splices it into each
generation request and seals the body with EHBP to the gateway's pinned (or first-seen)
key. Plug it into any httpx client through the transports, or get an official `openai`
client from the factories::

    client = saltgate.client.openai_client("https://gw.example/v1", api_key, pin="sha256:...")
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import httpx

from saltgate.client.secret import ENV_VAR, SecretStoreError, resolve_user_cache_secret
from saltgate.client.transport import (
    AsyncSaltgateTransport,
    GatewayKeyError,
    SaltgateTransport,
    splice_secret,
)

if TYPE_CHECKING:
    import openai

__all__ = [
    "ENV_VAR",
    "AsyncSaltgateTransport",
    "GatewayKeyError",
    "SaltgateTransport",
    "SecretStoreError",
    "async_openai_client",
    "openai_client",
    "resolve_user_cache_secret",
    "splice_secret",
]


def openai_client(
    base_url: str,
    api_key: str,
    *,
    user_cache_secret: str | None = None,
    pin: str | Iterable[str] | None = None,
    state_dir: Path | None = None,
    **kwargs: Any,
) -> openai.OpenAI:
    """An `openai.OpenAI` whose requests go through SaltgateTransport (extra kwargs pass on)."""
    import openai  # noqa: PLC0415 - an optional dependency (the "openai" extra)

    transport = SaltgateTransport(
        base_url, user_cache_secret=user_cache_secret, pin=pin, state_dir=state_dir
    )
    return openai.OpenAI(
        base_url=base_url,
        api_key=api_key,
        http_client=_legacy(httpx.Client(transport=transport)),
        **kwargs,
    )


def async_openai_client(
    base_url: str,
    api_key: str,
    *,
    user_cache_secret: str | None = None,
    pin: str | Iterable[str] | None = None,
    state_dir: Path | None = None,
    **kwargs: Any,
) -> openai.AsyncOpenAI:
    """An `openai.AsyncOpenAI` whose requests go through AsyncSaltgateTransport."""
    import openai  # noqa: PLC0415 - an optional dependency (the "openai" extra)

    transport = AsyncSaltgateTransport(
        base_url, user_cache_secret=user_cache_secret, pin=pin, state_dir=state_dir
    )
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key=api_key,
        http_client=_legacy(httpx.AsyncClient(transport=transport)),
        **kwargs,
    )


def _legacy(client: httpx.Client | httpx.AsyncClient) -> Any:
    """openai >= 3 annotates `http_client` as an httpx2 client but accepts an httpx one
    (its "legacy httpx" path); the transports here are httpx transports."""
    return cast(Any, client)
