"""Spec v1 derivations: sub-keys, cache salts, route windows and route keys.

Every gateway instance of a cluster must compute the same bytes from the same inputs, so
each step here is specified in docs/spec.md and pinned by vectors computed by an
independent implementation (tests/spec/test_vectors.py, tests/spec/vectors_v1.json).
Changing any detail moves every tenant to a fresh cache namespace (salts) or re-homes
every conversation (route keys): bump the version label instead.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from saltgate.policy.errors import ApiError
from saltgate.spec.encoding import b64url_nopad, lp, u32be

# -- labels (ASCII; part of the spec) ----------------------------------------------------
LABEL_SALT_KEY: Final = b"saltgate/v1/salt"
LABEL_ROUTE_KEY: Final = b"saltgate/v1/route"
LABEL_KV_EVENTS_KEY: Final = b"saltgate/v1/kv-events"
CACHE_SALT_DOMAIN: Final = b"saltgate/v1/cache-salt"
ROUTE_DOMAIN: Final = b"saltgate/v1/route"
PREFIX_DOMAIN: Final = b"saltgate/v1/prefix"
SALT_PREFIX: Final = "sg1_"
SALT_LENGTH: Final = 47  # "sg1_" + 43 base64url characters of a 32-byte MAC

MASTER_KEY_MIN_BYTES: Final = 32
SUBKEY_BYTES: Final = 32

SECRET_FIELD: Final = "user_cache_secret"  # noqa: S105 - a field name, not a secret
SECRET_MIN_CHARS: Final = 16
SECRET_MAX_CHARS: Final = 256

DEFAULT_WINDOW_BYTES: Final = 1024
DEFAULT_MIN_PROMPT_BYTES: Final = 4096
MAX_PREFIX_DEPTH: Final = 256 * 1024

# Route-window piece tags, one ASCII byte each (see docs/spec.md, "Route window").
TAG_PROMPT_CACHE_KEY: Final = b"K"
TAG_TOOLS: Final = b"T"
TAG_SYSTEM: Final = b"S"
TAG_USER: Final = b"U"
TAG_PROMPT: Final = b"P"
TAG_TOKEN_IDS: Final = b"I"
FRAME_HEADER_BYTES: Final = 5  # tag (1) + u32be length (4)

ROUTE_CHAT: Final = "/v1/chat/completions"
ROUTE_COMPLETIONS: Final = "/v1/completions"
ROUTE_RESPONSES: Final = "/v1/responses"
ROUTE_MESSAGES: Final = "/v1/messages"

# A token id counts this many bytes toward the prompt size (a typical bytes-per-token
# ratio), so the floor means roughly the same prompt length for text and token prompts.
TOKEN_ID_BYTES: Final = 4

_SYSTEM_ROLES: Final = frozenset({"system", "developer"})


# -- sub-keys ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SubKeys:
    """The cluster's purpose-bound keys; one leaked sub-key does not expose the others."""

    salt: bytes = field(repr=False)
    route: bytes = field(repr=False)
    kv_events: bytes = field(repr=False)

    def __repr__(self) -> str:
        return "SubKeys(<redacted>)"


def _hkdf_sha256(master_key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=SHA256(), length=SUBKEY_BYTES, salt=None, info=info).derive(master_key)


def derive_subkeys(master_key: bytes) -> SubKeys:
    """HKDF-SHA256 (RFC 5869, no salt) of the cluster secret into the three sub-keys."""
    if not isinstance(master_key, bytes | bytearray):
        raise TypeError("master_key must be bytes")
    if len(master_key) < MASTER_KEY_MIN_BYTES:
        # Say how long it must be, never what it is.
        raise ValueError(
            f"master_key must be at least {MASTER_KEY_MIN_BYTES} random bytes "
            f"(got {len(master_key)} bytes)"
        )
    key = bytes(master_key)
    return SubKeys(
        salt=_hkdf_sha256(key, LABEL_SALT_KEY),
        route=_hkdf_sha256(key, LABEL_ROUTE_KEY),
        kv_events=_hkdf_sha256(key, LABEL_KV_EVENTS_KEY),
    )


