"""Content parts: the multimodal half of the request policy (pure; docs/security.md).

vLLM keeps two caches of processed media, its multimodal processor cache and its encoder
cache, keyed by a part's client ``uuid`` verbatim, else by a hash of the media bytes;
neither key carries ``cache_salt`` (vLLM 0.32 ``multimodal/processing/inputs.py:91-105``,
``v1/core/encoder_cache_manager.py:111-138``; docs/multimodal.md). It fetches
``http(s)`` media URLs itself, from any host (``multimodal/media/connector.py``), and loads
``*_embeds`` / ``prompt_embeds`` with ``torch.load`` when enabled. So, on every route that
carries content parts, this module:

- drops every client ``uuid`` on a part (one tenant could name another's cached image);
- refuses a media part whose media is null or empty (a uuid-only part is a cache lookup:
  a membership oracle, and with a uuid another tenant's image);
- sets on each media part a ``uuid`` bound to the tenant's namespace and the media
  (`saltgate.derivations.derive.media_uuid`): within a namespace the same media hits both
  caches, across namespaces never; with salting off (no salt) no uuid is set;
- refuses ``*_embeds`` parts and the ``prompt_embeds`` field;
- refuses media that is not inline (``data:``): vLLM would fetch an ``http(s)`` URL from the
  replica's network (SSRF); `remote_media` / `inline_media` let a fetcher inline it first;
- caps the media items of a request (`MAX_MEDIA_ITEMS`);
- refuses part types it does not know: a part type vLLM learns later (a new media kind)
  must not pass unexamined; vLLM refuses unknown types itself, so nothing valid is lost.

The walk is route-aware (`_part_lists`): chat-shaped ``messages`` (chat, /tokenize, the
pooling routes), the Responses ``input`` items, Anthropic content blocks (/v1/messages,
count_tokens, including ``tool_result`` content), and the score/rerank inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, NamedTuple

from saltgate.derivations.derive import (
    ROUTE_CHAT,
    ROUTE_MESSAGES,
    ROUTE_RESPONSES,
    media_uuid,
)
from saltgate.policy.errors import AnthropicApiError, ApiError

ROUTE_COUNT_TOKENS: Final = "/v1/messages/count_tokens"
ANTHROPIC_CONTENT_ROUTES: Final = frozenset({ROUTE_MESSAGES, ROUTE_COUNT_TOKENS})
# Routes whose `messages` are chat messages (vLLM renders them with the chat parser).
CHAT_MESSAGE_ROUTES: Final = frozenset(
    {ROUTE_CHAT, "/tokenize", "/v1/embeddings", "/pooling", "/classify"}
)
# Score and rerank: each of these fields is a text, a {"content": [parts]} or a list of them.
SCORE_ROUTES: Final = frozenset({"/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})
SCORE_FIELDS: Final = (
    "query",
    "queries",
    "documents",
    "items",
    "data_1",
    "data_2",
    "text_1",
    "text_2",
)

# A request carries at most this many media items (all modalities, all messages). vLLM's
# own default is 999 per modality (config/multimodal.py:312); each item is decoded and
# processed in the API server every tenant shares.
MAX_MEDIA_ITEMS: Final = 32

# Stripped from every body. Both are per-request overrides of the model's media
# processing: mm_processor_kwargs (e.g. max_pixels, fps) and media_io_kwargs (e.g. a
# video's num_frames) set how much work one item costs, without a bound the gateway could
# check across models (a DoS lever on the shared server; CVE-2026-5497), and both enter
# vLLM's multimodal cache key (inputs.py:70-101). The operator sets them for the model
# (vLLM's --mm-processor-kwargs, --media-io-kwargs); a tenant does not.
MM_STRIPPED_FIELDS: Final = frozenset({"mm_processor_kwargs", "media_io_kwargs"})
# Refused: vLLM torch.loads it in the shared API server when enabled (CVE-2025-62164).
EMBEDS_FIELD: Final = "prompt_embeds"

# OpenAI-shaped parts (chat, responses, tokenize, pooling, score).
TEXT_PART_TYPES: Final = frozenset(
    {
        "text",
        "input_text",
        "output_text",
        "refusal",
        "thinking",
        "reasoning_text",
        "tool_reference",
    }
)
EMBEDS_PART_TYPES: Final = frozenset(
    {"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"}
)


class _MediaKind(NamedTuple):
    key: str  # the part's member holding the media
    modality: str
    nested_url: bool  # the member is {"url": ...} (chat) rather than the URL itself


MEDIA_PART_TYPES: Final[Mapping[str, _MediaKind]] = {
    "image_url": _MediaKind("image_url", "image", True),
    "audio_url": _MediaKind("audio_url", "audio", True),
    "video_url": _MediaKind("video_url", "video", True),
    "input_image": _MediaKind("image_url", "image", False),  # Responses: a URL string
    "input_audio": _MediaKind("input_audio", "audio", False),  # {"data", "format"}
}
# A part without "type": vLLM takes the first of these members it finds as the part's
# kind (renderers/chat_utils.py:1720-1803), in this order.
_SNIFFED_KEYS: Final = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "tool_reference",
)
# vLLM's Anthropic block types (entrypoints/anthropic/protocol.py:40-53), but images.
ANTHROPIC_TEXT_BLOCKS: Final = frozenset(
    {
        "text",
        "tool_use",
        "tool_reference",
        "thinking",
        "redacted_thinking",
        "tool_addition",
        "tool_removal",
    }
)
_REMOTE_SCHEMES: Final = ("http://", "https://")
_DATA_SCHEME: Final = "data:"


class RemoteMedia(NamedTuple):
    """A media reference a replica would fetch: where it is, its URL and modality."""

    param: str
    url: str
    modality: str


class ContentCheck(NamedTuple):
    """What `check` found: the media items, and whether `rewrite` has anything to do."""

    media: int
    rewrite: bool


NO_CONTENT: Final = ContentCheck(0, False)


# -- errors -----------------------------------------------------------------------------


def _error(route: str, message: str, param: str, code: str) -> ApiError:
    if route in ANTHROPIC_CONTENT_ROUTES:
        return AnthropicApiError(400, message, param=param, code=code)
    return ApiError(400, message, param=param, code=code)


def _missing_media(route: str, param: str) -> ApiError:
    return _error(
        route,
        f"Invalid '{param}': a media part must carry its media (a data: URL); a part "
        "without it, or with only a uuid, is not accepted.",
        param,
        "missing_media",
    )


def _remote(route: str, param: str) -> ApiError:
    return _error(
        route,
        f"Invalid '{param}': remote media URLs are not accepted. This gateway does not let "
        "model servers fetch URLs (they would reach any host from inside the serving "
        "network); send the media inline as a data: URL (base64).",
        param,
        "remote_media_refused",
    )


def _not_inline(route: str, param: str) -> ApiError:
    return _error(
        route,
        f"Invalid '{param}': media must be a data: URL (base64).",
        param,
        "invalid_media_url",
    )


def _embeds(route: str, param: str) -> ApiError:
    return _error(
        route,
        f"Invalid '{param}': embedding inputs (prompt_embeds, image_embeds, audio_embeds, "
        "video_embeds) are not accepted: the model server would deserialise tensors from "
        "the request.",
        param,
        "embeds_refused",
    )


def _unknown(route: str, param: str, kind: object) -> ApiError:
    shown = kind if isinstance(kind, str) and len(kind) <= 40 else "?"
    return _error(
        route,
        f"Invalid '{param}': unsupported content part type {shown!r}.",
        param,
        "unsupported_content_part",
    )


def _too_many(route: str) -> ApiError:
    return _error(
        route,
        f"Too many media items: a request may carry at most {MAX_MEDIA_ITEMS}.",
        "input" if route == ROUTE_RESPONSES else "messages",
        "too_many_media_items",
    )


# -- where the parts are ----------------------------------------------------------------

# (the list of parts, its parameter path, whether its parts are Anthropic blocks)
PartList = tuple[list[Any], str, bool]


def _messages(messages: object, name: str, anthropic: bool) -> Iterator[PartList]:
    if not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        if isinstance(msg, dict):
            content = msg.get("content")
            if isinstance(content, list):
                yield content, f"{name}[{i}].content", anthropic
                if anthropic:
                    yield from _tool_results(content, f"{name}[{i}].content")


def _tool_results(blocks: list[Any], where: str) -> Iterator[PartList]:
    """Anthropic tool_result blocks carry blocks of their own (vLLM converts their images)."""
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            inner = block.get("content")
            if isinstance(inner, list):
                yield inner, f"{where}[{j}].content", True


def _responses_input(items: object) -> Iterator[PartList]:
    if not isinstance(items, list):
        return
    yield items, "input", False  # bare parts among the items (the walk skips the rest)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        for member in ("content", "output"):  # message items; function_call_output items
            value = item.get(member)
            if isinstance(value, list):
                yield value, f"input[{i}].{member}", False


def _score_inputs(body: Mapping[str, Any]) -> Iterator[PartList]:
    for name in SCORE_FIELDS:
        value = body.get(name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, dict) and isinstance(content := item.get("content"), list):
                where = f"{name}[{i}]" if isinstance(value, list) else name
                yield content, f"{where}.content", False


def _part_lists(route: str, body: Mapping[str, Any]) -> Iterator[PartList]:
    """Every list of content parts the route's vLLM parser reads, outermost first."""
    if route in CHAT_MESSAGE_ROUTES:
        yield from _messages(body.get("messages"), "messages", False)
    elif route == ROUTE_RESPONSES:
        yield from _responses_input(body.get("input"))
    elif route in ANTHROPIC_CONTENT_ROUTES:
        system = body.get("system")
        if isinstance(system, list):
            yield system, "system", True
        yield from _messages(body.get("messages"), "messages", True)
    elif route in SCORE_ROUTES:
        yield from _score_inputs(body)


