"""The simulator's answers, shaped as vLLM 0.32 shapes them on each route (pure).

Each generation shape turns a :class:`~saltgate.sim.engine.Generation` into a whole JSON
body or a stream of server-sent events, with vLLM's keys (null ones included, so a client
sees the same object) and vLLM's usage accounting:

- /v1/completions and /v1/chat/completions: `usage.prompt_tokens_details.cached_tokens`;
  chat also reports `created_cache_tokens` (prompt tokens its prefill wrote to the cache).
- /v1/responses: `usage.input_tokens` (the whole prompt),
  `input_tokens_details.cached_tokens` and `cache_write_tokens`, `output_tokens`.
- /v1/messages: Anthropic's split: `input_tokens` is the prompt minus
  `cache_read_input_tokens` minus `cache_creation_input_tokens`.

Pooling answers (embeddings, pooling, classify, score, rerank) carry deterministic vectors
derived from the prompt's token ids: same prompt, same vector, as a real model gives.
docs/conformance.md has the probes of real vLLM these follow.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import time
import uuid
from array import array
from collections.abc import AsyncGenerator, Iterable
from typing import Any

import orjson

from saltgate.sim.engine import Generation

__all__ = [
    "EMBEDDING_DIM",
    "CompletionShape",
    "MessagesShape",
    "ResponsesShape",
    "classify_body",
    "embedding",
    "embeddings_body",
    "rerank_body",
    "score_body",
]

SYSTEM_FINGERPRINT = "saltgate-sim"
EMBEDDING_DIM = 128
"""The tiny model's hidden size in the conformance suite, so vectors have its length."""
NUM_LABELS = 2


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:16]


def _openai_usage(gen: Generation, *, chat: bool, stream: bool, details_on: bool) -> dict[str, Any]:
    """vLLM's usage object; without --enable-prompt-tokens-details (``details_on``) it has
    no cached-token count: `prompt_tokens_details` null, or left out of a stream's."""
    details: dict[str, Any] = {
        "cached_tokens": gen.cached_tokens,
        "created_cache_tokens": gen.created_cache_tokens if chat else None,
        "multimodal_tokens": None,
    }
    usage: dict[str, Any] = {
        "prompt_tokens": gen.prompt_tokens,
        "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        "completion_tokens": gen.completion_tokens,
    }
    if stream:  # vLLM drops the unset fields of a stream's usage chunk
        if details_on:
            usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
    else:
        usage["prompt_tokens_details"] = details if details_on else None
        usage["completion_tokens_details"] = None
    return usage


