"""Spec v1 derivations: sub-keys, cache salts, route windows and route keys.

Every gateway instance of a cluster must compute the same bytes from the same inputs, so
each step here is specified in docs/spec.md and pinned by vectors computed by an
independent implementation (tests/derivations/test_vectors.py, tests/derivations/vectors_v1.json).
Changing any detail moves every tenant to a fresh cache namespace (salts) or re-homes
every conversation (route keys): bump the version label instead.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NewType

import orjson
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from saltgate.derivations.encoding import U32_MAX, b64url_nopad, lp, u32be
from saltgate.derivations.labels import (
    CACHE_SALT_DOMAIN,
    CLUSTER_BATCH_DOMAIN,
    CLUSTER_STREAM_DOMAIN,
    LABEL_AUDIT_KEY,
    LABEL_CLUSTER_BUS_KEY,
    LABEL_KV_EVENTS_KEY,
    LABEL_ROUTE_KEY,
    LABEL_SALT_KEY,
    MEDIA_UUID_DOMAIN,
    MEDIA_UUID_PREFIX,
    PREFIX_DOMAIN,
    ROUTE_DOMAIN,
    SALT_PREFIX,
)

SALT_LENGTH: Final = 47  # "sg1_" + 43 base64url characters of a 32-byte MAC

MASTER_KEY_MIN_BYTES: Final = 32
SUBKEY_BYTES: Final = 32

SECRET_FIELD: Final = "user_cache_secret"  # noqa: S105 - a field name, not a secret
SECRET_MIN_CHARS: Final = 16
SECRET_MAX_CHARS: Final = 256

# A request's route key (`route_key`) and a prompt prefix's keyed digest
# (`NamespaceKeys.prefix_digests`): 32 secret-keyed bytes each, named apart so that one
# never stands in for the other.
RouteKey = NewType("RouteKey", bytes)
PrefixDigest = NewType("PrefixDigest", bytes)

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

TAG_ASSISTANT: Final = b"A"
TAG_OTHER: Final = b"O"
_ROLE_TAGS: Final = {
    "system": TAG_SYSTEM,
    "developer": TAG_SYSTEM,
    "user": TAG_USER,
    "assistant": TAG_ASSISTANT,
}


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


def _checked_master(master_key: bytes) -> bytes:
    if not isinstance(master_key, bytes | bytearray):
        raise TypeError("master_key must be bytes")
    if len(master_key) < MASTER_KEY_MIN_BYTES:
        # Say how long it must be, never what it is.
        raise ValueError(
            f"master_key must be at least {MASTER_KEY_MIN_BYTES} random bytes "
            f"(got {len(master_key)} bytes)"
        )
    return bytes(master_key)


def derive_subkeys(master_key: bytes) -> SubKeys:
    """HKDF-SHA256 (RFC 5869, no salt) of the cluster secret into the three sub-keys."""
    key = _checked_master(master_key)
    return SubKeys(
        salt=_hkdf_sha256(key, LABEL_SALT_KEY),
        route=_hkdf_sha256(key, LABEL_ROUTE_KEY),
        kv_events=_hkdf_sha256(key, LABEL_KV_EVENTS_KEY),
    )


def derive_audit_key(master_key: bytes) -> bytes:
    """K_audit (docs/spec.md section 13): HKDF-SHA256 of the master key, the audit log's
    HMAC key. The database holds the chain, never this key."""
    return _hkdf_sha256(_checked_master(master_key), LABEL_AUDIT_KEY)


def audit_entry_mac(k_audit: bytes, prev_hash: bytes, fields_json: bytes) -> bytes:
    """A keyed audit entry's hash (section 13): HMAC-SHA256 under K_audit of the previous
    entry's hash and the canonical JSON of the entry's fields."""
    return hmac.new(k_audit, prev_hash + fields_json, hashlib.sha256).digest()


CLUSTER_TAG_BYTES: Final = 16


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """What the gateways of a cluster share on their bus (docs/spec.md, section 11): the
    bus key, the stream's name (two clusters on one Redis never read each other's), and
    the tag that proves a batch came from a gateway holding the master key."""

    bus: bytes = field(repr=False)
    stream: str

    def tag(self, payload: bytes) -> bytes:
        """The first 16 bytes of HMAC-SHA256(K_bus, CLUSTER_BATCH_DOMAIN || payload)."""
        return hmac_sha256(self.bus, CLUSTER_BATCH_DOMAIN + payload)[:CLUSTER_TAG_BYTES]


def cluster_keys(k_route: bytes) -> ClusterKeys:
    """K_bus = HKDF-SHA256(K_route, info LABEL_CLUSTER_BUS_KEY); the stream is named by a
    MAC under it. From K_route: the bus carries routing state keyed by K_route anyway."""
    bus = _hkdf_sha256(k_route, LABEL_CLUSTER_BUS_KEY)
    name = hmac_sha256(bus, CLUSTER_STREAM_DOMAIN)[:8].hex()
    return ClusterKeys(bus, f"saltgate-cluster-{name}")


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


class InvalidSecretError(ValueError):
    """A ``user_cache_secret`` outside spec v1's rule. The message states the rule and
    never the value; the request policy answers it as a 400 naming the field."""


def validate_user_cache_secret(value: object) -> str | None:
    """Apply spec v1's one rule for ``user_cache_secret`` (Tinfoil's SDKs drifted on it).

    None or "" mean "no secret" (tenant-wide namespace); a string of 16..256 characters
    (code points) is the secret; anything else raises InvalidSecretError.
    """
    if value is None or value == "":
        return None
    if isinstance(value, str) and SECRET_MIN_CHARS <= len(value) <= SECRET_MAX_CHARS:
        return value
    what = "a string" if isinstance(value, str) else "a JSON string"
    raise InvalidSecretError(
        f"Invalid '{SECRET_FIELD}': expected {what} of {SECRET_MIN_CHARS} to "
        f"{SECRET_MAX_CHARS} characters (e.g. 64 hex digits of 32 random bytes), "
        'or omit it / send "" to use the tenant-wide cache.'
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


# -- media uuids -------------------------------------------------------------------------

MEDIA_UUID_LENGTH: Final = 48  # "sg1m_" + 43 base64url characters of a 32-byte MAC


def media_uuid(salt: str, modality: str, media: bytes) -> str:
    """The ``uuid`` the gateway sets on a multimodal content part (docs/spec.md, 12).

    ``"sg1m_" + b64url_nopad(HMAC-SHA256(key = UTF-8 of the cache salt, domain ||
    lp(modality) || lp(media)))``. vLLM keys its multimodal processor and encoder caches by
    a part's uuid verbatim, without the salt: keyed by the salt (itself a MAC under K_salt
    of tenant, epoch and user secret), the key is the namespace's own, and bound to the
    media and its modality, one uuid never names two different inputs (vLLM's engine
    fails on a uuid reused for items of different sizes). ``media`` is what vLLM reads:
    the part's URL string (a ``data:`` URL), see docs/spec.md for each part type.
    """
    if not salt:
        raise ValueError("salt must be non-empty")
    if len(media) > U32_MAX:
        raise ValueError("media longer than 2**32 - 1 bytes")
    head = MEDIA_UUID_DOMAIN + lp(modality.encode("utf-8")) + u32be(len(media))
    mac = hmac.new(salt.encode("utf-8"), head, hashlib.sha256)
    mac.update(media)  # lp(media) without copying the media into one buffer
    return MEDIA_UUID_PREFIX + b64url_nopad(mac.digest())


# -- route window and route key ----------------------------------------------------------


def _utf8_len(s: str) -> int:
    # isascii() is O(1) on CPython's compact strings; only non-ASCII text is encoded.
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _parts_text(content: object) -> Sequence[str]:
    """The text pieces of a message content: the string itself, or each part's "text".

    Sequences rather than generators throughout this walk: a prompt is read once per
    request, and a generator frame per message and level cost more than the reading.
    """
    if isinstance(content, str):
        return (content,)
    if isinstance(content, list):
        return [
            text
            for part in content
            if isinstance(part, dict) and isinstance(text := part.get("text"), str)
        ]
    return ()


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

    def add_texts(self, tag: bytes, texts: Sequence[str]) -> None:
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


# A piece of the prompt after K and T: (tag, content or token ids, whether the window
# reads it). Plain tuples: a prompt is walked once per request, and every object or
# generator frame per message costs more than the walk itself.
Piece = tuple[bytes, object, bool]


def _messages(messages: object, pieces: list[Piece]) -> list[Piece]:
    """Append every message, tagged by role; the window reads the leading ones: the
    system/developer messages before the first user message, then it."""
    if isinstance(messages, list):
        leading = True
        tags = _ROLE_TAGS
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            role = msg.get("role")
            tag = tags.get(role, TAG_OTHER) if isinstance(role, str) else TAG_OTHER
            if tag == TAG_USER:
                pieces.append((tag, msg.get("content"), leading))
                leading = False
            else:
                pieces.append((tag, msg.get("content"), leading and tag == TAG_SYSTEM))
    return pieces


def _prompt_pieces(body: Mapping[str, Any], route: str) -> list[Piece]:
    """The route's prompt pieces after K and T, in prompt order (docs/spec.md)."""
    if route == ROUTE_CHAT:
        return _messages(body.get("messages"), [])
    if route == ROUTE_COMPLETIONS:
        piece = _completion_prompt(body.get("prompt"))
        return [] if piece is None else [(*piece, True)]
    pieces: list[Piece] = []
    if route == ROUTE_RESPONSES:
        instructions = body.get("instructions")
        if isinstance(instructions, str):
            pieces.append((TAG_SYSTEM, instructions, True))
        inp = body.get("input")
        if isinstance(inp, str):
            pieces.append((TAG_USER, inp, True))
            return pieces
        return _messages(inp, pieces)
    if route == ROUTE_MESSAGES:
        system = body.get("system")
        if system is not None:
            pieces.append((TAG_SYSTEM, system, True))
        return _messages(body.get("messages"), pieces)
    return pieces


