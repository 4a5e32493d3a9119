"""A completion through a gateway or a replica, and the cache hit it reports."""

from __future__ import annotations

from typing import Any

import httpx

SIM_MODEL = "sim-model"  # what `saltgate sim` serves by default


async def complete(
    client: httpx.AsyncClient,
    prompt: object,
    *,
    model: str = SIM_MODEL,
    max_tokens: int = 2,
    **extra: Any,
) -> dict[str, Any]:
    """A short /v1/completions request; it must succeed."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    doc: dict[str, Any] = resp.json()
    return doc


def cached(doc: dict[str, Any]) -> int:
    """The cached prompt tokens a completion reports."""
    return int(doc["usage"]["prompt_tokens_details"]["cached_tokens"])
