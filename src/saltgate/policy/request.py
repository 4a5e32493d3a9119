"""The request policy as pure functions: route allow-list, body parsing, inspection, rewrite.

Order on the request path: resolve_route -> parse_body -> inspect -> (derive the
salt) -> prepare. Nothing here performs I/O; every refusal is an ApiError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import orjson

from saltgate.derivations.derive import (
    ROUTE_CHAT,
    ROUTE_COMPLETIONS,
    ROUTE_MESSAGES,
    ROUTE_RESPONSES,
    SECRET_FIELD,
    InvalidSecretError,
    validate_user_cache_secret,
)
from saltgate.policy import content, fields, responses
from saltgate.policy.errors import (
    ApiError,
    body_too_large,
    invalid_request,
    invalid_type,
    invalid_user_cache_secret,
    method_not_allowed,
    missing_parameter,
    not_found,
    route_closed,
)

# -- routes ------------------------------------------------------------------------------

# What vLLM 0.32 answers on each route, probed on the real build: docs/conformance.md.
# Generation: the prefix cache serves them, so they are salted; usage metered.
GENERATION_ROUTES: Final[frozenset[str]] = frozenset(
    {ROUTE_CHAT, ROUTE_COMPLETIONS, ROUTE_RESPONSES, ROUTE_MESSAGES}
)
# Pooling models' routes: vLLM validates cache_salt on them and their prompts go through the
# prefix cache too, so unsalted they would leak across tenants like generation does.
POOLING_ROUTES: Final[frozenset[str]] = frozenset(
    {
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)
# Tokenizer routes: no prefill, no cache (vLLM ignores cache_salt there), so no salt is
# added; client salts are still stripped. Recorded in the ledger with no tokens.
TOKENIZER_ROUTES: Final[frozenset[str]] = frozenset(
    {"/tokenize", "/detokenize", "/v1/messages/count_tokens"}
)
SALTED_ROUTES: Final[frozenset[str]] = GENERATION_ROUTES | POOLING_ROUTES
ALLOWED_POST_ROUTES: Final[frozenset[str]] = SALTED_ROUTES | TOKENIZER_ROUTES
# Anthropic's API: its clients read errors in Anthropic's shape (errors.AnthropicApiError).
ANTHROPIC_ROUTES: Final[frozenset[str]] = frozenset({ROUTE_MESSAGES, "/v1/messages/count_tokens"})
# vLLM picks its default model on these when the body names none.
MODEL_OPTIONAL_ROUTES: Final[frozenset[str]] = frozenset({"/tokenize", "/detokenize"})
# Routes vLLM serves that stay closed here, and why (the client is told).
CLOSED_ROUTES: Final[dict[str, str]] = {
    path: (
        "it takes a multipart upload, which the request policy does not read (so it could "
        "neither strip nor check what reaches the replica)"
    )
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations")
}
ROUTE_MODELS: Final = "/v1/models"
ROUTE_HEALTH: Final = "/health"  # liveness: the process answers
ROUTE_READY: Final = "/ready"  # readiness: the store and a replica can serve (gateway/readiness.py)
ROUTE_USAGE: Final = "/v1/usage"  # the caller's tenant's own usage (admin/usage.py)
# Answered by the gateway itself, never forwarded.
LOCAL_GET_ROUTES: Final[frozenset[str]] = frozenset(
    {ROUTE_MODELS, ROUTE_HEALTH, ROUTE_READY, ROUTE_USAGE}
)
# Routes whose streams carry usage only when stream_options.include_usage is set; on
# /v1/responses and /v1/messages the final stream events always carry usage.
STREAM_OPTIONS_ROUTES: Final[frozenset[str]] = frozenset({ROUTE_CHAT, ROUTE_COMPLETIONS})

_MAX_PATH_ECHO = 120


def resolve_route(
    method: bytes | str,
    path: bytes | str,
    post_routes: frozenset[str] = ALLOWED_POST_ROUTES,
) -> str:
    """Map (method, path) to an allowed route, else 404 (unknown path) or 405 (wrong method).

    ``path`` is matched exactly (no normalisation, so nothing reaches a replica under
    another spelling); a query string is ignored. ``post_routes`` narrows the forwarded
    routes (e.g. without /v1/messages when the backend lacks it).
    """
    m = method.decode("ascii", "replace") if isinstance(method, bytes) else method
    p = path.decode("utf-8", "replace") if isinstance(path, bytes) else path
    p = p.partition("?")[0]
    if p in post_routes:
        if m == "POST":
            return p
        raise method_not_allowed(m, p, ["POST"])
    if p in LOCAL_GET_ROUTES:
        if m == "GET":
            return p
        raise method_not_allowed(m, p, ["GET"])
    if p in CLOSED_ROUTES:
        raise route_closed(p, CLOSED_ROUTES[p])
    if len(p) > _MAX_PATH_ECHO:
        p = p[:_MAX_PATH_ECHO] + "..."
    raise not_found(p)


# -- body parsing ------------------------------------------------------------------------
#
# Why this method: it is the fastest parse that refuses duplicate keys. Over the stdlib
# parser with a duplicate-key hook it costs ~0.6x at 4.4 KB and ~0.85x at 100 KB; over the
# unsafe orjson-only parse it adds ~8 us at 4.4 KB (measured with
# tests/policy/bench_parse.py; the table is in docs/dev/benchmarks-history.md, "Request
# body parsing").
#
# Chosen: orjson.loads does all validation it can (UTF-8, one value, no trailing bytes, no
# NaN/Infinity, no lone surrogates, no float overflow, depth <= 1024), then a C-speed
# duplicate-key proof: orjson keeps the last of duplicate keys, so a duplicate makes the
# re-serialised tree lose at least one key and its ':' separator. Every ':' outside strings
# is exactly one key, orjson never escapes ':' in strings, so
#     count(':', raw) == count(':', orjson.dumps(tree))   <=>   no key was dropped,
# provided the raw body spells no ':' as the escape \u003a (checked; else the slow path).
# Integers beyond 64 bits, which orjson silently turns into floats, can only appear in the
# re-serialised tree as an exponent "e+NN" (|x| >= 2**63 > 1e16); when that cannot be
# ruled out cheaply the exact path runs too: the stdlib C scanner with a duplicate hook
# and an integer range check. Correctness never depends on the fast path.

# The deepest nesting accepted, counting the outermost object: what orjson writes back (it
# reads up to 1,024 levels but serialises at most 254; the body is re-serialised to prove
# it has no duplicate keys and to forward it). Deeper bodies are refused at parse, before
# anything reads them. Real requests nest a few levels; JSON schemas in tools, a few dozen.
MAX_JSON_DEPTH: Final = 254

_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1  # orjson reads and writes u64 as well as i64
_MAX_PLUS_SCAN: Final = 32
_MAX_KEY_ECHO: Final = 64


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _IntegerRangeError(ValueError):
    pass


def _colons(data: bytes) -> int:
    # bytes.replace with a 1-byte pattern runs on memchr/memcpy: ~5x faster than count().
    return len(data) - len(data.replace(b":", b""))


def _may_hold_big_number(out: bytes) -> bool:
    """False only if orjson wrote no float with a positive exponent (|x| >= 1e16)."""
    pos = out.find(b"+")
    seen = 0
    while pos != -1:
        if pos > 0 and out[pos - 1] == 0x65:  # "e+": maybe an exponent (or text)
            return True
        seen += 1
        if seen >= _MAX_PLUS_SCAN:
            return True
        pos = out.find(b"+", pos + 1)
    return False


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return obj


def _checked_int(text: str) -> int:
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        raise _IntegerRangeError
    return value


def _exact_check(raw: bytes) -> None:
    """Slow, exact path: the stdlib scanner sees every key and every integer literal."""
    try:
        json.loads(
            raw.decode("utf-8"),
            object_pairs_hook=_pairs_no_duplicates,
            parse_int=_checked_int,
        )
    except _DuplicateKeyError as exc:
        key = exc.key if len(exc.key) <= _MAX_KEY_ECHO else exc.key[:_MAX_KEY_ECHO] + "..."
        raise invalid_request(
            f"Duplicate key {key!r} in the JSON body: keys must be unique in every object "
            "(after unescaping).",
            code="duplicate_key",
        ) from None
    except _IntegerRangeError:
        raise invalid_request(
            "The JSON body contains an integer outside the 64-bit range; send it as a "
            "string or a float.",
            code="integer_out_of_range",
        ) from None
    except RecursionError:  # not reached: parse_body refuses deeper bodies first
        raise _too_deep() from None
    except ValueError:  # orjson accepted it, so this is unexpected; refuse rather than guess
        raise invalid_request("The request body is not valid JSON.", code="invalid_json") from None


def _too_deep() -> ApiError:
    return invalid_request(
        f"The JSON body is nested too deeply: at most {MAX_JSON_DEPTH} levels of objects "
        "and arrays, counting the outermost object.",
        code="json_too_deep",
    )


class Body(NamedTuple):
    """A request body that passed `parse_body`: the object, and orjson's serialisation of
    it (which the duplicate-key proof needs anyway, and `prepare` reuses)."""

    obj: dict[str, Any]
    serialized: bytes


def parse_body(raw: bytes, max_bytes: int) -> Body:
    """Parse a request body into one JSON object, refusing anything two parsers could read
    differently: size over ``max_bytes`` (413), non-UTF-8, non-objects, trailing data,
    duplicate keys at any depth, NaN/Infinity, lone surrogates, integers beyond 64 bits, and
    nesting deeper than `MAX_JSON_DEPTH` (400).
    """
    if len(raw) > max_bytes:
        raise body_too_large(max_bytes)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg.startswith("depth limit"):
            raise _too_deep() from None
        raise invalid_request(
            f"The request body is not valid JSON ({exc.msg}; line {exc.lineno} column "
            f"{exc.colno}). Send one UTF-8 JSON object.",
            code="invalid_json",
        ) from None
    if type(obj) is not dict:
        raise invalid_request(
            "The request body must be a JSON object ({...}).", code="invalid_json"
        )
    try:
        out = orjson.dumps(obj)
    except TypeError:  # orjson writes at most MAX_JSON_DEPTH levels: the only TypeError here
        raise _too_deep() from None
    if (
        _colons(raw) != _colons(out)
        or (b"\\" in raw and b"\\u003" in raw)
        or _may_hold_big_number(out)
    ):
        _exact_check(raw)
    return Body(obj, out)


# -- inspection --------------------------------------------------------------------------

_TOKEN_LIMIT_PARAMS: Final = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class Inspected(NamedTuple):
    """What the gateway reads from a body, type-checked once (a tuple: cheap per request).

    ``client_wants_usage``: whether the client's own request makes the response carry
    usage. When False on a stream, the gateway (which forces usage on to meter) removes
    the usage chunk again before the client sees it.
    """

    route: str
    model: str
    stream: bool
    client_wants_usage: bool
    user_cache_secret: str | None
    max_tokens: int | None = None
    prompt_cache_key: str | None = None
    # content parts to rewrite (media uuids, client uuids, mm kwargs): policy/content.py
    content_rewrite: bool = False
    # With [responses] store: the client's `store` passes, and the response it continues
    # (policy/responses.py); without, the replica keeps nothing.
    keeps_responses: bool = False
    previous_response_id: str | None = None

    def __repr__(self) -> str:  # never the user's secret
        return (
            f"Inspected(route={self.route!r}, model={self.model!r}, stream={self.stream}, "
            f"secret={'<set>' if self.user_cache_secret else None})"
        )

    @property
    def forces_usage(self) -> bool:
        """True when prepare() turns stream_options.include_usage on for metering."""
        return self.stream and self.route in STREAM_OPTIONS_ROUTES


def _optional_bool(body: Mapping[str, Any], name: str, param: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if type(value) is not bool:
        raise invalid_type(param, "a boolean (true or false)")
    return value


def _optional_count(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise invalid_type(name, "a non-negative integer")
    if value < 0:
        raise invalid_request(
            f"Invalid '{name}': must be a non-negative integer.",
            param=name,
            code="invalid_value",
        )
    return value


def inspect(
    route: str,
    body: Mapping[str, Any],
    *,
    allow_remote: bool = False,
    keeps_responses: bool = False,
) -> Inspected:
    """Read and type-check the fields the gateway uses; 400 naming the parameter if wrong.
    ``allow_remote``: http(s) media passes, for the gateway to fetch ([media] remote).
    ``keeps_responses``: replicas keep responses for their owners ([responses] store)."""
    model = body.get("model")
    if model is None:
        if route in MODEL_OPTIONAL_ROUTES:
            model = ""
        else:
            raise missing_parameter("model", "the model name as a string")
    if not isinstance(model, str):
        raise invalid_type("model", "a string")
    if not model and route not in MODEL_OPTIONAL_ROUTES:
        raise invalid_request(
            "Invalid 'model': must be a non-empty string.", param="model", code="invalid_value"
        )

    stream = _optional_bool(body, "stream", "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid_type("stream_options", "an object or null")
        include_usage = _optional_bool(
            stream_options, "include_usage", "stream_options.include_usage"
        )

    try:
        secret = validate_user_cache_secret(body.get(SECRET_FIELD))
    except InvalidSecretError as exc:
        raise invalid_user_cache_secret(str(exc)) from None

    max_tokens: int | None = None
    for name in _TOKEN_LIMIT_PARAMS:
        if name in body:
            count = _optional_count(body, name)
            if max_tokens is None:
                max_tokens = count

    prompt_cache_key = body.get("prompt_cache_key")
    if prompt_cache_key is not None and not isinstance(prompt_cache_key, str):
        raise invalid_type("prompt_cache_key", "a string")

    fields.check(body)
    previous = responses.check(route, body, keeps=keeps_responses)
    parts = content.check(route, body, allow_remote=allow_remote)
    wants_usage = not stream or route not in STREAM_OPTIONS_ROUTES or include_usage
    return Inspected(
        route=route,
        model=model,
        stream=stream,
        client_wants_usage=wants_usage,
        user_cache_secret=secret,
        max_tokens=max_tokens,
        prompt_cache_key=prompt_cache_key or None,
        content_rewrite=parts.rewrite,
        keeps_responses=keeps_responses,
        previous_response_id=previous,
    )


# -- rewrite -----------------------------------------------------------------------------

# Fields never forwarded, whatever the client sends:
STRIPPED_FIELDS: Final[frozenset[str]] = frozenset(
    {
        # The namespace is the gateway's decision; a client salt could join another
        # tenant's namespace (the gateway sets its derived salt instead).
        "cache_salt",
        # The client's secret only feeds the derivation; a replica (and the operator's
        # logs there) must never see it.
        "user_cache_secret",
        # vLLM's free-form engine extension args (e.g. kv_cache_report_mode, which
        # re-publishes KV events) bypass this policy.
        "vllm_xargs",
        # Disaggregated-prefill transfer instructions: they let a request pull or push
        # KV blocks by id, i.e. reach cache contents outside its namespace.
        "kv_transfer_params",
        # The same for the encoder cache (multimodal inputs), on responses and messages.
        "ec_transfer_params",
        # vLLM takes a client-chosen request id from the body; ids are engine-wide, so
        # a chosen id could collide with (and abort or confuse) another tenant's request.
        "request_id",
        # Scheduling priority: a client's would jump every tenant's queue under vLLM's
        # priority scheduling (the gateway sets its own from the key's band: fields.py).
        "priority",
        # Copied into the replica's KV events: a client could label its blocks as another
        # tenant's session (no gateway consumer needs one, so none is set).
        "session_id",
    }
)


def prepare(
    body: Body, inspected: Inspected, salt: str | None, priority: int | None = None
) -> bytes:
    """The body to forward: stripped fields removed, ``cache_salt`` set on the routes that
    use the cache (SALTED_ROUTES), usage forced on streams that only carry it on request;
    serialised with orjson.

    ``salt`` None leaves the body unsalted (a test-only switch; client salts are still
    removed). ``body`` is not modified.

    Usually nothing is removed or changed but the salt: then the body is the parse's own
    serialisation with the salt spliced in as its last member, byte for byte what
    serialising the edited object would write, without a second serialisation (a few
    microseconds at 4 KB, ~170 us at 100 KB; tests/policy/bench_parse.py).

    Content parts with media (or client uuids) are rewritten on a copy first
    (`content.rewrite`: media uuids bound to ``salt``, client uuids dropped).

    ``priority``: the gateway's scheduling priority for the request (the key's band,
    `fields.BAND_PRIORITY`), set when the replicas run priority scheduling; None sets none.
    """
    obj = body.obj
    salted = salt is not None and inspected.route in SALTED_ROUTES
    # The replica keeps no response: `store` false on every Responses request (responses.py).
    stateless = inspected.route == ROUTE_RESPONSES and not inspected.keeps_responses
    if inspected.content_rewrite:
        obj = content.rewrite(inspected.route, orjson.loads(body.serialized), salt)
    elif (  # the usual case
        STRIPPED_FIELDS.isdisjoint(obj)
        and not inspected.forces_usage
        and not (stateless and responses.STORE in obj)
    ):
        if not salted and priority is None and not stateless:
            return body.serialized
        if obj:
            tail = b"" if not salted else b',"cache_salt":' + orjson.dumps(salt)
            tail += b"" if priority is None else b',"priority":%d' % priority
            tail += b',"store":false' if stateless else b""
            return body.serialized[:-1] + tail + b"}"
    if STRIPPED_FIELDS.isdisjoint(obj):
        out = dict(obj)
    else:
        out = {k: v for k, v in obj.items() if k not in STRIPPED_FIELDS}
    if salted:
        out["cache_salt"] = salt
    if priority is not None:
        out["priority"] = priority
    if stateless:
        out[responses.STORE] = False
    if inspected.forces_usage:
        options = obj.get("stream_options")
        forced = dict(options) if isinstance(options, dict) else {}
        if not inspected.client_wants_usage:
            # Usage on every chunk could not be removed again; the client did not ask.
            forced.pop("continuous_usage_stats", None)
        forced["include_usage"] = True
        out["stream_options"] = forced
    return orjson.dumps(out)