class CompletionShape:
    """/v1/completions (``chat=False``) and /v1/chat/completions bodies and SSE chunks."""

    __slots__ = ("chat", "created", "details", "id", "model", "object")

    def __init__(self, chat: bool, model: str, *, details: bool = True) -> None:
        self.chat = chat
        self.details = details  # --enable-prompt-tokens-details
        self.model = model
        self.created = int(time.time())
        self.id = _id("chatcmpl-" if chat else "cmpl-")
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self, gen: Generation) -> bytes:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {
                "role": "assistant",
                "content": gen.text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
        else:
            choice["text"] = gen.text
        choice.update(
            logprobs=None, finish_reason=gen.finish_reason, stop_reason=None, token_ids=None
        )
        if not self.chat:
            choice.update(prompt_logprobs=None, prompt_token_ids=None)
        choice["routed_experts"] = None
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": _openai_usage(gen, chat=self.chat, stream=False, details_on=self.details),
        }
        if self.chat:
            body.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        body.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return orjson.dumps(body)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _delta(self, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice.update(delta={"content": text}, logprobs=None, finish_reason=finish)
            if finish is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        else:
            choice.update(
                text=text,
                logprobs=None,
                finish_reason=finish,
                stop_reason=None,
                prompt_token_ids=None,
                token_ids=None,
            )
        return choice

    def _role_chunk(self) -> bytes:
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([role], prompt_token_ids=None, prompt_text=None)

    async def sse(
        self,
        tokens: AsyncGenerator[str, None],
        gen: Generation,
        max_tokens: int,
        include_usage: bool,
    ) -> AsyncGenerator[bytes, None]:
        """vLLM's chunks: a chat's role chunk comes with the first token (after the
        prefill: a router may read the first chunk as "prefilled"); the last token's chunk
        carries the finish reason (the engine makes exactly ``max_tokens``); then the usage
        chunk if asked, then [DONE]."""
        try:
            role_pending = self.chat
            count = 0
            async for piece in tokens:
                if role_pending:
                    role_pending = False
                    yield self._role_chunk()
                count += 1
                if count < max_tokens:
                    yield self._chunk([self._delta(piece, None)])
                else:
                    yield self._last(self._delta(piece, gen.finish_reason), include_usage)
            if role_pending:
                yield self._role_chunk()
            if count < max_tokens:  # cut short: still say how it finished
                yield self._last(self._delta("", gen.finish_reason), include_usage)
            if include_usage:
                usage = _openai_usage(gen, chat=self.chat, stream=True, details_on=self.details)
                yield self._chunk([], usage=usage, system_fingerprint=SYSTEM_FINGERPRINT)
            yield b"data: [DONE]\n\n"
        finally:  # the client may leave: end the engine's request too
            await tokens.aclose()

    def _last(self, choice: dict[str, Any], include_usage: bool) -> bytes:
        """The fingerprint rides on the usage chunk if one follows, else on the last."""
        if include_usage:
            return self._chunk([choice])
        return self._chunk([choice], system_fingerprint=SYSTEM_FINGERPRINT)


def _event(kind: str, body: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"


class ResponsesShape:
    """/v1/responses: the Response object and its typed stream events."""

    __slots__ = ("created", "echo", "id", "item_id", "model")

    def __init__(
        self, model: str, *, instructions: str | None, max_output_tokens: int, body: dict[str, Any]
    ) -> None:
        self.model = model
        self.created = int(time.time())
        self.id = _id("resp_")
        self.item_id = _id("msg_")
        temperature, top_p = body.get("temperature"), body.get("top_p")
        self.echo = {
            "instructions": instructions,
            "max_output_tokens": max_output_tokens,
            "temperature": float(temperature) if isinstance(temperature, int | float) else 1.0,
            "top_p": float(top_p) if isinstance(top_p, int | float) else 1.0,
        }

    @staticmethod
    def usage(gen: Generation) -> dict[str, Any]:
        return {
            "input_tokens": gen.prompt_tokens,
            "input_tokens_details": {
                "cached_tokens": gen.cached_tokens,
                "cache_write_tokens": gen.created_cache_tokens,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": gen.completion_tokens,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
        }

    def _part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def _item(self, text: str | None) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "content": [] if text is None else [self._part(text, None)],
            "role": "assistant",
            "status": "in_progress" if text is None else "completed",
            "type": "message",
            "phase": None,
        }

    def response(self, gen: Generation | None) -> dict[str, Any]:
        """The Response object: in progress (``gen`` None) or finished."""
        incomplete = gen is not None and gen.finish_reason == "length"
        status = "in_progress" if gen is None else "incomplete" if incomplete else "completed"
        return {
            "id": self.id,
            "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.echo["instructions"],
            "metadata": None,
            "model": self.model,
            "object": "response",
            "output": [] if gen is None else [self._item(gen.text)],
            "parallel_tool_calls": True,
            "temperature": self.echo["temperature"],
            "tool_choice": "none",
            "tools": [],
            "top_p": self.echo["top_p"],
            "background": False,
            "max_output_tokens": self.echo["max_output_tokens"],
            "max_tool_calls": None,
            "previous_response_id": None,
            "prompt": None,
            "reasoning": None,
            "service_tier": "auto",
            "status": status,
            "text": None,
            "top_logprobs": None,
            "truncation": "disabled",
            "usage": None if gen is None else self.usage(gen),
            "user": None,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "input_messages": None,
            "output_messages": None,
        }

    def whole(self, gen: Generation) -> bytes:
        return orjson.dumps(self.response(gen))

    async def sse(
        self, tokens: AsyncGenerator[str, None], gen: Generation
    ) -> AsyncGenerator[bytes, None]:
        """vLLM's order: created and in_progress at once (before the prefill), the output
        item and part with the first token, a delta per token, then the done events and
        `response.completed` with the usage. No [DONE]."""
        try:
            seq = 0

            def event(kind: str, **fields: Any) -> bytes:
                nonlocal seq
                fields.update(sequence_number=seq, type=kind)
                out = _event(kind, dict(sorted(fields.items())))  # vLLM's events sort their keys
                seq += 1
                return out

            where = {"item_id": self.item_id, "output_index": 0}
            yield event("response.created", response=self.response(None))
            yield event("response.in_progress", response=self.response(None))
            first = True
            async for piece in tokens:
                if first:
                    first = False
                    yield event("response.output_item.added", item=self._item(None), output_index=0)
                    yield event(
                        "response.content_part.added",
                        content_index=0,
                        **where,
                        part=self._part("", []),
                    )
                yield event(
                    "response.output_text.delta",
                    content_index=0,
                    delta=piece,
                    item_id=self.item_id,
                    logprobs=[],
                    output_index=0,
                )
            text = gen.text
            yield event(
                "response.output_text.done",
                content_index=0,
                item_id=self.item_id,
                logprobs=[],
                output_index=0,
                text=text,
            )
            yield event(
                "response.content_part.done", content_index=0, **where, part=self._part(text, None)
            )
            yield event("response.output_item.done", item=self._item(text), output_index=0)
            yield event("response.completed", response=self.response(gen))
        finally:  # the client may leave: end the engine's request too
            await tokens.aclose()


class MessagesShape:
    """/v1/messages in Anthropic's shape (vLLM names the message like a chat completion)."""

    __slots__ = ("details", "id", "model")

    def __init__(self, model: str, *, details: bool = True) -> None:
        self.model = model
        self.details = details  # --enable-prompt-tokens-details
        self.id = _id("chatcmpl-")

    def usage(self, gen: Generation) -> dict[str, Any]:
        """Anthropic counts the uncached, unwritten rest as input_tokens (vLLM's split);
        without prompt-token details vLLM leaves the cache fields out, and input_tokens
        is the whole prompt."""
        if not self.details:
            return {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
        rest = gen.prompt_tokens - gen.cached_tokens - gen.created_cache_tokens
        return {
            "input_tokens": max(0, rest),
            "output_tokens": gen.completion_tokens,
            "cache_creation_input_tokens": gen.created_cache_tokens,
            "cache_read_input_tokens": gen.cached_tokens,
        }

    @staticmethod
    def _stop_reason(gen: Generation) -> str:
        return "max_tokens" if gen.finish_reason == "length" else "end_turn"

    def whole(self, gen: Generation) -> bytes:
        return orjson.dumps(
            {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": gen.text}],
                "model": self.model,
                "stop_reason": self._stop_reason(gen),
                "usage": self.usage(gen),
            }
        )

    async def sse(
        self, tokens: AsyncGenerator[str, None], gen: Generation
    ) -> AsyncGenerator[bytes, None]:
        """message_start comes with the first token (its usage: the whole prompt as
        input_tokens), a text block of deltas, then message_delta with the final usage."""
        try:
            started = False
            async for piece in tokens:
                if not started:
                    started = True
                    yield self._start(gen)
                delta = {"type": "text_delta", "text": piece}
                yield _event(
                    "content_block_delta",
                    {"type": "content_block_delta", "delta": delta, "index": 0},
                )
            if not started:
                yield self._start(gen)
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": self._stop_reason(gen), "stop_sequence": None},
                    "usage": self.usage(gen),
                },
            )
            yield _event("message_stop", {"type": "message_stop"})
        finally:  # the client may leave: end the engine's request too
            await tokens.aclose()

    def _start(self, gen: Generation) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0},
        }
        block = {"type": "text", "text": ""}
        return _event("message_start", {"type": "message_start", "message": message}) + _event(
            "content_block_start",
            {"type": "content_block_start", "content_block": block, "index": 0},
        )


