"""The simulator's requests, read and checked as vLLM 0.32 reads and checks them (pure).

Every route's body goes through :func:`read_json` (vLLM's media-type and JSON checks), then,
on the routes that take a salt, :func:`validate_cache_salt`, then the route's parser, which
returns what the engine needs: token ids, the salt, the output budget. The order of the
checks is vLLM's (docs/conformance.md has what each answers): the salt before the schema,
the schema before the model name, the model name before the prompt's length.
/v1/messages checks its salt its own way (:func:`parse_messages`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from saltgate.sim.errors import (
    SchemaIssue,
    SimError,
    invalid_json,
    not_a_json_object,
    schema_error,
    schema_errors,
    unknown_model,
    unsupported_media_type,
    vllm_validation,
)
from saltgate.sim.tokenizer import VOCAB_SIZE, apply_chat_template, tokenize

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "GenerateRequest",
    "Limits",
    "PoolingRequest",
    "ScoreRequest",
    "TokenizeRequest",
    "lax_bool",
    "lax_int",
    "parse_chat",
    "parse_completion",
    "parse_count_tokens",
    "parse_detokenize",
    "parse_messages",
    "parse_pooling",
    "parse_responses",
    "parse_score",
    "parse_tokenize",
    "read_json",
    "validate_cache_salt",
]

DEFAULT_MAX_TOKENS = 16
"""The simulator's output length when a request names none (vLLM fills the context)."""

SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})

