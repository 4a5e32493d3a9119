"""`saltgate sim`: the replica simulator's OpenAI-compatible HTTP API, shaped like vLLM's.

Routes, status codes, error bodies, SSE framing, usage (with
`prompt_tokens_details.cached_tokens`), cache_salt validation and metric names follow what
vLLM's OpenAI server does, so the gateway, the router and the audit meet here what they
meet in production. Deliberately left out: sampling, logprobs, n > 1, tools, embeddings.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson

from saltgate.http import HttpServer, Request, Response
from saltgate.sim.blockpool import BlockPool
from saltgate.sim.engine import ContextTooLong, Generation, ReplicaEngine, TimeModel
from saltgate.sim.tokenizer import VOCAB_SIZE, apply_chat_template, tokenize

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
DEFAULT_MAX_TOKENS = 16
SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 4096
    hash_algo: str = "sha256"
    api_key: str | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    prefill_ms_per_1k_tokens: float = 20.0
    decode_ms_per_token: float = 2.0
    max_concurrency: int = 64
    max_model_len: int = 32768
    max_body_bytes: int = 32 * 1024 * 1024


class SimError(Exception):
    """An error answered in vLLM's error shape."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def error_response(status: int, message: str, err_type: str = "BadRequestError") -> Response:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return Response(status, list(JSON), orjson.dumps(body))


def validate_cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's checks, with vLLM's messages: non-empty string, <= 128 chars, no @ / \\ NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise SimError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(salt) > 128 or any(c in salt for c in SALT_FORBIDDEN):
        raise SimError(
            400,
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
        )
    return salt


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SimError(400, f"'{name}' must be a non-negative integer.")
    return value


def prompt_tokens(route: bytes, body: dict[str, Any]) -> list[int]:
    """The request's prompt as token ids: text, token ids, or chat messages."""
    if route == b"/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimError(400, "'messages' must be a non-empty list of message objects.")
        try:
            return apply_chat_template(messages)
        except ValueError as exc:
            raise SimError(400, str(exc)) from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise SimError(400, "Either prompt or prompt_embeds must be provided and non-empty.")
        return tokenize(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < VOCAB_SIZE), None)
        if bad is not None:
            raise SimError(400, f"Token id {bad} is out of vocabulary")
        return list(prompt)
    raise SimError(400, "'prompt' must be a non-empty string or a non-empty list of token ids.")


