"""One call through an official client package, whole or streamed, read the way an
application would: the text, and the usage the SDK reports, in one shape for all APIs."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import anthropic
import openai
from tests.support.http import TLS

# What a client might pass in extra_body that must never reach a replica as such.
SMUGGLED: dict[str, Any] = {
    "cache_salt": "sg1_client-chosen-salt-victim",
    "vllm_xargs": {"kv_cache_report_mode": "all"},
}
MAX_TOKENS = 4


ANTHROPIC_AUTHS = ("x-api-key", "auth_token")


class AnthropicClient(NamedTuple):
    """A client that sends the key in the header its case names, and what it sent."""

    client: anthropic.AsyncAnthropic
    sent: list[Any]  # the requests as the SDK sent them (its own HTTP package's)

    def credentials(self) -> list[tuple[str | None, str | None]]:
        """Each request's (x-api-key, authorization) headers."""
        return [(r.headers.get("x-api-key"), r.headers.get("authorization")) for r in self.sent]

    @staticmethod
    def expected(auth: str, key: str) -> tuple[str | None, str | None]:
        return (key, None) if auth == "x-api-key" else (None, f"Bearer {key}")


def anthropic_client(base_url: str, key: str, auth: str) -> AnthropicClient:
    """The official client with the tenant's key as Anthropic's `x-api-key` header, or as
    a Bearer `auth_token`. This SDK sends an `api_key` as a Bearer token too, so the
    x-api-key case sets the header Anthropic's API names itself and leaves the Bearer one
    out: else both cases would send the same request."""
    sent: list[Any] = []

    async def heard(request: Any) -> None:
        sent.append(request)

    http = anthropic.DefaultAsyncHttpxClient(verify=TLS, event_hooks={"request": [heard]})
    if auth == "x-api-key":
        client = anthropic.AsyncAnthropic(
            base_url=base_url,
            api_key=key,
            max_retries=0,
            http_client=http,
            # Typed str only; the SDK drops an omitted one (its _merge_mappings).
            default_headers=cast(
                "dict[str, str]", {"X-Api-Key": key, "Authorization": anthropic.omit}
            ),
        )
    else:
        client = anthropic.AsyncAnthropic(
            base_url=base_url, auth_token=key, max_retries=0, http_client=http
        )
    return AnthropicClient(client, sent)


class OpenAICall(NamedTuple):
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int

    @property
    def usage(self) -> tuple[int, int, int]:
        return self.prompt_tokens, self.cached_tokens, self.completion_tokens


class AnthropicCall(NamedTuple):
    text: str
    input_tokens: int  # Anthropic's: neither read from nor written to the cache
    cache_read: int
    cache_creation: int
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.input_tokens + self.cache_read + self.cache_creation

    @property
    def usage(self) -> tuple[int, int, int]:
        """As the gateway meters it: (prompt, cached, completion)."""
        return self.prompt_tokens, self.cache_read, self.output_tokens


async def openai_call(
    client: openai.AsyncOpenAI,
    api: str,
    model: str,
    prompt: str,
    *,
    stream: bool,
    extra_body: dict[str, Any] | None = None,
) -> OpenAICall:
    """One request on ``api``: "chat", "completions" or "responses"."""
    if api == "responses":
        return await _responses(client, model, prompt, stream=stream, extra_body=extra_body)
    text, usage = "", None
    if api == "chat":
        messages: Any = [{"role": "user", "content": prompt}]
        if not stream:
            r = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, extra_body=extra_body
            )
            return _openai(r.choices[0].message.content or "", r.usage)
        chunks = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=MAX_TOKENS,
            extra_body=extra_body,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in chunks:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            usage = chunk.usage or usage
        return _openai(text, usage)
    if not stream:
        c = await client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=extra_body
        )
        return _openai(c.choices[0].text, c.usage)
    pieces = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        extra_body=extra_body,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for piece in pieces:
        text += "".join(c.text for c in piece.choices)
        usage = piece.usage or usage
    return _openai(text, usage)


def _openai(text: str, usage: Any) -> OpenAICall:
    assert usage is not None, "the SDK reported no usage"
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    return OpenAICall(text, usage.prompt_tokens, cached, usage.completion_tokens)


async def _responses(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    *,
    stream: bool,
    extra_body: dict[str, Any] | None,
) -> OpenAICall:
    kw: dict[str, Any] = {
        "model": model,
        "input": prompt,
        "max_output_tokens": MAX_TOKENS,
        "extra_body": extra_body,
    }
    if not stream:
        r = await client.responses.create(**kw)
        return _responses_usage(r.output_text, r.usage)
    text, usage = "", None
    async for event in await client.responses.create(stream=True, **kw):
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            usage = event.response.usage
    return _responses_usage(text, usage)


def _responses_usage(text: str, usage: Any) -> OpenAICall:
    assert usage is not None, "the SDK reported no usage"
    cached = usage.input_tokens_details.cached_tokens or 0
    return OpenAICall(text, usage.input_tokens, cached, usage.output_tokens)


async def anthropic_call(
    client: anthropic.AsyncAnthropic,
    model: str,
    prompt: str,
    *,
    stream: bool,
    extra_body: dict[str, Any] | None = None,
) -> AnthropicCall:
    kw: dict[str, Any] = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": prompt}],
        "extra_body": extra_body,
    }
    if stream:
        async with client.messages.stream(**kw) as events:
            text = "".join([piece async for piece in events.text_stream])
            message = await events.get_final_message()
    else:
        message = await client.messages.create(**kw)
        text = "".join(block.text for block in message.content if block.type == "text")
    u = message.usage
    return AnthropicCall(
        text,
        u.input_tokens,
        u.cache_read_input_tokens or 0,
        u.cache_creation_input_tokens or 0,
        u.output_tokens,
    )