def _has_parts(route: str, body: Mapping[str, Any]) -> bool:
    """Whether the body has a list of parts at all: the usual text request has none."""
    if route in CHAT_MESSAGE_ROUTES or route in ANTHROPIC_CONTENT_ROUTES:
        messages = body.get("messages")
        if isinstance(messages, list):
            for msg in messages:
                if type(msg) is dict and type(msg.get("content")) is list:
                    return True
        return route in ANTHROPIC_CONTENT_ROUTES and isinstance(body.get("system"), list)
    if route == ROUTE_RESPONSES:
        return isinstance(body.get("input"), list)
    return route in SCORE_ROUTES


# -- one part ---------------------------------------------------------------------------


def _part_type(part: dict[str, Any]) -> str | None:
    kind = part.get("type")
    if isinstance(kind, str):
        return kind
    if kind is None:  # vLLM reads the kind from the members
        return next((key for key in _SNIFFED_KEYS if key in part), None)
    return None


def _openai_media(part: dict[str, Any], kind: _MediaKind) -> str | None:
    """The media reference vLLM reads from the part (a URL string), or None if absent."""
    value = part.get(kind.key)
    if kind.key == "input_audio":
        if not isinstance(value, dict):
            return None
        data, fmt = value.get("data"), value.get("format")
        if not isinstance(data, str) or not data or not isinstance(fmt, str):
            return None
        return f"data:audio/{fmt};base64,{data}"  # as vLLM builds it (parse_input_audio)
    if isinstance(value, dict):
        value = value.get("url")
    return value if isinstance(value, str) and value else None


