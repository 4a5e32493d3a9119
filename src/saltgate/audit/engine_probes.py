"""The deployment audit's engine-state probes: the shell around saltgate.audit.engine_state
and saltgate.audit.kv_tiers.

Per replica, straight to it with its own key: a Responses create-then-read, a chat request
whose image URL is this audit's loopback listener (:class:`MediaListener`), `prompt_embeds`
and `image_embeds` that are no tensor, the LoRA load and unload routes with a name and path
that do not exist, a one-token completion; then /metrics for the KV tiers. Every request
is harmless: one output token, a prompt of two words under a random `cache_salt` (no one's
namespace), bytes nothing can load. What stays behind: on a replica whose Responses store
is on, the one-token probe response (vLLM has no delete), which the finding says.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from typing import Any

import httpx
import orjson

from saltgate.audit.engine_state import (
    MediaProbe,
    ProbeAnswer,
    judge_lora_routes,
    judge_media_fetch,
    judge_mm_embeds,
    judge_per_request_metrics,
    judge_prompt_embeds,
    judge_responses_store,
)
from saltgate.audit.findings import Finding
from saltgate.audit.kv_tiers import judge_kv_tiers

__all__ = ["MediaListener", "probe_engine_state"]

PROMPT = "Say OK."
NOT_A_TENSOR = base64.b64encode(b"saltgate audit probe: not a tensor").decode()
_MAX_REQUEST_HEAD = 16 * 1024


class MediaListener:
    """A tiny HTTP server on 127.0.0.1: `/sgaudit/TOKEN/image.png` redirects to
    `/sgaudit/TOKEN/moved.png`, which is a 404, so a replica that fetches gets an HTTP
    error and never media. It records which of the two each token's fetcher asked for."""

    def __init__(self) -> None:
        self._server: asyncio.Server | None = None
        self._port = 0
        self._seen: set[str] = set()

    async def __aenter__(self) -> MediaListener:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def authority(self) -> str:
        return f"127.0.0.1:{self._port}"

    def url(self, token: str) -> str:
        return f"http://{self.authority}/sgaudit/{token}/image.png"

    def seen(self, token: str) -> tuple[bool, bool]:
        """(fetched, followed the redirect) for one token."""
        return f"/sgaudit/{token}/image.png" in self._seen, f"/sgaudit/{token}/moved.png" in (
            self._seen
        )

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            parts = head[:_MAX_REQUEST_HEAD].split(b" ", 2)
            path = parts[1].decode("ascii", "replace") if len(parts) > 2 else ""
            self._seen.add(path)
            if path.startswith("/sgaudit/") and path.endswith("/image.png"):
                moved = path.removesuffix("image.png") + "moved.png"
                status = f"302 Found\r\nlocation: http://{self.authority}{moved}"
            else:
                status = "404 Not Found"
            writer.write(
                f"HTTP/1.1 {status}\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".encode()
            )
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def _send(
    client: httpx.AsyncClient, url: str, headers: dict[str, str], body: dict[str, Any] | None
) -> ProbeAnswer:
    try:
        if body is None:
            response = await client.get(url, headers=headers)
        else:
            response = await client.post(
                url,
                content=orjson.dumps(body),
                headers={"content-type": "application/json", **headers},
            )
    except httpx.HTTPError:
        return ProbeAnswer(None)
    return ProbeAnswer(response.status_code, response.content)


def _model(answer: ProbeAnswer) -> str:
    data = answer.json()
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        return ""


async def probe_engine_state(
    client: httpx.AsyncClient,
    url: str,
    headers: dict[str, str],
    listener: MediaListener,
    *,
    kept: bool = False,
) -> list[Finding]:
    """Every engine-state probe of one replica, and the KV tiers of its /metrics; `kept`:
    the gateway keeps responses for their owners ([responses] store), so the store is on
    by design."""
    base = url.rstrip("/")
    models = await _send(client, base + "/v1/models", headers, None)
    model = _model(models)
    salt = f"sgaudit-{secrets.token_hex(8)}"

    async def post(path: str, body: dict[str, Any], *, with_model: bool = True) -> ProbeAnswer:
        if models.status != 200:  # unreachable or no key: every probe would say the same
            return ProbeAnswer(models.status, models.body)
        return await _send(
            client, base + path, headers, {"model": model, **body} if with_model else body
        )

    def chat(part: dict[str, Any]) -> dict[str, Any]:
        content = [part, {"type": "text", "text": PROMPT}]
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 1}

    findings: list[Finding] = []
    create = await post(
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 1, "store": True, "cache_salt": salt},
    )
    read = None
    created = create.json() if create.status == 200 else None
    if isinstance(created, dict) and isinstance(created.get("id"), str):
        read = await _send(client, f"{base}/v1/responses/{created['id']}", headers, None)
    findings.append(judge_responses_store(url, create, read, kept=kept))

    token = secrets.token_hex(8)
    image = {"type": "image_url", "image_url": {"url": listener.url(token)}}
    answer = await post("/v1/chat/completions", {**chat(image), "cache_salt": salt})
    fetched, redirected = listener.seen(token)
    media = MediaProbe(answer, fetched, redirected, listener.authority)
    findings.append(judge_media_fetch(url, media))

    embeds = {"prompt_embeds": NOT_A_TENSOR, "max_tokens": 1}
    findings.append(judge_prompt_embeds(url, await post("/v1/completions", embeds)))
    part = {"type": "image_embeds", "image_embeds": NOT_A_TENSOR}
    findings.append(judge_mm_embeds(url, await post("/v1/chat/completions", chat(part))))

    name = f"sgaudit-{secrets.token_hex(8)}"
    lora = {"lora_name": name, "lora_path": f"/nonexistent/saltgate-audit/{name}"}
    load = await post("/v1/load_lora_adapter", lora, with_model=False)
    unload = await post("/v1/unload_lora_adapter", {"lora_name": name}, with_model=False)
    findings.append(judge_lora_routes(url, load, unload))

    completion = {"prompt": PROMPT, "max_tokens": 1, "cache_salt": salt}
    findings.append(judge_per_request_metrics(url, await post("/v1/completions", completion)))

    metrics = await _send(client, base + "/metrics", headers, None)
    text = metrics.body.decode("utf-8", "replace") if metrics.status == 200 else None
    findings += judge_kv_tiers(url, text)
    return findings
