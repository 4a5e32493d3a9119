"""vLLM 0.32's error answers, reproduced for the simulator (pure; docs/conformance.md).

vLLM answers errors in three ways, and clients (and saltgate's gateway) meet all three:

- its own checks raise a validation error whose text ends in " (parameter=P, value=V)" and
  whose body names `param`: `{"error": {"message", "type": "BadRequestError", "param",
  "code"}}`;
- pydantic's schema checks (and a body that is not JSON) answer `"type": "Bad Request"`
  with a message listing the errors as Python dict reprs and `param` the dotted location
  (`body.max_tokens`, or `body.24` for the character where the JSON broke);
- /v1/messages translates its own errors to Anthropic's shape
  `{"type": "error", "error": {"type", "message"}}`, but pydantic's errors still come in
  the OpenAI shape, because they are raised before the route runs.

Unknown routes answer FastAPI's `{"detail": "Not Found"}`.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "SimError",
    "anthropic_error_body",
    "invalid_json",
    "not_a_json_object",
    "openai_error_body",
    "route_not_found",
    "schema_error",
    "schema_errors",
    "unknown_model",
    "unsupported_media_type",
    "vllm_validation",
]


class SimError(Exception):
    """An error the simulator answers in vLLM's shape; `body` overrides the usual one."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "BadRequestError",
        param: str | None = None,
        body: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param
        self.body = body
        self.schema = err_type == "Bad Request"
        """A pydantic-style error: answered in the OpenAI shape on every route."""


def openai_error_body(error: SimError) -> bytes:
    if error.body is not None:
        return error.body
    return orjson.dumps(
        {
            "error": {
                "message": error.message,
                "type": error.err_type,
                "param": error.param,
                "code": error.status,
            }
        }
    )


def anthropic_error_body(error: SimError) -> bytes:
    """/v1/messages' own errors; schema errors and route misses keep their usual shape."""
    if error.body is not None or error.schema:
        return openai_error_body(error)
    return orjson.dumps(
        {"type": "error", "error": {"type": error.err_type, "message": error.message}}
    )


def vllm_validation(message: str, parameter: str, value: object = None) -> SimError:
    """vLLM's VLLMValidationError: the message gains " (parameter=..., value=...)"."""
    extras = f"parameter={parameter}" + ("" if value is None else f", value={value}")
    return SimError(400, f"{message} ({extras})", param=parameter)


def _summarize(value: object) -> object:
    """vLLM echoes a short stand-in for the offending input, never a whole container."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def schema_error(
    loc: tuple[str | int, ...], kind: str, msg: str, value: object, **ctx: object
) -> SimError:
    """One pydantic validation error, worded as vLLM's handler words it."""
    return schema_errors([(loc, kind, msg, value, ctx)])


SchemaIssue = tuple[tuple[str | int, ...], str, str, object, dict[str, object]]


def schema_errors(issues: list[SchemaIssue]) -> SimError:
    """Pydantic's errors (a union type fails once per branch); `param` is the first's."""
    lines = []
    for loc, kind, msg, value, ctx in issues:
        err: dict[str, Any] = {
            "type": kind,
            "loc": ".".join(str(p) for p in loc),
            "msg": msg,
            "input": _summarize(value),
        }
        if ctx:
            err["ctx"] = ctx
        lines.append(f"  {err}")
    label = "error" if len(issues) == 1 else "errors"
    message = f"{len(issues)} validation {label}:\n" + "\n".join(lines)
    param = ".".join(str(p) for p in issues[0][0])
    return SimError(400, message, "Bad Request", param)


def invalid_json(exc: ValueError) -> SimError:
    """A body the stdlib json module rejects: vLLM reports its message and offset."""
    pos = getattr(exc, "pos", 0)  # a JSONDecodeError has one; bad UTF-8 does not
    reason = getattr(exc, "msg", str(exc))
    return schema_error(("body", pos), "json_invalid", "JSON decode error", {}, error=reason)


def not_a_json_object(value: object) -> SimError:
    return schema_error(
        ("body",),
        "model_attributes_type",
        "Input should be a valid dictionary or object to extract fields from",
        value,
    )


def unsupported_media_type() -> SimError:
    message = "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
    return SimError(400, message, "Bad Request")


def unknown_model(model: object, served: str, *, pooling: bool = False) -> SimError:
    """Generation routes name the aliases and `param`; pooling routes say less."""
    if pooling:
        return SimError(404, f"The model `{model}` does not exist.", "NotFoundError")
    message = f"The model `{model}` does not exist. Valid aliases: {served}."
    return SimError(404, message, "NotFoundError", "model")


def route_not_found(status: int = 404) -> SimError:
    detail = "Not Found" if status == 404 else "Method Not Allowed"
    return SimError(status, detail, "NotFoundError", body=orjson.dumps({"detail": detail}))