def _anthropic_media(block: dict[str, Any]) -> str | None:
    """The URL vLLM builds from an image block's source (anthropic/serving.py:302-319)."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "url":
        url = source.get("url")
        return url if isinstance(url, str) and url else None
    if source.get("type", "base64") != "base64":
        return None
    data, media_type = source.get("data"), source.get("media_type", "image/jpeg")
    if not isinstance(data, str) or not data or not isinstance(media_type, str):
        return None
    return f"data:{media_type};base64,{data}"


def _check_url(route: str, url: str, param: str, allow_remote: bool) -> None:
    lower = url[:8].lower()
    if lower.startswith(_DATA_SCHEME):
        return
    if lower.startswith(_REMOTE_SCHEMES):
        if allow_remote:
            return
        raise _remote(route, param)
    raise _not_inline(route, param)


class Media(NamedTuple):
    """A media part as the walk finds it: its list and index (to replace it), where it
    is, the URL vLLM would read, its modality, and its kind (None: an Anthropic image)."""

    parts: list[Any]
    position: int
    param: str
    url: str
    modality: str
    kind: _MediaKind | None

    @property
    def media_param(self) -> str:
        return f"{self.param}.{'source' if self.kind is None else self.kind.key}"


Visit = Callable[[Media], None]
_SKIP: Final = "skip"


def _classify(
    route: str, part: dict[str, Any], param: str, anthropic: bool, bare: bool
) -> tuple[str, _MediaKind | None] | str | None:
    """A part's media as (URL, kind), or None for a text part, or _SKIP for a Responses
    item that is not a part. Raises for embeds, unknown types and missing media."""
    kind_name = part.get("type") if anthropic else _part_type(part)
    if anthropic:
        if kind_name == "image":
            url = _anthropic_media(part)
            if url is None:
                raise _missing_media(route, f"{param}.source")
            return url, None
        if kind_name not in ANTHROPIC_TEXT_BLOCKS and kind_name != "tool_result":
            raise _unknown(route, f"{param}.type", kind_name)
        return None
    if kind_name in EMBEDS_PART_TYPES:
        raise _embeds(route, param)
    kind = MEDIA_PART_TYPES.get(kind_name) if kind_name is not None else None
    if kind is not None:
        url = _openai_media(part, kind)
        if url is None:
            raise _missing_media(route, f"{param}.{kind.key}")
        return url, kind
    if kind_name in TEXT_PART_TYPES:
        return None
    if bare:
        return _SKIP  # a message or function_call item: its own lists are walked apart
    raise _unknown(route, f"{param}.type", kind_name)


def _walk(
    route: str,
    body: Mapping[str, Any],
    *,
    allow_remote: bool = False,
    visit: Visit | None = None,
    drop_uuids: bool = False,
) -> ContentCheck:
    """Check every part of the body, calling ``visit`` on each media part and, with
    ``drop_uuids``, removing the other parts' uuids in place. Raises ApiError."""
    media = 0
    rewrite = False
    for parts, where, anthropic in _part_lists(route, body):
        bare = where == "input"  # Responses items: only the parts among them are parts
        for i, part in enumerate(parts):
            if not isinstance(part, dict):
                continue
            param = f"{where}[{i}]"
            found = _classify(route, part, param, anthropic, bare)
            if found == _SKIP:
                continue
            if not isinstance(found, tuple):  # a text part: nothing but a uuid to remove
                if "uuid" in part:
                    rewrite = True
                    if drop_uuids:
                        parts[i] = {k: v for k, v in part.items() if k != "uuid"}
                continue
            url, kind = found
            item = Media(parts, i, param, url, "image" if kind is None else kind.modality, kind)
            _check_url(route, url, item.media_param, allow_remote)
            media += 1
            rewrite = True
            if visit is not None:
                visit(item)
    if media > MAX_MEDIA_ITEMS:
        raise _too_many(route)
    return ContentCheck(media, rewrite)