def _token_ids_size(ids: list[Any], limit: int | None) -> int:
    count = 0
    for t in ids:
        if not _is_token_id(t):
            break
        count += 1
        if limit is not None and TOKEN_ID_BYTES * count >= limit:
            break
    return TOKEN_ID_BYTES * count


class Prompt:
    """A request's prompt, walked once: the route window, the prompt size and the
    flattened prompt all read these pieces. ``body`` must come from parse_json_object
    (strings are valid UTF-8)."""

    __slots__ = ("cache_key", "pieces", "tools_json")

    def __init__(self, body: Mapping[str, Any], route: str) -> None:
        pck = body.get("prompt_cache_key")
        self.cache_key: str | None = pck if isinstance(pck, str) and pck else None
        self.tools_json = _canonical_tools(body.get("tools"))
        self.pieces = _prompt_pieces(body, route)

    def size(self, limit: int | None = None) -> int:
        """UTF-8 bytes of the whole prompt as spec v1 counts it, for the routing floor.

        Counts the canonical tools JSON plus every message text (all roles; text parts
        only), ``system``/``instructions``, or the completion prompt (first of a batch;
        token ids count TOKEN_ID_BYTES each); not the prompt_cache_key. Stops early and
        returns a value >= ``limit`` once reached.
        """
        total = len(self.tools_json) if self.tools_json is not None else 0
        if limit is not None and total >= limit:
            return total
        for tag, value, _leading in self.pieces:
            if tag == TAG_TOKEN_IDS:  # a completion's only piece
                assert isinstance(value, list)
                return total + _token_ids_size(value, limit)
            for text in _parts_text(value):
                # UTF-8 bytes >= code points: skip encoding when the characters reach it.
                if limit is not None and total + len(text) >= limit:
                    return total + len(text)
                total += _utf8_len(text)
                if limit is not None and total >= limit:
                    return total
        return total

    def window(
        self,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
        min_prompt_bytes: int = DEFAULT_MIN_PROMPT_BYTES,
    ) -> bytes | None:
        """The first ``window_bytes`` of spec v1's framing of what begins the prompt, or None.

        Pieces, in order: K prompt_cache_key (non-empty string), T tools (canonical JSON),
        then per route S system/developer/instructions and U the first user message (chat,
        responses, messages) or P prompt / I token ids (completions). None when there is
        no prompt_cache_key and the prompt size is below ``min_prompt_bytes``: such
        requests are not worth pinning and go to the least-loaded replica.
        """
        if window_bytes < 0:
            raise ValueError("window_bytes must be >= 0")
        if self.cache_key is None and self.size(min_prompt_bytes) < min_prompt_bytes:
            return None
        window = _Window(window_bytes)
        if self.cache_key is not None:
            window.add_texts(TAG_PROMPT_CACHE_KEY, (self.cache_key,))
        if self.tools_json is not None:
            window.add_bytes(TAG_TOOLS, self.tools_json)
        for tag, value, leading in self.pieces:
            if not leading:
                continue
            if window.room() <= 0:
                break
            if tag == TAG_TOKEN_IDS:
                assert isinstance(value, list)
                window.add_token_ids(tag, value)
            else:
                window.add_texts(tag, _parts_text(value))
        return bytes(window.buf)

    def flat(self, max_depth: int = MAX_PREFIX_DEPTH) -> bytes:
        """The prompt flattened as tag || text per piece, up to ``max_depth`` bytes.

        Pieces: K prompt_cache_key, T tools, then every message (tagged by role: S, U,
        A, O), system/instructions, or the completion prompt (token ids as "id," each).
        With no lengths between pieces, a growing prompt keeps its earlier bytes as a
        prefix: a routing hint, not a commitment, so pieces need no unambiguous framing.
        Its length is also the router's measure of the prefill work a request brings.
        """
        pieces: list[bytes] = []
        if self.cache_key is not None:
            pieces.append(TAG_PROMPT_CACHE_KEY + self.cache_key[:max_depth].encode("utf-8"))
        if self.tools_json is not None:
            pieces.append(TAG_TOOLS + self.tools_json[:max_depth])
        size = sum(map(len, pieces))
        for tag, value, _leading in self.pieces:
            if size >= max_depth:
                break
            if isinstance(value, str):
                text = value
            elif tag == TAG_TOKEN_IDS:
                assert isinstance(value, list)
                text = ",".join(map(str, itertools.takewhile(_is_token_id, value))) + ","
            else:
                text = "".join(_parts_text(value))
            piece = tag + text[:max_depth].encode("utf-8")
            pieces.append(piece)
            size += len(piece)
        return b"".join(pieces)[:max_depth]