class SimServer:
    """The HTTP face of one simulated replica."""

    def __init__(self, config: SimConfig, publish: Any = None) -> None:
        self.config = config
        self.engine = ReplicaEngine(
            pool=BlockPool(config.num_blocks, config.block_size, config.hash_algo),
            time_model=TimeModel(config.prefill_ms_per_1k_tokens, config.decode_ms_per_token),
            max_concurrency=config.max_concurrency,
            max_model_len=config.max_model_len,
            publish=publish,
        )
        self.http = HttpServer(
            self.handle, max_body_bytes=config.max_body_bytes, error_response=error_response
        )
        self._api_key = config.api_key.encode() if config.api_key else None
        self._models_body = orjson.dumps(
            {
                "object": "list",
                "data": [
                    {
                        "id": config.model,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": config.model,
                        "parent": None,
                        "max_model_len": config.max_model_len,
                    }
                ],
            }
        )

    async def start(self) -> int:
        return await self.http.start(self.config.host, self.config.port)

    async def close(self) -> None:
        await self.http.close()

    # -- routing ---------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        path = request.path
        headers = [(b"server", b"saltgate-sim"), (b"x-request-id", uuid.uuid4().hex.encode())]
        if path.startswith(b"/v1") and not self._authorized(request):
            return Response(401, JSON + headers, b'{"error":"Unauthorized"}')
        try:
            response = await self._route(request)
        except SimError as exc:
            response = error_response(exc.status, exc.message, exc.err_type)
        response.headers.extend(headers)
        return response

    def _authorized(self, request: Request) -> bool:
        if self._api_key is None:
            return True
        presented = request.header(b"authorization") or b""
        return hmac.compare_digest(presented, b"Bearer " + self._api_key)

    async def _route(self, request: Request) -> Response:
        method, path = request.method, request.path
        if method == b"GET":
            if path == b"/health":
                return Response(200)
            if path == b"/v1/models":
                return Response(200, list(JSON), self._models_body)
            if path == b"/metrics":
                return Response(
                    200, [(b"content-type", b"text/plain; version=0.0.4")], self.metrics()
                )
        elif method == b"POST":
            if path in (b"/v1/completions", b"/v1/chat/completions"):
                return await self._generate(path, request.body)
            if path == b"/reset_prefix_cache":
                ok = self.engine.reset_prefix_cache()
                return Response(200 if ok else 409)
        raise SimError(404, "Not Found", "NotFoundError")

    # -- generation ------------------------------------------------------------------------
    async def _generate(self, route: bytes, raw: bytes) -> Response:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SimError(400, f"The request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise SimError(400, "The request body must be a JSON object.")
        model = body.get("model")
        if model != self.config.model:
            raise SimError(404, f"The model `{model}` does not exist.", "NotFoundError")
        salt = validate_cache_salt(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool | None):
            raise SimError(400, "'stream' must be a boolean.")
        options = body.get("stream_options")
        if options is not None and not stream:
            raise SimError(400, "Stream options can only be defined when `stream=True`.")
        if options is not None and not isinstance(options, dict):
            raise SimError(400, "'stream_options' must be an object.")
        max_tokens = _int_field(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        prompt = prompt_tokens(route, body)
        try:
            self.engine.check_fits(len(prompt), max_tokens)
        except ContextTooLong as exc:
            raise SimError(400, str(exc)) from None
        shape = _Shape(route == b"/v1/chat/completions", str(model))
        gen = Generation(prompt_tokens=len(prompt))
        tokens = self.engine.generate(prompt, max_tokens, salt, gen)
        if stream:
            include_usage = bool(options and options.get("include_usage"))
            return Response(200, list(SSE), stream=shape.sse(tokens, gen, include_usage))
        async for _ in tokens:
            pass
        return Response(200, list(JSON), shape.whole(gen))

    # -- metrics ---------------------------------------------------------------------------
    def metrics(self) -> bytes:
        cfg, engine, pool = self.config, self.engine, self.engine.pool
        labels = f'engine="0",model_name="{cfg.model}"'
        info = (
            f'block_size="{cfg.block_size}",enable_prefix_caching="True",'
            f'num_gpu_blocks="{cfg.num_blocks}",prefix_caching_hash_algo="{cfg.hash_algo}"'
        )
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(engine.num_running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(engine.num_waiting)}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {pool.usage}",
            "# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of tokens.",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} {float(pool.queries_tokens)}",
            "# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of tokens.",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} {float(pool.hits_tokens)}",
            "# HELP vllm:request_success Count of successfully processed requests.",
            "# TYPE vllm:request_success counter",
            f"vllm:request_success_total{{{labels}}} {float(engine.requests_finished)}",
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{info}}} 1.0",
        ]
        return ("\n".join(lines) + "\n").encode()


class _Shape:
    """Builds vLLM-shaped completion / chat-completion bodies and SSE chunks."""

    __slots__ = ("chat", "created", "id", "model", "object")

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if chat else "text_completion"

    def usage(self, gen: Generation) -> dict[str, Any]:
        return {
            "prompt_tokens": gen.prompt_tokens,
            "total_tokens": gen.prompt_tokens + gen.completion_tokens,
            "completion_tokens": gen.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
        }

    def whole(self, gen: Generation) -> bytes:
        text = gen.text
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": gen.finish_reason,
                "stop_reason": None,
            }
        return orjson.dumps(
            {
                "id": self.id,
                "object": self.object,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": self.usage(gen),
            }
        )

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def _delta(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        return {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }

    def _role_chunk(self) -> bytes:
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._chunk([role], None)

    async def sse(
        self, tokens: AsyncIterator[str], gen: Generation, include_usage: bool
    ) -> AsyncGenerator[bytes, None]:
        # vLLM sends a chat stream's role chunk with its first output, after the prefill:
        # a router that reads the first chunk as "prefilled" sees the same here.
        role_pending = self.chat
        async for piece in tokens:
            if role_pending:
                role_pending = False
                yield self._role_chunk()
            yield self._chunk([self._delta(piece, None)], None)
        if role_pending:
            yield self._role_chunk()
        yield self._chunk([self._delta("", gen.finish_reason)], None)
        if include_usage:
            yield self._chunk([], self.usage(gen))
        yield b"data: [DONE]\n\n"
