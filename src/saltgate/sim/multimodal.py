"""The simulator's multimodal caches, keyed exactly as vLLM keys them (docs/sim.md).

vLLM keeps the processed form of each media item in two caches shared by every request:
the multimodal processor cache (API server) and the encoder cache (engine). Both key an
item by the content part's client ``uuid`` verbatim when one is given, else by a hash of
the item's bytes (and the model); neither key holds ``cache_salt`` or a tenant (vLLM 0.32
``multimodal/processing/inputs.py:91-105``, ``multimodal/hasher.py:117-127``,
``v1/core/encoder_cache_manager.py:111-138``). A part whose media is null but whose uuid
is cached is served from the cache; on a miss vLLM answers "Cache miss for image at index
0 but data is not provided." (``processing/processor.py:1371-1376``).

Here the two caches are one LRU (they share the key, so they hit together), and an item's
"features" are placeholder tokens derived from its bytes: ``n = 8 + len(bytes) // 64``
(at most 256) filler words picked by the bytes' SHA-256. A request whose part hits
another request's entry is built with that entry's features, so its prompt (its token
ids, its usage, its output) is the other request's image's, as in vLLM. The hits are
counted in ``vllm:mm_cache_queries`` / ``vllm:mm_cache_hits``, vLLM's metric names.

Simplifications: every route shares the one cache (vLLM's /tokenize uses a processor-only
cache of its own); media must be ``data:`` URLs (the simulator fetches nothing); Anthropic
image blocks lose their uuid as vLLM 0.32's converter drops it
(``entrypoints/anthropic/serving.py:487-489``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections import Counter, OrderedDict, deque
from typing import Any, Final

from saltgate.sim.errors import SimError
from saltgate.sim.tokenizer import FILLER_WORDS

CAPACITY: Final = 1024  # items
MIN_FEATURES: Final = 8
MAX_FEATURES: Final = 256
BYTES_PER_FEATURE: Final = 64

# The part types vLLM reads as media, the member holding it, and the modality.
_MEDIA: Final = {
    "image_url": ("image_url", "image"),
    "input_image": ("image_url", "image"),
    "audio_url": ("audio_url", "audio"),
    "video_url": ("video_url", "video"),
    "input_audio": ("input_audio", "audio"),
}
_EMBEDS: Final = frozenset({"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds"})
_CHAT_ROUTES: Final = frozenset(
    {b"/v1/chat/completions", b"/tokenize", b"/v1/embeddings", b"/pooling", b"/classify"}
)
_ANTHROPIC_ROUTES: Final = frozenset({b"/v1/messages", b"/v1/messages/count_tokens"})


def features(data: bytes) -> str:
    """An item's processed form, as text the simulator's tokenizer reads one token a word."""
    n = min(MAX_FEATURES, MIN_FEATURES + len(data) // BYTES_PER_FEATURE)
    picks = hashlib.shake_256(hashlib.sha256(data).digest()).digest(n)
    return "".join(" " + FILLER_WORDS[b % len(FILLER_WORDS)] for b in picks)


def _decode(url: object, modality: str) -> bytes | None:
    """A data: URL's bytes; None for no media; 400 for what vLLM could not load."""
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith("data:"):
        raise SimError(400, f"The simulator loads {modality} media from data: URLs only.")
    head, _, data = url.partition(",")
    try:
        return base64.b64decode(data, validate=True) if head.endswith(";base64") else data.encode()
    except binascii.Error:
        raise SimError(400, f"Failed to load {modality}: invalid base64 data.") from None


class MediaCache:
    """vLLM's processor and encoder caches over the simulator's requests (one per replica)."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self._items: OrderedDict[str, str] = OrderedDict()
        self._capacity = capacity
        self.queries = 0
        self.hits = 0
        # Which entries were hit, and how often: tests tell whose item served a request.
        self.hits_by_key: Counter[str] = Counter()
        self.stored: deque[str] = deque(maxlen=capacity)  # keys stored, latest last

    def _item(self, key: str | None, data: bytes | None, modality: str, index: int) -> str:
        """The features of one item: from the cache by its key, else processed and kept."""
        if key is None:
            if data is None:
                raise SimError(400, f"Missing media for {modality} at index {index}.")
            # vLLM's content hash: the model, the modality and the original bytes.
            key = hashlib.sha256(modality.encode() + b"\0" + data).hexdigest()
        self.queries += 1
        cached = self._items.get(key)
        if cached is not None:
            self.hits += 1
            self.hits_by_key[key] += 1
            self._items.move_to_end(key)
            return cached
        if data is None:
            raise SimError(
                400, f"Cache miss for {modality} at index {index} but data is not provided."
            )
        made = features(data)
        self._items[key] = made
        self.stored.append(key)
        if len(self._items) > self._capacity:
            evicted, _ = self._items.popitem(last=False)
            self.hits_by_key.pop(evicted, None)
        return made

    def _part(self, part: Any, counts: dict[str, int], anthropic: bool) -> Any:
        """A content part with its media replaced by its features (a text part)."""
        if not isinstance(part, dict):
            return part
        kind = part.get("type")
        if kind in _EMBEDS:
            flag = "prompt" if kind == "prompt_embeds" else "mm"
            raise SimError(400, f"You must set `--enable-{flag}-embeds` to input `{kind}`")
        if anthropic:
            if kind != "image":
                return part
            source = part.get("source") or {}
            url = None
            if source.get("data"):
                url = f"data:{source.get('media_type', 'image/jpeg')};base64,{source['data']}"
            elif source.get("type") == "url":
                url = source.get("url")
            member, modality, uuid = None, "image", None  # the uuid does not survive
        elif kind in _MEDIA:
            member, modality = _MEDIA[kind]
            uuid = part.get("uuid")
            value = part.get(member)
            if member == "input_audio":  # vLLM builds a data: URL of it
                audio = value if isinstance(value, dict) else {}
                data = audio.get("data")
                value = f"data:audio/{audio.get('format')};base64,{data}" if data else None
            url = value.get("url") if isinstance(value, dict) else value
        else:
            return part
        index = counts.get(modality, 0)
        counts[modality] = index + 1
        text = self._item(
            None if uuid is None else str(uuid), _decode(url, modality), modality, index
        )
        return {"type": "text", "text": f"<{modality}>{text}"}

    def _parts(self, content: Any, counts: dict[str, int], anthropic: bool) -> Any:
        if not isinstance(content, list):
            return content
        return [self._part(part, counts, anthropic) for part in content]

    def resolve(self, route: bytes, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with every media part of its route's messages replaced by its features,
        through the cache; vLLM's refusals for embeds and cache misses."""
        if body.get("prompt_embeds") is not None:
            raise SimError(400, "You must set `--enable-prompt-embeds` to input `prompt_embeds`.")
        counts: dict[str, int] = {}
        if route in _CHAT_ROUTES or route in _ANTHROPIC_ROUTES:
            messages = body.get("messages")
            anthropic = route in _ANTHROPIC_ROUTES
            if isinstance(messages, list):
                body["messages"] = [
                    {**m, "content": self._parts(m.get("content"), counts, anthropic)}
                    if isinstance(m, dict)
                    else m
                    for m in messages
                ]
        elif route == b"/v1/responses" and isinstance(body.get("input"), list):
            body["input"] = [
                {**item, "content": self._parts(item.get("content"), counts, False)}
                if isinstance(item, dict) and "content" in item
                else item
                for item in body["input"]
            ]
        return body