# ------------------------------------------------------------------------------ pooling


def embedding(tokens: list[int]) -> list[float]:
    """A unit vector determined by the whole prompt (last-token pooling sees all of it),
    rounded to float32 as a model's output is."""
    seed = hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()
    rng = random.Random(seed)
    vec = [rng.gauss(0.0, 1.0) for _ in range(EMBEDDING_DIM)]
    norm = math.sqrt(sum(v * v for v in vec))
    return list(array("f", (v / norm for v in vec)))


def _pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _listing(prefix: str, model: str, data: list[dict[str, Any]], prompt_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "id": _id(prefix),
            "object": "list",
            "created": int(time.time()),
            "model": model,
            "data": data,
            "usage": _pooling_usage(prompt_tokens),
        }
    )


def embeddings_body(
    model: str, inputs: list[list[int]], *, pooling: bool, as_base64: bool
) -> bytes:
    """/v1/embeddings (``pooling=False``) or /pooling, which answers the same vector."""
    data = []
    for index, tokens in enumerate(inputs):
        vec: list[float] | str = embedding(tokens)
        if as_base64:
            vec = base64.b64encode(array("f", vec).tobytes()).decode()
        if pooling:
            data.append({"index": index, "object": "pooling", "data": vec})
        else:
            data.append({"index": index, "object": "embedding", "embedding": vec})
    prefix = "pooling-" if pooling else "embd-"
    return _listing(prefix, model, data, sum(len(t) for t in inputs))


def classify_body(model: str, inputs: list[list[int]]) -> bytes:
    """/classify with two labels, as a sequence classifier with a fresh head answers."""
    data = []
    for index, tokens in enumerate(inputs):
        logits = embedding(tokens)[:NUM_LABELS]
        peak = max(logits)
        exps = [math.exp(v - peak) for v in logits]
        probs = list(array("f", (e / sum(exps) for e in exps)))
        label = max(range(NUM_LABELS), key=probs.__getitem__)
        data.append(
            {"index": index, "label": f"LABEL_{label}", "probs": probs, "num_classes": NUM_LABELS}
        )
    return _listing("classify-", model, data, sum(len(t) for t in inputs))


def cosine_scores(queries: list[list[int]], documents: Iterable[list[int]]) -> list[float]:
    """A bi-encoder's scores: one query against every document, or query i with document i."""
    docs = [embedding(d) for d in documents]
    qs = [embedding(q) for q in queries]
    if len(qs) == 1:
        qs = qs * len(docs)
    return [
        float(array("f", [sum(a * b for a, b in zip(q, d, strict=True))])[0])
        for q, d in zip(qs, docs, strict=True)
    ]


def score_body(model: str, scores: list[float], prompt_tokens: int) -> bytes:
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return _listing("score-", model, data, prompt_tokens)


def rerank_body(
    model: str, documents: list[str], scores: list[float], top_n: int, prompt_tokens: int
) -> bytes:
    """Documents by falling relevance, the first ``top_n`` of them (all when 0)."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])
    if top_n:
        order = order[:top_n]
    results = [
        {
            "index": i,
            "document": {"text": documents[i], "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in order
    ]
    return orjson.dumps(
        {
            "id": _id("score-"),
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "results": results,
        }
    )