@functools.lru_cache(maxsize=16)
def _hmac_base(key: bytes) -> hmac.HMAC:
    return hmac.new(key, digestmod=hashlib.sha256)


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    """HMAC-SHA256(key, msg), from a cached keyed state (the hmac module's copy()).

    With OpenSSL 3 a one-shot hmac.digest pays ~4 us of setup per call, the copy ~1.5 us;
    the gateway computes two per request (salt, route key).
    """
    mac = _hmac_base(key).copy()
    mac.update(msg)
    return mac.digest()


# -- user_cache_secret and the cache salt ------------------------------------------------


def validate_user_cache_secret(value: object) -> str | None:
    """Apply spec v1's one rule for ``user_cache_secret`` (Tinfoil's SDKs drifted on it).

    None or "" mean "no secret" (tenant-wide namespace); a string of 16..256 characters
    (code points) is the secret; anything else is a 400 that does not echo the value.
    """
    if value is None or value == "":
        return None
    if isinstance(value, str) and SECRET_MIN_CHARS <= len(value) <= SECRET_MAX_CHARS:
        return value
    what = "a string" if isinstance(value, str) else "a JSON string"
    raise ApiError(
        400,
        f"Invalid '{SECRET_FIELD}': expected {what} of {SECRET_MIN_CHARS} to "
        f"{SECRET_MAX_CHARS} characters (e.g. 64 hex digits of 32 random bytes), "
        'or omit it / send "" to use the tenant-wide cache.',
        param=SECRET_FIELD,
        code="invalid_user_cache_secret",
    )


def cache_salt(k_salt: bytes, tenant_id: str, epoch: str, user_cache_secret: str | None) -> str:
    """The vLLM ``cache_salt`` for a request: keyed, so nobody without K_salt can compute it.

    ``"sg1_" + b64url_nopad(HMAC-SHA256(K_salt, domain || lp(mode) || lp(tenant) ||
    lp(epoch) [|| lp(secret)]))``; mode is "user" with a secret, else "tenant". A secret of
    "" counts as absent (the spec's rule). Always 47 characters of [A-Za-z0-9_-].
    """
    if not tenant_id:
        raise ValueError("tenant_id must be non-empty")
    if user_cache_secret:
        msg = b"".join(
            (
                CACHE_SALT_DOMAIN,
                lp(b"user"),
                lp(tenant_id.encode("utf-8")),
                lp(epoch.encode("utf-8")),
                lp(user_cache_secret.encode("utf-8")),
            )
        )
    else:
        msg = b"".join(
            (
                CACHE_SALT_DOMAIN,
                lp(b"tenant"),
                lp(tenant_id.encode("utf-8")),
                lp(epoch.encode("utf-8")),
            )
        )
    return SALT_PREFIX + b64url_nopad(hmac_sha256(k_salt, msg))


# -- route window and route key ----------------------------------------------------------


def _utf8_len(s: str) -> int:
    # isascii() is O(1) on CPython's compact strings; only non-ASCII text is encoded.
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _parts_text(content: object) -> Iterator[str]:
    """The text pieces of a message content: the string itself, or each part's "text"."""
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                if isinstance(text, str):
                    yield text


def _canonical_tools(tools: object) -> bytes | None:
    """Compact JSON with keys sorted by code point, as orjson writes it (docs/spec.md)."""
    if tools is None or tools == []:
        return None
    return orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)


def _is_token_id(x: object) -> bool:
    return type(x) is int