def prompt_size(body: Mapping[str, Any], route: str, *, limit: int | None = None) -> int:
    """`Prompt.size` of a request body."""
    return Prompt(body, route).size(limit)


def route_window(
    body: Mapping[str, Any],
    route: str,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    min_prompt_bytes: int = DEFAULT_MIN_PROMPT_BYTES,
) -> bytes | None:
    """`Prompt.window` of a request body."""
    return Prompt(body, route).window(window_bytes, min_prompt_bytes)


def route_key(k_route: bytes, model: str, salt: str, window: bytes) -> RouteKey:
    """HMAC-SHA256(K_route, domain || lp(model) || lp(salt) || lp(window)): 32 bytes.

    Keyed by the cluster secret, so no client can compute (or aim at) its replica.
    """
    return NamespaceKeys(k_route, model, salt).route_key(window)


# -- keyed states per namespace: route key and prefix digests (docs/routing.md) --------


class NamespaceKeys:
    """The keyed hash states of one (model, cache salt) namespace, with everything but the
    prompt already absorbed: the router keeps one per namespace and finishes a copy per
    request (a copy costs a fraction of keying a fresh HMAC and framing the fields)."""

    __slots__ = ("_prefix", "_route")

    def __init__(self, k_route: bytes, model: str, salt: str) -> None:
        fields = lp(model.encode("utf-8")) + lp(salt.encode("utf-8"))
        self._route = hmac.new(k_route, ROUTE_DOMAIN + fields, hashlib.sha256)
        self._prefix = hashlib.sha256(PREFIX_DOMAIN + lp(k_route) + fields)

    def __repr__(self) -> str:  # the states are keyed by secrets
        return "NamespaceKeys(<keyed>)"

    def route_key(self, window: bytes) -> RouteKey:
        """`route_key` of ``window`` in this namespace."""
        mac = self._route.copy()
        mac.update(lp(window))
        return RouteKey(mac.digest())

    def prefix_digests(
        self, flat: bytes, first_depth: int = DEFAULT_WINDOW_BYTES
    ) -> list[PrefixDigest]:
        """Keyed digests of ``flat[:d]`` for d = first_depth, 2x, 4x, ... <= len(flat),
        shallow first; ``flat`` is `Prompt.flat`.

        A later turn of a conversation extends the earlier prompt, so they share the
        digests up to the earlier prompt's length (within a factor 2): the router
        remembers which replica served a digest and sends the next turn there. Tenants
        never share a digest, and nothing outside the cluster can compute one; gateways
        that share placements over the cluster bus agree on them (docs/spec.md, 7, 11).

        SHA-256 over PREFIX_DOMAIN || lp(k_route) || lp(model) || lp(salt) || flat[:d], in
        one pass finished on a copy at each depth. Keyed by prefixing the route sub-key:
        without it no digest can be tested against a guess, and the length extension that
        HMAC guards against yields only digests of strings with SHA-256 padding inside,
        which say nothing about the prompt; HMAC would double the cost (its finish on a
        copy runs two hashes per depth).
        """
        if first_depth <= 0:
            raise ValueError("first_depth must be positive")
        running = self._prefix.copy()
        digests: list[PrefixDigest] = []
        done = 0
        depth = first_depth
        while depth <= len(flat):
            running.update(flat[done:depth])
            done = depth
            digests.append(PrefixDigest(running.copy().digest()))
            depth *= 2
        return digests
