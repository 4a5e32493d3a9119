"""`saltgate sim`: the replica simulator's HTTP API, shaped like vLLM's.

Thin: routing, the API key, and running requests through the engine. What a request may
say and how vLLM refuses it is saltgate.sim.protocol; the answers' shapes are
saltgate.sim.shapes; vLLM's error bodies are saltgate.sim.errors; the metrics are
saltgate.sim.metrics. docs/conformance.md records what real vLLM 0.32 answers on each route
and tests/conformance proves the simulator answers the same.

One simulated replica serves the generation routes and the pooling routes (embeddings,
pooling, classify, score, rerank) at once, where a vLLM replica serves one set or the
other depending on its model; it has no audio transcription.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from saltgate.http import HttpServer, Request, Response
from saltgate.http.tls import server_context
from saltgate.sim import protocol as p
from saltgate.sim import shapes
from saltgate.sim.blockpool import BlockPool
from saltgate.sim.engine import ContextTooLong, Generation, ReplicaEngine, TimeModel
from saltgate.sim.errors import (
    SimError,
    anthropic_error_body,
    openai_error_body,
    route_not_found,
)
from saltgate.sim.metrics import render
from saltgate.sim.multimodal import MediaCache
from saltgate.sim.tokenizer import decode, pieces
from saltgate.sim.unsafe import UnsafeOptions, UnsafeReplica

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
GUARDED_PREFIXES = (b"/v1", b"/v2", b"/inference", b"/cohere")
"""The paths vLLM's --api-key guards; /tokenize, /pooling, /score, /rerank... stay open."""
ANTHROPIC_ROUTES = (b"/v1/messages", b"/v1/messages/count_tokens")


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 4096
    hash_algo: str = "sha256"
    api_key: str | None = None
    # vLLM's flags of the same names; on by default here (vLLM's prompt-token details are
    # off by default) so answers carry what saltgate needs unless a test turns one off.
    enable_prompt_tokens_details: bool = True
    enable_prefix_caching: bool = True
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    prefill_ms_per_1k_tokens: float = 20.0
    max_num_batched_tokens: int = 0  # vLLM's flags of the same names (docs/sim.md)
    long_prefill_token_threshold: int = 0
    decode_ms_per_token: float = 2.0
    max_concurrency: int = 64
    max_model_len: int = 32768
    max_body_bytes: int = 32 * 1024 * 1024
    # Serve https (the TLS-terminating sidecar of a vLLM replica), requiring a client
    # certificate from tls_client_ca when given (mutual TLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # vLLM settings a multi-tenant replica must not run with (saltgate.sim.unsafe): the
    # positive controls of the deployment audit's engine-state checks. All off.
    unsafe: UnsafeOptions = field(default_factory=UnsafeOptions)


def error_response(status: int, message: str) -> Response:
    """The HTTP layer's own refusals (body too large, bad framing) in vLLM's error shape."""
    return Response(status, list(JSON), openai_error_body(SimError(status, message)))


Route = Callable[[Request], Awaitable[Response]]