class _Window:
    """Appends framed pieces up to a byte budget; never reads past what fits.

    A frame is tag || u32be(n) || the first n bytes of the piece, n = min(len(piece),
    room). Truncating before framing keeps a growing prompt with a stable beginning on
    a stable window, and bounds the work by the window, not the prompt.
    """

    __slots__ = ("buf", "limit")

    def __init__(self, limit: int) -> None:
        self.buf = bytearray()
        self.limit = limit

    def room(self) -> int:
        return self.limit - len(self.buf) - FRAME_HEADER_BYTES

    def add_bytes(self, tag: bytes, data: bytes) -> None:
        room = self.room()
        if room <= 0:
            return
        piece = data[:room]
        self.buf += tag
        self.buf += u32be(len(piece))
        self.buf += piece

    def add_texts(self, tag: bytes, texts: Iterator[str]) -> None:
        """One piece made of the concatenation of ``texts``, read only as far as needed."""
        room = self.room()
        if room <= 0:
            return
        chunks: list[str] = []
        chars = 0
        for text in texts:
            # Each code point is >= 1 UTF-8 byte: `room` characters cover `room` bytes.
            chunks.append(text[: room - chars])
            chars += len(chunks[-1])
            if chars >= room:
                break
        self.add_bytes(tag, "".join(chunks).encode("utf-8"))

    def add_token_ids(self, tag: bytes, ids: list[Any]) -> None:
        """Token ids as ASCII decimal joined by ",", up to the first non-integer element."""
        room = self.room()
        if room <= 0:
            return
        out: list[str] = []
        size = -1
        for t in ids:
            if not _is_token_id(t):
                break
            out.append(str(t))
            size += len(out[-1]) + 1
            if size >= room:
                break
        self.add_bytes(tag, ",".join(out).encode("ascii"))


def _leading_chat(messages: object) -> Iterator[tuple[bytes, object]]:
    """(tag, content) of the system/developer messages before the first user message, then it."""
    if not isinstance(messages, list):
        return
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role in _SYSTEM_ROLES:
            yield TAG_SYSTEM, msg.get("content")
        elif role == "user":
            yield TAG_USER, msg.get("content")
            return


def _completion_prompt(prompt: object) -> tuple[bytes, object] | None:
    """The prompt that feeds the window: a string, token ids, or the first of a batch."""
    if isinstance(prompt, str):
        return TAG_PROMPT, prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if _is_token_id(first):
            return TAG_TOKEN_IDS, prompt
        if isinstance(first, str):
            return TAG_PROMPT, first
        if isinstance(first, list):
            return TAG_TOKEN_IDS, first
    return None


MessagesReader = Callable[[object], Iterator[tuple[bytes, object]]]


def _route_pieces(
    body: Mapping[str, Any], route: str, read_messages: MessagesReader
) -> Iterator[tuple[bytes, object]]:
    """The route-specific pieces after K and T, in prompt order: (tag, content or ids).

    `read_messages` decides which messages count: the leading ones for the window
    (docs/spec.md), all of them for the prefix digests.
    """
    if route == ROUTE_CHAT:
        yield from read_messages(body.get("messages"))
    elif route == ROUTE_COMPLETIONS:
        piece = _completion_prompt(body.get("prompt"))
        if piece is not None:
            yield piece
    elif route == ROUTE_RESPONSES:
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            yield TAG_SYSTEM, instructions
        inp = body.get("input")
        if isinstance(inp, str):
            yield TAG_USER, inp
        else:
            yield from read_messages(inp)
    elif route == ROUTE_MESSAGES:
        system = body.get("system")
        if system is not None:
            yield TAG_SYSTEM, system
        yield from read_messages(body.get("messages"))


def _all_texts(body: Mapping[str, Any], route: str) -> Iterator[str]:
    """Every text the prompt size counts besides tools (docs/spec.md, "Prompt size")."""
    if route in (ROUTE_CHAT, ROUTE_MESSAGES):
        if route == ROUTE_MESSAGES:
            yield from _parts_text(body.get("system"))
        messages = body.get("messages")
        if isinstance(messages, list):
            for msg in messages:
                if isinstance(msg, dict):
                    yield from _parts_text(msg.get("content"))
    elif route == ROUTE_RESPONSES:
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            yield instructions
        inp = body.get("input")
        if isinstance(inp, str):
            yield inp
        elif isinstance(inp, list):
            for item in inp:
                if isinstance(item, dict):
                    yield from _parts_text(item.get("content"))