# -- the API ----------------------------------------------------------------------------


def check(route: str, body: Mapping[str, Any], *, allow_remote: bool = False) -> ContentCheck:
    """Refuse what may not reach a replica (400 naming the parameter); count the media.

    ``allow_remote`` lets http(s) media pass, for a caller that inlines it with
    `remote_media` / `inline_media` before forwarding. Cheap when the body has no parts:
    a text request costs one look at each message's content (measured on
    tests/policy/bench_parse.py's chat bodies: +1 us on inspect + prepare at 7 messages,
    +3 us at 41, +9 us at 201; prepare's own fast path is unchanged).
    """
    if body.get(EMBEDS_FIELD) is not None:
        raise _embeds(route, EMBEDS_FIELD)
    stripped = not MM_STRIPPED_FIELDS.isdisjoint(body)
    if not _has_parts(route, body):
        return ContentCheck(0, stripped)
    found = _walk(route, body, allow_remote=allow_remote)
    return ContentCheck(found.media, found.rewrite or stripped)


def rewrite(route: str, body: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """Make ``body`` (a private copy: it is changed in place, and returned) what may reach a
    replica: `MM_STRIPPED_FIELDS` removed, every client uuid removed, each media part
    rebuilt from what vLLM reads of it, with the namespace's media uuid when ``salt`` is
    set. Call after `check` passed on the same body.

    A media part keeps only its type, its media and ``detail``: vLLM reads a part with a
    uuid by its members, not its type (chat_utils.py:1715-1803), so a second media member
    left beside the one hashed here could be the one it loads.
    """
    for name in MM_STRIPPED_FIELDS:
        body.pop(name, None)

    def visit(item: Media) -> None:
        parts, i, url, kind = item.parts, item.position, item.url, item.kind
        part = parts[i]
        if kind is None:  # Anthropic: vLLM drops a block's other members, uuid included
            parts[i] = {k: v for k, v in part.items() if k != "uuid"}
            return
        type_name = _part_type(part)
        value = part[kind.key]
        if kind.key == "input_audio":
            value = {"data": value["data"], "format": value["format"]}
        elif kind.nested_url:
            inner = {"url": url}
            if isinstance(value, dict) and "detail" in value:
                inner["detail"] = value["detail"]
            value = inner
        rebuilt: dict[str, Any] = {"type": type_name, kind.key: value}
        if "detail" in part:
            rebuilt["detail"] = part["detail"]
        if salt is not None:
            rebuilt["uuid"] = media_uuid(salt, item.modality, url.encode("utf-8"))
        parts[i] = rebuilt

    if _has_parts(route, body):
        _walk(route, body, allow_remote=True, visit=visit, drop_uuids=True)
    return body


def remote_media(route: str, body: Mapping[str, Any]) -> list[RemoteMedia]:
    """The http(s) media references of a body, in body order (for a fetcher to inline).

    Raises ApiError for what `check` refuses whatever the fetcher does (null media,
    embeds, unknown parts, too many items).
    """
    found: list[RemoteMedia] = []

    def visit(item: Media) -> None:
        if item.url[:8].lower().startswith(_REMOTE_SCHEMES):
            found.append(RemoteMedia(item.media_param, item.url, item.modality))

    if body.get(EMBEDS_FIELD) is not None:
        raise _embeds(route, EMBEDS_FIELD)
    if _has_parts(route, body):
        _walk(route, body, allow_remote=True, visit=visit)
    return found


def inline_media(route: str, body: dict[str, Any], data_urls: Mapping[str, str]) -> dict[str, Any]:
    """``body`` (a private copy, changed in place and returned) with each remote media URL
    that is a key of ``data_urls`` replaced by its value, a ``data:<type>;base64,<data>``
    URL (an Anthropic url source becomes a base64 source). Other references are left."""

    def visit(item: Media) -> None:
        parts, i, url, kind = item.parts, item.position, item.url, item.kind
        data_url = data_urls.get(url)
        if data_url is None or not url[:8].lower().startswith(_REMOTE_SCHEMES):
            return
        part = dict(parts[i])
        if kind is None:
            head, sep, data = data_url.partition(",")
            if not head.startswith(_DATA_SCHEME) or not head.endswith(";base64") or not sep:
                raise ValueError("inline_media needs data:<type>;base64,<data> URLs")
            media_type = head[len(_DATA_SCHEME) : -len(";base64")]
            part["source"] = {"type": "base64", "media_type": media_type, "data": data}
        elif kind.nested_url:
            value = part[kind.key]
            part[kind.key] = {**value, "url": data_url} if isinstance(value, dict) else data_url
        else:
            part[kind.key] = data_url
        parts[i] = part

    if _has_parts(route, body):
        _walk(route, body, allow_remote=True, visit=visit)
    return body
