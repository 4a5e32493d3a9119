"""An adversarial corpus for the multimodal request policy (issue 40), in every route's shape.

Each case is what an attacker tenant B sends to reach another tenant's multimodal cache
entry or the replicas' network, knowing the victim's uuids (``uuids``: the one the victim
sent and the one the replica saw): uuid-only parts, uuids beside B's own media, on text
parts, on parts without a type, nested (tool messages, Anthropic tool_result,
function_call_output), duplicated, as every modality, with a decoy member, with the mm
kwargs, as embeds, and media URLs into the serving network. A case either is refused or
reaches the replica with none of the victim's uuids: tests/gateway/test_multimodal.py
asserts that through the gateway in front of a recording replica.

Extensible: `cases` composes the families below; another family (e.g. non-multimodal
fields) adds a function returning `Case`s and a line in `cases`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
INTERNAL_URLS = (
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://127.0.0.1:22/",
    "https://10.0.0.1/x.png",
    "HTTP://[::1]:8000/metrics",
    "file:///etc/passwd",
)


def data_url(seed: str, size: int, mime: str = "image/png") -> str:
    """A data: URL of ``size`` bytes that only ``seed`` produces."""
    raw = (seed.encode() * (size // max(1, len(seed)) + 1))[:size]
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


@dataclass(frozen=True)
class Case:
    name: str
    route: str
    body: dict[str, Any] = field(default_factory=dict)
    raw: bytes | None = None  # sent as is (e.g. duplicate keys a JSON encoder cannot write)


def _chat(*parts: Any, role: str = "user", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": role, "content": list(parts)}], "max_tokens": 2, **extra}


def _anthropic(*blocks: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}], "max_tokens": 2, **extra}


def _responses(*items: Any) -> dict[str, Any]:
    return {"input": list(items), "max_output_tokens": 2}


def _uuid_parts(uuid: str, own: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """OpenAI-shaped parts carrying ``uuid``: null media, own media, every modality."""
    yield "image_url null", {"type": "image_url", "image_url": None, "uuid": uuid}
    yield "image_url url null", {"type": "image_url", "image_url": {"url": None}, "uuid": uuid}
    yield "image_url empty", {"type": "image_url", "image_url": {"url": ""}, "uuid": uuid}
    yield "image_url no member", {"type": "image_url", "uuid": uuid}
    yield "own image + uuid", {"type": "image_url", "image_url": {"url": own}, "uuid": uuid}
    yield "no type, null", {"image_url": None, "uuid": uuid}
    yield "no type, own image", {"image_url": {"url": own}, "uuid": uuid}
    yield "text part + uuid", {"type": "text", "text": "describe", "uuid": uuid}
    yield "uuid as number-like", {"type": "image_url", "image_url": None, "uuid": [uuid]}
    yield "video null", {"type": "video_url", "video_url": None, "uuid": uuid}
    yield "audio null", {"type": "audio_url", "audio_url": {"url": None}, "uuid": uuid}
    yield (
        "input_audio empty",
        {"type": "input_audio", "input_audio": {"format": "wav"}, "uuid": uuid},
    )
    yield "image_embeds null", {"type": "image_embeds", "image_embeds": None, "uuid": uuid}
    yield (
        "decoy member",
        {
            "type": "video_url",
            "video_url": {"url": own},
            "image_url": None,
            "uuid": uuid,
        },
    )
    yield "image_pil", {"type": "image_pil", "image_pil": None, "uuid": uuid}


def uuid_cases(uuids: list[str], own: str, model: str) -> Iterator[Case]:
    """Every route's shape, nested and duplicated, for each of the victim's uuids."""
    for n, uuid in enumerate(uuids):
        for label, part in _uuid_parts(uuid, own):
            name = f"uuid{n} {label}"
            yield Case(f"chat: {name}", CHAT, _chat(part))
            yield Case(f"chat dup: {name}", CHAT, _chat(part, part, {"type": "text", "text": "x"}))
            yield Case(
                f"chat tool msg: {name}",
                CHAT,
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [{"type": "text", "text": "a"}, part]},
                        {"role": "tool", "tool_call_id": "c", "content": [part]},
                    ],
                    "max_tokens": 2,
                },
            )
            yield Case(
                f"tokenize: {name}",
                "/tokenize",
                {"messages": [{"role": "user", "content": [part]}]},
            )
            yield Case(
                f"embeddings: {name}",
                "/v1/embeddings",
                {"messages": [{"role": "user", "content": [part]}]},
            )
            yield Case(
                f"score: {name}", "/score", {"queries": "q", "documents": [{"content": [part]}]}
            )
        response_parts: list[dict[str, Any]] = [
            {"type": "input_image", "image_url": None, "uuid": uuid},
            {"type": "input_image", "file_id": "file-x", "uuid": uuid},
            {"type": "input_image", "image_url": own, "uuid": uuid},
            {"type": "input_text", "text": "x", "uuid": uuid},
        ]
        for j, item in enumerate(response_parts):
            name = f"uuid{n} part{j}"
            yield Case(
                f"responses message: {name}",
                RESPONSES,
                _responses({"role": "user", "content": [item]}),
            )
            yield Case(f"responses bare: {name}", RESPONSES, _responses(item))
            yield Case(
                f"responses tool output: {name}",
                RESPONSES,
                _responses(
                    {"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "c", "output": [item]},
                ),
            )
        own_b64 = own.partition(",")[2]
        blocks = [
            {"type": "image", "source": None, "uuid": uuid},
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                "uuid": uuid,
            },
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": own_b64},
                "uuid": uuid,
            },
            {"type": "text", "text": "x", "uuid": uuid},
        ]
        for j, block in enumerate(blocks):
            name = f"uuid{n} block{j}"
            for route in (MESSAGES, COUNT_TOKENS):
                yield Case(f"{route}: {name}", route, _anthropic(block))
                yield Case(
                    f"{route} tool_result: {name}",
                    route,
                    _anthropic(
                        {"type": "tool_result", "tool_use_id": "t", "content": [block, block]}
                    ),
                )
        yield Case(
            f"chat mm kwargs: uuid{n}",
            CHAT,
            _chat(
                {"type": "image_url", "image_url": {"url": own}, "uuid": uuid},
                mm_processor_kwargs={"max_pixels": 1 << 30},
                media_io_kwargs={"video": {"num_frames": 100000}},
            ),
        )
        # A duplicate key: a lax parser keeps the last, a strict one the first.
        raw = (
            b'{"model":"'
            + model.encode()
            + b'","max_tokens":2,"messages":[{"role":"user","content":[{"type":'
            b'"image_url","image_url":null,"uuid":"decoy","uuid":"' + uuid.encode() + b'"}]}]}'
        )
        yield Case(f"chat duplicate uuid key: uuid{n}", CHAT, raw=raw)


def remote_cases() -> Iterator[Case]:
    """Media URLs a replica would fetch from inside the serving network."""
    for url in INTERNAL_URLS:
        yield Case(
            f"chat image {url}", CHAT, _chat({"type": "image_url", "image_url": {"url": url}})
        )
        yield Case(
            f"chat video {url}", CHAT, _chat({"type": "video_url", "video_url": {"url": url}})
        )
        yield Case(
            f"chat audio {url}", CHAT, _chat({"type": "audio_url", "audio_url": {"url": url}})
        )
        yield Case(f"chat no type {url}", CHAT, _chat({"image_url": url}))
        yield Case(
            f"responses {url}",
            RESPONSES,
            _responses({"role": "user", "content": [{"type": "input_image", "image_url": url}]}),
        )
        yield Case(
            f"tokenize {url}",
            "/tokenize",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                ]
            },
        )
        source = {"type": "url", "url": url}
        for route in (MESSAGES, COUNT_TOKENS):
            yield Case(
                f"{route} url image {url}", route, _anthropic({"type": "image", "source": source})
            )
            yield Case(
                f"{route} tool_result url image {url}",
                route,
                _anthropic(
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "image", "source": source}],
                    }
                ),
            )


def embeds_cases() -> Iterator[Case]:
    """Tensors the model server would torch.load."""
    for kind in ("image_embeds", "audio_embeds", "video_embeds"):
        yield Case(f"chat {kind}", CHAT, _chat({"type": kind, kind: "AAAA"}))
        yield Case(f"chat {kind} no type", CHAT, _chat({kind: "AAAA"}))
    yield Case("chat prompt_embeds part", CHAT, _chat({"type": "prompt_embeds", "data": "AAAA"}))
    yield Case(
        "completions prompt_embeds", "/v1/completions", {"prompt_embeds": "AAAA", "max_tokens": 2}
    )
    yield Case(
        "chat prompt_embeds field",
        CHAT,
        {**_chat({"type": "text", "text": "x"}), "prompt_embeds": "AAAA"},
    )


def cases(uuids: list[str], own: str, model: str) -> list[Case]:
    """The whole corpus: B's requests, given the victim's ``uuids`` and B's own media
    (bodies name no model: the sender adds it; ``raw`` bodies name ``model``)."""
    return [*uuid_cases(uuids, own, model), *remote_cases(), *embeds_cases()]