def _completion_size(prompt: object, limit: int | None) -> int:
    piece = _completion_prompt(prompt)
    if piece is None:
        return 0
    _tag, value = piece
    if isinstance(value, str):
        return _utf8_len(value)
    assert isinstance(value, list)
    count = 0
    for t in value:
        if not _is_token_id(t):
            break
        count += 1
        if limit is not None and TOKEN_ID_BYTES * count >= limit:
            break
    return TOKEN_ID_BYTES * count


def prompt_size(
    body: Mapping[str, Any],
    route: str,
    *,
    limit: int | None = None,
    tools_json: bytes | None = None,
) -> int:
    """UTF-8 bytes of the whole prompt as spec v1 counts it, for the routing floor.

    Counts the canonical tools JSON plus every message text (all roles; text parts only),
    ``system``/``instructions``, or the completion prompt (first of a batch; token ids
    count TOKEN_ID_BYTES each). Stops early and returns a value >= ``limit`` once reached.
    """
    if tools_json is None:
        tools_json = _canonical_tools(body.get("tools"))
    total = len(tools_json) if tools_json is not None else 0
    if limit is not None and total >= limit:
        return total
    if route == ROUTE_COMPLETIONS:
        return total + _completion_size(body.get("prompt"), limit)
    for text in _all_texts(body, route):
        # UTF-8 bytes >= code points: skip encoding when the characters already reach it.
        if limit is not None and total + len(text) >= limit:
            return total + len(text)
        total += _utf8_len(text)
        if limit is not None and total >= limit:
            return total
    return total


def route_window(
    body: Mapping[str, Any],
    route: str,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    min_prompt_bytes: int = DEFAULT_MIN_PROMPT_BYTES,
) -> bytes | None:
    """The first ``window_bytes`` of spec v1's framing of what begins the prompt, or None.

    Pieces, in order: K prompt_cache_key (non-empty string), T tools (canonical JSON),
    then per route S system/developer/instructions and U the first user message (chat,
    responses, messages) or P prompt / I token ids (completions). None when there is no
    prompt_cache_key and the prompt size is below ``min_prompt_bytes``: such requests
    are not worth pinning and go to the least-loaded replica. ``body`` must come from
    parse_json_object (strings are valid UTF-8).
    """
    if window_bytes < 0:
        raise ValueError("window_bytes must be >= 0")
    pck = body.get("prompt_cache_key")
    has_key = isinstance(pck, str) and pck != ""
    tools_json = _canonical_tools(body.get("tools"))
    if (
        not has_key
        and prompt_size(body, route, limit=min_prompt_bytes, tools_json=tools_json)
        < min_prompt_bytes
    ):
        return None
    window = _Window(window_bytes)
    if has_key:
        assert isinstance(pck, str)
        window.add_texts(TAG_PROMPT_CACHE_KEY, iter((pck,)))
    if tools_json is not None:
        window.add_bytes(TAG_TOOLS, tools_json)
    for tag, value in _route_pieces(body, route, _leading_chat):
        if window.room() <= 0:
            break
        if tag == TAG_TOKEN_IDS:
            assert isinstance(value, list)
            window.add_token_ids(tag, value)
        else:
            window.add_texts(tag, _parts_text(value))
    return bytes(window.buf)


def route_key(k_route: bytes, model: str, salt: str, window: bytes) -> bytes:
    """HMAC-SHA256(K_route, domain || lp(model) || lp(salt) || lp(window)): 32 bytes.

    Keyed by the cluster secret, so no client can compute (or aim at) its replica.
    """
    msg = b"".join((ROUTE_DOMAIN, lp(model.encode("utf-8")), lp(salt.encode("utf-8")), lp(window)))
    return hmac_sha256(k_route, msg)


