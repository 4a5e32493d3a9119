"""vLLM settings a multi-tenant replica must not run with, as simulator switches.

The positive controls of `saltgate audit deployment`'s engine-state checks
(docs/audit.md, "Engine state"): each switch makes a simulated replica answer as vLLM
does with the setting on, so a test shows the audit's finding appears. All off by default,
and then the simulator answers as it always does (embeds refused with vLLM's messages and
media taken from `data:` URLs only: saltgate.sim.multimodal; no store, no LoRA routes, no
per-request metrics, no KV tiers). The hooks run before the multimodal caches see a
request, so what a switch lets in (fetched media, embeds) is what those caches get.

- `responses_store`: VLLM_ENABLE_RESPONSES_API_STORE=1. Answers of /v1/responses with
  `store` (default true) are kept and served back by GET /v1/responses/{id} to anyone, as
  vLLM's store does (a minimal store: the answer body by id, and the conversation's text);
  a `previous_response_id` continues that conversation for anyone who names it, its text
  put before the new input (so the prompt, and the usage, grow as vLLM's do); an unknown
  one is vLLM's 404. Whole answers only: a streamed one is not kept.
- `fetch_media`: no --allowed-media-domains: every http(s) `image_url` of a chat request
  is fetched, redirects followed unless `media_redirects` is off
  (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0), and inlined as a `data:` URL for the media caches;
  an answer other than 2xx is vLLM's "Failed to fetch media" error.
- `prompt_embeds`: --enable-prompt-embeds: the field is handed to "torch.load", which
  here refuses anything that is not a torch file with vLLM's "could not be deserialized"
  (nothing is ever unpickled) and takes a torch file as one placeholder token.
- `mm_embeds`: --enable-mm-embeds: `image_embeds` chat parts are taken (and dropped).
- `runtime_lora`: VLLM_ALLOW_RUNTIME_LORA_UPDATING: /v1/load_lora_adapter and
  /v1/unload_lora_adapter exist (a path that is no adapter fails, an unknown name is a
  404 in vLLM's error shape, as vLLM answers).
- `per_request_metrics`: --enable-per-request-metrics: completions and chat answers carry
  `metrics` (engine-side time to first token, queue time).
- `kv_offloading_size` (GiB), `kv_offloading_backend`: --kv-offloading-size and its
  backend, in `vllm:cache_config_info`.
- `kv_connector`: a connector of --kv-transfer-config: "hf3fs" (its metric family, hits
  from disk), "lmcache" (LMCacheConnectorV1: no family, hits counted as external), or
  "nixl" (its family). Every prefix-cache hit is counted as the connector's as well.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from saltgate.sim.errors import SimError, route_not_found, vllm_validation

__all__ = ["CONNECTOR_FAMILIES", "UnsafeOptions", "UnsafeReplica"]

JSON = [(b"content-type", b"application/json")]
EMBED_PLACEHOLDER = 16  # a token id inside any vocabulary
CONNECTOR_FAMILIES = {
    "hf3fs": ("vllm:hf3fs_num_keys", "disk"),
    "nixl": ("vllm:nixl_xfer_time_seconds", "p2p"),
    "lmcache": (None, "external_unspecified"),
}
"""Per simulated connector: the metric family it registers (None: LMCache registers none)
and the `prompt_tokens_cached_by_source` source its hits count under."""


@dataclass(frozen=True, slots=True)
class UnsafeOptions:
    responses_store: bool = False
    fetch_media: bool = False
    media_redirects: bool = True  # VLLM_MEDIA_URL_ALLOW_REDIRECTS (vLLM's default: on)
    prompt_embeds: bool = False
    mm_embeds: bool = False
    runtime_lora: bool = False
    per_request_metrics: bool = False
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_connector: str | None = None

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_connector not in CONNECTOR_FAMILIES:
            known = ", ".join(CONNECTOR_FAMILIES)
            raise ValueError(f"kv_connector must be one of {known}, not {self.kv_connector!r}")


class UnsafeReplica:
    """The hooks SimServer calls; each does nothing unless its switch is on."""

    def __init__(self, options: UnsafeOptions) -> None:
        self.options = options
        self._stored: dict[str, bytes] = {}
        self._conversations: dict[str, str] = {}  # by response id: its text so far

    # -- requests --------------------------------------------------------------------------
    async def before_generate(self, route: bytes, body: dict[str, Any]) -> None:
        """Take what only these settings allow: `prompt_embeds`, `image_embeds` parts, media
        URLs (fetched), a stored conversation continued. Edits `body` in place; with a
        switch off, leaves it to the refusal."""
        if route == b"/v1/responses" and self.options.responses_store:
            previous = body.pop("previous_response_id", None)
            if previous is not None:
                body["input"] = self._continued(str(previous), body.get("input"))
        if route == b"/v1/completions" and self.options.prompt_embeds and "prompt_embeds" in body:
            if not _is_tensor(body.pop("prompt_embeds")):
                raise vllm_validation(
                    "`prompt_embeds` could not be deserialized as a torch tensor: "
                    "the simulator loads none",
                    "prompt_embeds",
                )
            body.setdefault("prompt", [EMBED_PLACEHOLDER])
        if route == b"/v1/chat/completions" and isinstance(body.get("messages"), list):
            for message in body["messages"]:
                if isinstance(message, dict) and isinstance(message.get("content"), list):
                    message["content"] = [
                        await self._part(part)
                        for part in message["content"]
                        if not self._embeds_taken(part)
                    ]

    def _continued(self, response_id: str, given: object) -> object:
        """The input with the stored conversation before it (no owner check, as vLLM's)."""
        before = self._conversations.get(response_id)
        if before is None:
            raise SimError(
                404,
                f"Response with id '{response_id}' not found.",
                "invalid_request_error",
                "previous_response_id",
            )
        if isinstance(given, str):
            return f"{before}\n{given}"
        if isinstance(given, list):
            return [{"role": "user", "content": before}, *given]
        return before

    def _embeds_taken(self, part: object) -> bool:
        """An `image_embeds` part --enable-mm-embeds lets in (dropped: nothing is loaded)."""
        return (
            isinstance(part, dict) and part.get("type") == "image_embeds" and self.options.mm_embeds
        )

    async def _part(self, part: Any) -> Any:
        """An http(s) `image_url` part, fetched and inlined as `data:` when media is fetched."""
        if not self.options.fetch_media or not isinstance(part, dict):
            return part
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if part.get("type") != "image_url" or not isinstance(url, str):
            return part
        if not url.startswith(("http://", "https://")):
            return part
        data = await _fetch(url, follow_redirects=self.options.media_redirects)
        inline = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
        return {**part, "image_url": {"url": inline}}

    def after_whole(self, route: bytes, body: dict[str, Any], answer: bytes) -> bytes:
        """The answer of a whole (not streamed) generation, as these settings change it."""
        if route == b"/v1/responses" and self.options.responses_store and body.get("store", True):
            doc = orjson.loads(answer)
            response_id = doc.get("id")
            if isinstance(response_id, str):
                self._stored[response_id] = answer
                said = " ".join(_texts(doc.get("output")))
                self._conversations[response_id] = f"{_text_of(body.get('input'))}\n{said}"
        completion = route in (b"/v1/completions", b"/v1/chat/completions")
        if completion and self.options.per_request_metrics:
            data = orjson.loads(answer)
            data["metrics"] = {
                "time_to_first_token_ms": 1.0,
                "generation_time_ms": 1.0,
                "queue_time_ms": 0.1,
                "mean_itl_ms": None,
                "tokens_per_second": None,
                "speculative_decoding": None,
            }
            return orjson.dumps(data)
        return answer

    # -- routes ----------------------------------------------------------------------------
    def route(self, method: bytes, path: bytes, body: bytes) -> tuple[int, bytes] | None:
        """An answer on a route only these settings add, else None (the route is unknown)."""
        if self.options.responses_store and method == b"GET" and path.startswith(b"/v1/responses/"):
            response_id = path.removeprefix(b"/v1/responses/").decode("utf-8", "replace")
            stored = self._stored.get(response_id)
            if stored is not None:
                return 200, stored
            raise SimError(
                404,
                f"Response with id '{response_id}' not found.",
                "invalid_request_error",
                "response_id",
            )
        lora = (b"/v1/load_lora_adapter", b"/v1/unload_lora_adapter")
        if self.options.runtime_lora and path in lora:
            if method != b"POST":
                raise route_not_found(405)
            return _lora_refusal(path, body)
        return None

    # -- /metrics --------------------------------------------------------------------------
    def cache_info(self) -> dict[str, str]:
        size = self.options.kv_offloading_size
        return {
            "kv_offloading_backend": self.options.kv_offloading_backend,
            "kv_offloading_size": "None" if size is None else str(size),
        }

    def connector_source(self) -> str | None:
        """Where the connector's hits count in prompt_tokens_cached_by_source, if any."""
        connector = self.options.kv_connector
        return CONNECTOR_FAMILIES[connector][1] if connector is not None else None

    def metrics_text(self) -> str:
        """The connector's own metric family, when it registers one."""
        connector = self.options.kv_connector
        family = CONNECTOR_FAMILIES[connector][0] if connector is not None else None
        if family is None:
            return ""
        return f"# HELP {family} Simulated connector metric.\n# TYPE {family} gauge\n{family} 0.0\n"


def _is_tensor(value: object) -> bool:
    """What vLLM's torch.load would take: here, any base64 of a zip file (torch's format);
    the simulator never unpickles it."""
    try:
        raw = base64.b64decode(value if isinstance(value, str) else "", validate=True)
    except (binascii.Error, ValueError):
        return False
    return raw.startswith(b"PK\x03\x04")


async def _fetch(url: str, *, follow_redirects: bool) -> bytes:
    """GET the URL as vLLM's media connector does without an allow-list (any host)."""
    try:
        async with httpx.AsyncClient(
            follow_redirects=follow_redirects, timeout=5, trust_env=False
        ) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        raise SimError(400, f"Failed to fetch media from URL: {type(exc).__name__}") from None
    if not response.is_success:
        raise SimError(422, f"Failed to fetch media from URL: HTTP {response.status_code} error")
    return response.content


def _lora_refusal(path: bytes, body: bytes) -> tuple[int, bytes]:
    """vLLM's answers to a name or a path that is no adapter: the route exists, the adapter
    not (a load fails; an unload of an unknown name is its own 404)."""
    try:
        name = orjson.loads(body).get("lora_name")
    except (orjson.JSONDecodeError, AttributeError):
        name = None
    if path.endswith(b"/unload_lora_adapter"):
        status, kind, message = 404, "NotFoundError", f"The lora adapter '{name}' cannot be found."
    else:
        status, kind, message = 400, "BadRequestError", f"Loading lora {name} failed: no adapter"
    error = {"message": message, "type": kind, "param": None, "code": status}
    return status, orjson.dumps({"error": error})


def _text_of(given: object) -> str:
    """The text of a Responses `input`: a string, or its messages' text."""
    if isinstance(given, str):
        return given
    return " ".join(_texts(given))


def _texts(items: object) -> list[str]:
    """Every string under a `content` or `text` member of a list of items."""
    found: list[str] = []
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        content = item.get("content", item.get("text"))
        if isinstance(content, str):
            found.append(content)
        elif isinstance(content, list):
            found.extend(_texts(content))
    return found