Body = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Limits:
    """What the replica serves: its model name and context length."""

    model: str
    max_model_len: int


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A generation request on any of the four generation routes."""

    prompt: list[int]
    max_tokens: int
    cache_salt: str | None
    stream: bool
    include_usage: bool = False
    requested_max_tokens: int | None = None
    instructions: str | None = None


@dataclass(frozen=True, slots=True)
class PoolingRequest:
    """/v1/embeddings, /pooling or /classify: one prompt per input, no output tokens."""

    inputs: list[list[int]]
    cache_salt: str | None
    base64: bool = False


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """/score and /rerank: queries scored against documents (bi-encoder: each embedded)."""

    queries: list[list[int]]
    documents: list[tuple[str, list[int]]]
    cache_salt: str | None
    top_n: int = 0


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    tokens: list[int]
    return_token_strs: bool


# ------------------------------------------------------------------------------ reading


def read_json(raw: bytes, content_type: bytes | None) -> Body:
    """vLLM's reading of a body: JSON media type, valid JSON, an object.

    FastAPI parses a body that names no media type before vLLM refuses it, so a broken
    body without a content-type answers the JSON error first.
    """
    if content_type is not None and content_type.split(b";", 1)[0].lower() != b"application/json":
        raise unsupported_media_type()
    if not raw:
        raise schema_error(("body",), "missing", "Field required", None)
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:  # the stdlib accepts what orjson does not (NaN, huge integers) and words errors
            value = json.loads(raw)
        except ValueError as exc:
            raise invalid_json(exc) from None
    if content_type is None:
        raise unsupported_media_type()
    if not isinstance(value, dict):
        raise not_a_json_object(value)
    return value


def validate_cache_salt(body: Body) -> str | None:
    """vLLM's checks, with vLLM's messages: non-empty string, <= 128 chars, no @ / \\ NUL."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise vllm_validation(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > 128 or any(c in salt for c in SALT_FORBIDDEN):
        raise vllm_validation(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return salt


def lax_int(body: Body, name: str) -> int | None:
    """An integer field as pydantic's lax mode reads it ("5" and 5.0 are 5)."""
    value = body.get(name)
    if value is None or type(value) is int:
        return value
    loc = ("body", name)
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        msg = "Input should be a valid integer, got a number with a fractional part"
        raise schema_error(loc, "int_from_float", msg, value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            raise schema_error(loc, "int_parsing", msg, value) from None
    raise schema_error(loc, "int_type", "Input should be a valid integer", value)


def lax_bool(body: Body, name: str) -> bool | None:
    """A boolean field as pydantic's lax mode reads it ("yes" and 1 are true)."""
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    kind, msg = (
        ("bool_parsing", "Input should be a valid boolean, unable to interpret input")
        if isinstance(value, str | int | float)
        else ("bool_type", "Input should be a valid boolean")
    )
    raise schema_error(("body", name), kind, msg, value)


def _str_field(body: Body, name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise schema_error(("body", name), "string_type", "Input should be a valid string", value)


def _required(body: Body, name: str) -> object:
    if name not in body:
        raise schema_error(("body", name), "missing", "Field required", body)
    return body[name]


def _str_or_list(value: object, loc: tuple[str | int, ...]) -> str | list[Any]:
    """A `str | list[...]` field given something else: pydantic fails both branches."""
    if isinstance(value, str | list):
        return value
    raise schema_errors(
        [
            (loc, "string_type", "Input should be a valid string", value, {}),
            (loc, "list_type", "Input should be a valid list", value, {}),
        ]
    )


def check_model(body: Body, limits: Limits, *, pooling: bool = False) -> None:
    """An absent or empty model means the served one; another name is a 404."""
    model = _str_field(body, "model")
    if model and model != limits.model:
        raise unknown_model(model, limits.model, pooling=pooling)


def check_prompt_len(prompt_len: int, limits: Limits) -> None:
    """vLLM refuses a prompt longer than the context before anything else about it."""
    if prompt_len > limits.max_model_len:
        qualifier = "at least " if prompt_len == limits.max_model_len + 1 else ""
        raise vllm_validation(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your prompt contains {qualifier}{prompt_len} input tokens, which exceeds this "
            "limit even without any output tokens. Please reduce the length of the input "
            "prompt.",
            "input_tokens",
            prompt_len,
        )


def _at_least_one(max_tokens: int) -> None:
    if max_tokens < 1:
        raise vllm_validation(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )


def _max_tokens(requested: int | None, name: str, prompt_len: int, limits: Limits) -> int:
    """vLLM's output-budget rules, then the simulator's default when none is named."""
    if requested is not None:
        _at_least_one(requested)
        if requested > limits.max_model_len:
            raise vllm_validation(
                f"{name}={requested} cannot be greater than "
                f"max_model_len={limits.max_model_len}. Please request fewer output tokens.",
                name,
                requested,
            )
    check_prompt_len(prompt_len, limits)
    budget = DEFAULT_MAX_TOKENS if requested is None else requested
    max_tokens = min(budget, limits.max_model_len - prompt_len)  # vLLM clamps to what fits
    _at_least_one(max_tokens)
    return max_tokens


def _stream_options(body: Body, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise schema_error(
            ("body", "stream_options"),
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            options,
        )
    if options and not stream:  # vLLM lets an empty object pass
        raise vllm_validation(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return bool(options.get("include_usage"))


def _chat_tokens(
    messages: list[Any], limits: Limits, add_generation_prompt: bool = True
) -> list[int]:
    if not messages:
        raise SimError(
            400,
            "Cannot apply chat template to an empty conversation. Provide at least one message.",
        )
    try:
        return apply_chat_template(messages, add_generation_prompt)
    except ValueError as exc:
        if "accepts only text parts" in str(exc):
            raise SimError(400, f"{limits.model} is not a multimodal model") from None
        raise SimError(400, str(exc)) from None


def _token_ids(value: list[Any]) -> list[int] | None:
    """A list of token ids, checked against the vocabulary; None if it is not one."""
    if not all(type(t) is int for t in value):
        return None
    bad = next((t for t in value if not 0 <= t < VOCAB_SIZE), None)
    if bad is not None:
        raise SimError(400, f"Token id {bad} is out of vocabulary")
    return list(value)


# ------------------------------------------------------------------------------ generation


def _generate(
    body: Body,
    limits: Limits,
    prompt: Callable[[], list[int]],
    max_field: str,
    requested: int | None,
    **extra: Any,
) -> GenerateRequest:
    stream = bool(lax_bool(body, "stream"))
    include_usage = _stream_options(body, stream)
    check_model(body, limits)
    tokens = prompt()
    max_tokens = _max_tokens(requested, max_field, len(tokens), limits)
    return GenerateRequest(
        tokens,
        max_tokens,
        body.get("cache_salt"),
        stream,
        include_usage,
        requested,
        **extra,
    )


def parse_completion(body: Body, limits: Limits) -> GenerateRequest:
    requested = lax_int(body, "max_tokens")

    def prompt() -> list[int]:
        value = body.get("prompt")
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str) and value:
            return tokenize(value)
        if isinstance(value, list) and value:
            ids = _token_ids(value)
            if ids is not None:
                return ids
        if value == []:
            raise SimError(400, "You must pass at least one prompt")
        if value is None or value == "":
            raise vllm_validation(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        if not isinstance(value, list):  # each branch of vLLM's prompt union fails
            loc = ("body", "prompt")
            list_type: SchemaIssue = (loc, "list_type", "Input should be a valid list", value, {})
            string_type: SchemaIssue = (
                loc,
                "string_type",
                "Input should be a valid string",
                value,
                {},
            )
            raise schema_errors([list_type, list_type, string_type, list_type])
        raise SimError(400, "The simulator takes one prompt: a string or a list of token ids.")

    return _generate(body, limits, prompt, "max_tokens", requested)


def parse_chat(body: Body, limits: Limits) -> GenerateRequest:
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise schema_error(
            ("body", "messages"), "list_type", "Input should be a valid list", messages
        )
    requested = lax_int(body, "max_completion_tokens")
    name = "max_completion_tokens"
    if requested is None:
        requested, name = lax_int(body, "max_tokens"), "max_tokens"
    return _generate(body, limits, lambda: _chat_tokens(messages, limits), name, requested)


_RESPONSES_ROLES = ("user", "system", "developer", "assistant")


def _responses_messages(value: str | list[Any], instructions: str | None) -> list[dict[str, Any]]:
    """The Responses API's input as chat messages (instructions first, as a system turn)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
        return messages
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise SimError(400, f"input[{i}]: the simulator accepts only message items")
        role = item.get("role")
        if role not in _RESPONSES_ROLES:
            raise SimError(400, f"input[{i}].role must be one of {', '.join(_RESPONSES_ROLES)}")
        content = item.get("content")
        if isinstance(content, list):
            content = [
                {"type": "text", "text": part.get("text")}
                if isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                else part
                for part in content
            ]
        messages.append({"role": role, "content": content})
    return messages


def parse_responses(body: Body, limits: Limits) -> GenerateRequest:
    if not body.get("tools") and body.get("tool_choice", "auto") in ("auto", "none"):
        body["tool_choice"] = "none"  # vLLM's before-validator sets it (errors count it)
    value = _str_or_list(_required(body, "input"), ("body", "input"))
    instructions = _str_field(body, "instructions")
    requested = lax_int(body, "max_output_tokens")
    messages = _responses_messages(value, instructions)
    return _generate(
        body,
        limits,
        lambda: _chat_tokens(messages, limits),
        "max_output_tokens",
        requested,
        instructions=instructions,
    )


def _anthropic_messages(body: Body) -> list[dict[str, Any]]:
    messages = _required(body, "messages")
    if not isinstance(messages, list):
        raise schema_error(
            ("body", "messages"), "list_type", "Input should be a valid list", messages
        )
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        _str_or_list(system, ("body", "system"))
        out.append({"role": "system", "content": system})
    for i, msg in enumerate(messages):
        loc: tuple[str | int, ...] = ("body", "messages", i)
        if not isinstance(msg, dict):
            raise not_a_json_object(msg)
        role = msg.get("role")
        if role not in ("user", "assistant", "system"):
            raise schema_error(
                (*loc, "role"),
                "literal_error",
                "Input should be 'user', 'assistant' or 'system'",
                role,
                expected="'user', 'assistant' or 'system'",
            )
        content = msg.get("content")
        _str_or_list(content, (*loc, "content"))
        out.append({"role": role, "content": content})
    return out


def _anthropic_model(body: Body, limits: Limits) -> None:
    model = _required(body, "model")
    if model == "":
        raise schema_error(
            ("body", "model"),
            "value_error",
            "Value error, Model is required",
            model,
            error=ValueError("Model is required"),
        )
    check_model(body, limits)


def parse_messages(body: Body, limits: Limits) -> GenerateRequest:
    """Anthropic's Messages API: model and max_tokens are required, the salt is pydantic's."""
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise schema_error(
            ("body", "cache_salt"), "string_type", "Input should be a valid string", salt
        )
    if salt == "":
        raise schema_error(
            ("body", "cache_salt"),
            "string_too_short",
            "String should have at least 1 character",
            salt,
            min_length=1,
        )
    messages = _anthropic_messages(body)
    _required(body, "max_tokens")
    requested = lax_int(body, "max_tokens")
    if requested is not None and requested <= 0:
        raise schema_error(
            ("body", "max_tokens"),
            "value_error",
            "Value error, max_tokens must be positive",
            requested,
            error=ValueError("max_tokens must be positive"),
        )
    _anthropic_model(body, limits)
    validate_cache_salt(body)  # the route's own check, answered in Anthropic's shape
    return _generate(body, limits, lambda: _chat_tokens(messages, limits), "max_tokens", requested)


def parse_count_tokens(body: Body, limits: Limits) -> int:
    """/v1/messages/count_tokens: the prompt's length; it ignores cache_salt."""
    messages = _anthropic_messages(body)
    _anthropic_model(body, limits)
    return len(_chat_tokens(messages, limits))


# ------------------------------------------------------------------------------ pooling


def _pooling_inputs(body: Body, limits: Limits) -> list[list[int]]:
    if "messages" in body and "input" not in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise schema_error(
                ("body", "messages"), "list_type", "Input should be a valid list", messages
            )
        return [_chat_tokens(messages, limits, add_generation_prompt=False)]
    value = _str_or_list(_required(body, "input"), ("body", "input"))
    if isinstance(value, str) or (value and all(type(t) is int for t in value)):
        value = [value]  # one input, not a batch
    if not value:
        raise SimError(400, "You must pass at least one prompt")
    inputs: list[list[int]] = []
    for item in value:
        ids = _token_ids(item) if isinstance(item, list) else None
        if isinstance(item, str):
            ids = tokenize(item)
        if ids is None:
            raise SimError(400, "Each input must be a string or a list of token ids.")
        if not ids:
            raise SimError(400, "The decoder prompt cannot be empty")
        check_prompt_len(len(ids), limits)
        inputs.append(ids)
    return inputs


def parse_pooling(body: Body, limits: Limits) -> PoolingRequest:
    check_model(body, limits, pooling=True)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise schema_error(
            ("body", "encoding_format"),
            "literal_error",
            "Input should be 'float', 'base64' or 'bytes'",
            fmt,
        )
    if body.get("dimensions") is not None:
        raise SimError(
            400,
            f"Model '{limits.model}' does not support Matryoshka embeddings; dimensions must "
            f"be unset (received dimensions={body['dimensions']}).",
        )
    return PoolingRequest(_pooling_inputs(body, limits), body.get("cache_salt"), fmt == "base64")


def _score_texts(body: Body, names: tuple[str, ...]) -> tuple[str, list[str]]:
    for name in names:
        if name in body:
            value = body[name]
            _str_or_list(value, ("body", name))
            texts = [value] if isinstance(value, str) else value
            if not all(isinstance(t, str) for t in texts):
                raise SimError(400, f"'{name}': the simulator scores text only")
            return name, texts
    raise schema_error(("body", names[0]), "missing", "Field required", body)


def parse_score(body: Body, limits: Limits, *, rerank: bool) -> ScoreRequest:
    """/score pairs `queries` (or text_1, data_1) with `documents` (text_2, items, data_2);
    /rerank takes one `query` and ranks `documents`, keeping `top_n`."""
    if rerank:
        _, queries = _score_texts(body, ("query",))
        _, documents = _score_texts(body, ("documents",))
        top_n = lax_int(body, "top_n") or 0
    else:
        _, queries = _score_texts(body, ("queries", "text_1", "data_1"))
        _, documents = _score_texts(body, ("documents", "items", "text_2", "data_2"))
        top_n = 0
    check_model(body, limits, pooling=True)
    if len(queries) != 1 and len(queries) != len(documents):
        raise SimError(400, "The number of queries must be 1 or equal to the number of documents.")
    if not documents:
        raise SimError(400, "You must pass at least one document")
    return ScoreRequest(
        [tokenize(q) for q in queries],
        [(d, tokenize(d)) for d in documents],
        body.get("cache_salt"),
        top_n,
    )


# ------------------------------------------------------------------------------ tokenizer


def parse_tokenize(body: Body, limits: Limits) -> TokenizeRequest:
    """/tokenize: a prompt, or chat messages through the template; cache_salt is ignored."""
    check_model(body, limits)
    strs = bool(lax_bool(body, "return_token_strs"))
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list):
            raise schema_error(
                ("body", "messages"), "list_type", "Input should be a valid list", messages
            )
        add = lax_bool(body, "add_generation_prompt")
        return TokenizeRequest(_chat_tokens(messages, limits, add is not False), strs)
    prompt = _str_field(body, "prompt")
    if prompt is None:
        raise schema_error(("body", "prompt"), "missing", "Field required", body)
    return TokenizeRequest(tokenize(prompt), strs)


def parse_detokenize(body: Body, limits: Limits) -> list[int]:
    check_model(body, limits)
    tokens = _required(body, "tokens")
    if not isinstance(tokens, list):
        raise schema_error(("body", "tokens"), "list_type", "Input should be a valid list", tokens)
    for i, t in enumerate(tokens):
        if type(t) is not int:
            raise schema_error(
                ("body", "tokens", i), "int_type", "Input should be a valid integer", t
            )
    return tokens