# -- prefix digests (router-local affinity, docs/routing.md) ------------------------------

TAG_ASSISTANT: Final = b"A"
TAG_OTHER: Final = b"O"
_ROLE_TAGS: Final = {
    "system": TAG_SYSTEM,
    "developer": TAG_SYSTEM,
    "user": TAG_USER,
    "assistant": TAG_ASSISTANT,
}


def _conversation(messages: object) -> Iterator[tuple[bytes, object]]:
    """(tag, content) of every message, in order."""
    if not isinstance(messages, list):
        return
    for msg in messages:
        if isinstance(msg, dict):
            role = msg.get("role")
            tag = _ROLE_TAGS.get(role, TAG_OTHER) if isinstance(role, str) else TAG_OTHER
            yield tag, msg.get("content")


def _whole_prompt(body: Mapping[str, Any], route: str) -> Iterator[tuple[bytes, str]]:
    """Every piece of the prompt as text, in order, later turns included (unlike the window)."""
    pck = body.get("prompt_cache_key")
    if isinstance(pck, str) and pck:
        yield TAG_PROMPT_CACHE_KEY, pck
    tools = _canonical_tools(body.get("tools"))
    if tools is not None:
        yield TAG_TOOLS, tools.decode("utf-8")
    for tag, value in _route_pieces(body, route, _conversation):
        if tag == TAG_TOKEN_IDS:
            assert isinstance(value, list)
            yield tag, ",".join(map(str, itertools.takewhile(_is_token_id, value))) + ","
        elif isinstance(value, str):
            yield tag, value
        else:
            yield tag, "".join(_parts_text(value))


def flat_prompt(body: Mapping[str, Any], route: str, max_depth: int = MAX_PREFIX_DEPTH) -> bytes:
    """The prompt flattened as tag || text per piece, up to ``max_depth`` bytes.

    With no lengths between pieces, a growing prompt keeps its earlier bytes as a prefix:
    a routing hint, not a commitment, so pieces need no unambiguous framing. Its length
    is also the router's measure of the prefill work a request brings.
    """
    pieces: list[bytes] = []
    size = 0
    for tag, text in _whole_prompt(body, route):
        piece = tag + text[:max_depth].encode("utf-8")
        pieces.append(piece)
        size += len(piece)
        if size >= max_depth:
            break
    return b"".join(pieces)[:max_depth]


def prefix_digests_of(
    flat: bytes, k_route: bytes, model: str, salt: str, first_depth: int = DEFAULT_WINDOW_BYTES
) -> list[bytes]:
    """Keyed digests of ``flat[:d]`` for d = first_depth, 2x, 4x, ... <= len(flat), shallow first.

    ``flat`` comes from `flat_prompt`. A later turn of a conversation extends the earlier
    prompt, so they share the digests up to the earlier prompt's length (within a factor
    2): the router remembers which replica served a digest and sends the next turn there.
    Tenants never share a digest, and nothing outside the gateway can compute one. Local
    to a gateway: not part of what gateways must agree on (the window key is).

    One SHA-256 pass, finished on a copy at each depth. Keyed by prefixing the route
    sub-key, the model and the (secret-derived) salt: a digest is only ever a key of the
    router's in-memory table, never shown to anyone, so the length extension that HMAC
    guards against gives nothing away, and HMAC would double the cost (its finish on a
    copy runs two hashes per depth).
    """
    if first_depth <= 0:
        raise ValueError("first_depth must be positive")
    running = hashlib.sha256(
        b"".join((PREFIX_DOMAIN, lp(k_route), lp(model.encode()), lp(salt.encode())))
    )
    digests: list[bytes] = []
    done = 0
    depth = first_depth
    while depth <= len(flat):
        running.update(flat[done:depth])
        done = depth
        digests.append(running.copy().digest())
        depth *= 2
    return digests