class SimServer:
    """The HTTP face of one simulated replica."""

    def __init__(self, config: SimConfig, publish: Any = None) -> None:
        self.config = config
        self.limits = p.Limits(config.model, config.max_model_len)
        self.engine = ReplicaEngine(
            pool=BlockPool(
                config.num_blocks,
                config.block_size,
                config.hash_algo,
                enable_caching=config.enable_prefix_caching,
            ),
            time_model=TimeModel(
                config.prefill_ms_per_1k_tokens,
                config.decode_ms_per_token,
                config.max_num_batched_tokens,
                config.long_prefill_token_threshold,
            ),
            max_concurrency=config.max_concurrency,
            max_model_len=config.max_model_len,
            publish=publish,
        )
        self.http = HttpServer(
            self.handle, max_body_bytes=config.max_body_bytes, error_response=error_response
        )
        self._api_key = config.api_key.encode() if config.api_key else None
        self.media = MediaCache()  # vLLM's multimodal caches: keyed without the salt
        self.unsafe = UnsafeReplica(config.unsafe)
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
        self._post: dict[bytes, Route] = {
            b"/v1/completions": self._generate,
            b"/v1/chat/completions": self._generate,
            b"/v1/responses": self._generate,
            b"/v1/messages": self._generate,
            b"/v1/messages/count_tokens": self._count_tokens,
            b"/v1/embeddings": self._embeddings,
            b"/pooling": self._embeddings,
            b"/classify": self._classify,
            b"/score": self._score,
            b"/v1/score": self._score,
            b"/rerank": self._score,
            b"/v1/rerank": self._score,
            b"/v2/rerank": self._score,
            b"/tokenize": self._tokenize,
            b"/detokenize": self._detokenize,
            b"/reset_prefix_cache": self._reset_prefix_cache,
        }
        self._get: dict[bytes, Route] = {
            b"/health": self._health,
            b"/v1/models": self._models,
            b"/metrics": self._metrics,
        }

    async def start(self) -> int:
        cfg = self.config
        tls = None
        if cfg.tls_cert is not None:
            key = Path(cfg.tls_key) if cfg.tls_key else None  # None: in the cert's file
            ca = Path(cfg.tls_client_ca) if cfg.tls_client_ca else None
            tls = server_context(Path(cfg.tls_cert), key, ca)
        return await self.http.start(cfg.host, cfg.port, tls=tls)

    async def close(self) -> None:
        await self.http.close()

    # -- routing ---------------------------------------------------------------------------
    async def handle(self, request: Request) -> Response:
        path = request.path
        headers = [(b"server", b"saltgate-sim"), (b"x-request-id", uuid.uuid4().hex.encode())]
        if path.startswith(GUARDED_PREFIXES) and not self._authorized(request):
            return Response(401, JSON + headers, b'{"error":"Unauthorized"}')
        try:
            response = await self._route(request)
        except SimError as exc:
            shape = anthropic_error_body if path in ANTHROPIC_ROUTES else openai_error_body
            response = Response(exc.status, list(JSON), shape(exc))
        response.headers.extend(headers)
        return response

    def _authorized(self, request: Request) -> bool:
        """vLLM's check: `Authorization: Bearer KEY`, the scheme in any case."""
        if self._api_key is None:
            return True
        scheme, _, presented = (request.header(b"authorization") or b"").partition(b" ")
        ok = hmac.compare_digest(presented, self._api_key)
        return ok and scheme.lower() == b"bearer"

    async def _route(self, request: Request) -> Response:
        table = self._post if request.method == b"POST" else self._get
        route = table.get(request.path) if request.method in (b"POST", b"GET") else None
        if route is None:
            extra = self.unsafe.route(request.method, request.path, request.body)
            if extra is not None:
                return Response(extra[0], list(JSON), extra[1])
            known = request.path in self._post or request.path in self._get
            raise route_not_found(405 if known else 404)
        return await route(request)

    def _body(self, request: Request) -> dict[str, Any]:
        body = p.read_json(request.body, request.header(b"content-type"))
        return self.media.resolve(request.path, body)

    # -- generation ------------------------------------------------------------------------
    async def _generate(self, request: Request) -> Response:
        route, model = request.path, self.config.model
        body = p.read_json(request.body, request.header(b"content-type"))
        await self.unsafe.before_generate(route, body)  # before the media: what it takes
        body = self.media.resolve(route, body)
        if route == b"/v1/messages":
            req = p.parse_messages(body, self.limits)
        else:
            p.validate_cache_salt(body)
            parse = {
                b"/v1/completions": p.parse_completion,
                b"/v1/chat/completions": p.parse_chat,
                b"/v1/responses": p.parse_responses,
            }[route]
            req = parse(body, self.limits)
        self._check_fits(len(req.prompt), req.max_tokens)
        gen = Generation(prompt_tokens=len(req.prompt))
        tokens = self.engine.generate(req.prompt, req.max_tokens, req.cache_salt, gen)
        if route == b"/v1/responses":
            echo = req.requested_max_tokens or req.max_tokens
            shape: Any = shapes.ResponsesShape(
                model, instructions=req.instructions, max_output_tokens=echo, body=body
            )
            stream = shape.sse(tokens, gen) if req.stream else None
        elif route == b"/v1/messages":
            shape = shapes.MessagesShape(model, details=self.config.enable_prompt_tokens_details)
            stream = shape.sse(tokens, gen) if req.stream else None
        else:
            shape = shapes.CompletionShape(
                route == b"/v1/chat/completions",
                model,
                details=self.config.enable_prompt_tokens_details,
            )
            stream = (
                shape.sse(tokens, gen, req.max_tokens, req.include_usage) if req.stream else None
            )
        if stream is not None:
            return Response(200, list(SSE), stream=stream)
        async for _ in tokens:
            pass
        return Response(200, list(JSON), self.unsafe.after_whole(route, body, shape.whole(gen)))

    def _check_fits(self, prompt_len: int, max_tokens: int) -> None:
        try:
            self.engine.check_fits(prompt_len, max_tokens)
        except ContextTooLong as exc:
            raise SimError(400, str(exc)) from None

    async def _count_tokens(self, request: Request) -> Response:
        n = p.parse_count_tokens(self._body(request), self.limits)
        body = {"input_tokens": n, "context_management": {"original_input_tokens": n}}
        return Response(200, list(JSON), orjson.dumps(body))

    # -- pooling ---------------------------------------------------------------------------
    async def _prefill(self, prompts: list[list[int]], salt: str | None) -> int:
        """Run each prompt through the engine as vLLM runs a pooling request: a prefill
        through the prefix cache (salted like any other), no output. Returns the tokens."""
        for prompt in prompts:
            self._check_fits(len(prompt), 0)
        for prompt in prompts:
            async for _ in self.engine.generate(prompt, 0, salt, Generation(len(prompt))):
                pass
        return sum(len(prompt) for prompt in prompts)

    async def _embeddings(self, request: Request) -> Response:
        body = self._body(request)
        p.validate_cache_salt(body)
        req = p.parse_pooling(body, self.limits)
        await self._prefill(req.inputs, req.cache_salt)
        pooling = request.path == b"/pooling"
        out = shapes.embeddings_body(
            self.config.model, req.inputs, pooling=pooling, as_base64=req.base64
        )
        return Response(200, list(JSON), out)

    async def _classify(self, request: Request) -> Response:
        body = self._body(request)
        p.validate_cache_salt(body)
        req = p.parse_pooling(body, self.limits)
        await self._prefill(req.inputs, req.cache_salt)
        return Response(200, list(JSON), shapes.classify_body(self.config.model, req.inputs))

    async def _score(self, request: Request) -> Response:
        body = self._body(request)
        p.validate_cache_salt(body)
        rerank = request.path.endswith(b"/rerank")
        req = p.parse_score(body, self.limits, rerank=rerank)
        documents = [ids for _, ids in req.documents]
        used = await self._prefill(req.queries + documents, req.cache_salt)
        scores = shapes.cosine_scores(req.queries, documents)
        model = self.config.model
        if rerank:
            texts = [text for text, _ in req.documents]
            out = shapes.rerank_body(model, texts, scores, req.top_n, used)
        else:
            out = shapes.score_body(model, scores, used)
        return Response(200, list(JSON), out)

    # -- tokenizer, admin ------------------------------------------------------------------
    async def _tokenize(self, request: Request) -> Response:
        body = self._body(request)
        req = p.parse_tokenize(body, self.limits)
        strs = None
        if req.return_token_strs:
            prompt = body.get("prompt")
            strs = pieces(prompt) if isinstance(prompt, str) else [decode([t]) for t in req.tokens]
        out = {
            "count": len(req.tokens),
            "max_model_len": self.config.max_model_len,
            "tokens": req.tokens,
            "token_strs": strs,
        }
        return Response(200, list(JSON), orjson.dumps(out))

    async def _detokenize(self, request: Request) -> Response:
        tokens = p.parse_detokenize(self._body(request), self.limits)
        return Response(200, list(JSON), orjson.dumps({"prompt": decode(tokens)}))

    async def _reset_prefix_cache(self, request: Request) -> Response:
        return Response(200 if self.engine.reset_prefix_cache() else 409)

    async def _health(self, request: Request) -> Response:
        return Response(200)

    async def _models(self, request: Request) -> Response:
        return Response(200, list(JSON), self._models_body)

    async def _metrics(self, request: Request) -> Response:
        return Response(200, [(b"content-type", b"text/plain; version=0.0.4")], self.metrics())

    def metrics(self) -> bytes:
        cfg, engine, pool = self.config, self.engine, self.engine.pool
        info = {
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "kv_cache_size_tokens": str(cfg.num_blocks * cfg.block_size),
            "num_gpu_blocks": str(cfg.num_blocks),
            "prefix_caching_hash_algo": cfg.hash_algo,
            **self.unsafe.cache_info(),
        }
        text = render(
            engine.metrics,
            model=cfg.model,
            running=engine.num_running,
            waiting=engine.num_waiting,
            kv_usage=pool.usage,
            queries_tokens=pool.queries_tokens,
            hits_tokens=pool.hits_tokens,
            cache_info=info,
            mm_queries=self.media.queries,
            mm_hits=self.media.hits,
            connector_source=self.unsafe.connector_source(),
        )
        return text + self.unsafe.metrics_text().encode()
