r"""The simulator's tokenizer. This docstring is its specification.

Goal: deterministic, dependency-free, reproducible in any language, and about 4 characters
per token on English and code, like a BPE, so token counts (and thus block counts, cache
hits and timings) look realistic. Measured: 3.97 chars/token on the GPL-3 text, 3.85 on
CPython's stdlib sources.

Vocabulary: ``VOCAB_SIZE`` = 32000 ids. Ids 0..15 are reserved::

    0 PAD   1 BOS   2 EOS   3 <|system|>   4 <|developer|>   5 <|user|>
    6 <|assistant|>   7 <|tool|>   8 <|end|> (end of turn)   9..15 unused

Pre-tokenisation: the text is cut into pieces by the first matching alternative, scanning
left to right (Python ``re``, Unicode-aware; "letter" = ``[^\W\d_]``, "digit" = ``\d``,
"symbol" = ``[^\w\s]`` or "_")::

    1. " "? letter{1,6}     an optional single U+0020 space, then 1-6 letters (greedy)
    2. " "? digit{1,3}      an optional space, then 1-3 digits
    3. " "? symbol{1,3}     an optional space, then 1-3 symbols (punctuation, "_", emoji)
    4. \s+(?!\S)            a whitespace run not followed by a non-space char
                            (so the last space before a word joins that word)
    5. \s+                  any other whitespace run (e.g. "\n" before a word)

The pieces concatenate back to the text exactly. A word longer than 6 letters is several
pieces: " tokenizer" -> " tokeni", "zer".

Piece to id: ``RESERVED + zlib.crc32(piece.encode("utf-8")) % (VOCAB_SIZE - RESERVED)``
(lone surrogates are encoded as Python's "surrogatepass" does)
with RESERVED = 16. Different pieces may share an id, as they would in a small vocabulary;
the mapping is not invertible and does not need to be.

Chat template (:func:`apply_chat_template`)::

    BOS, then per message: role marker, tokenize(content), <|end|>;
    then <|assistant|> (the generation prompt) unless add_generation_prompt=False.

Roles: system, developer, user, assistant, tool. Content: a string; or a list of parts,
where each part is ``{"type": "text", "text": str}`` and the texts are joined with "\n"
(as vLLM flattens text parts); or None/absent for an assistant message that carries
``tool_calls``. Each tool call ``{"function": {"name": n, "arguments": a}}`` adds
``tokenize(n + "(" + a + ")")`` after the content. Anything else raises ValueError.

Filler (:func:`filler`): n tokens of generated "output". Piece i (i = 0..n-1) is "." when
i % 12 == 11; otherwise the word ``FILLER_WORDS[zlib.crc32(f"{seed}:{i}".encode()) %
len(FILLER_WORDS)]``, capitalised when i == 0 or piece i-1 is ".", and prefixed by one
space unless i == 0. Every word has 1-6 ASCII letters, so each piece is exactly one token
and ``tokenize(text) == ids`` holds.

Decoding (:func:`decode`, what /detokenize answers): the tokenizer is not invertible, so
only ids with one known piece decode to text: each filler piece (any word of
``FILLER_WORDS``, plain or capitalised, with or without its leading space, and ".") gives
that piece, so generated text round-trips. Reserved ids decode to nothing (special tokens
are skipped), as do ids outside the vocabulary; any other id gives U+FFFD.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from functools import lru_cache

__all__ = [
    "ASSISTANT",
    "BOS",
    "DEVELOPER",
    "END_OF_TURN",
    "EOS",
    "FILLER_WORDS",
    "PAD",
    "RESERVED",
    "ROLE_MARKERS",
    "SYSTEM",
    "TOOL",
    "USER",
    "VOCAB_SIZE",
    "apply_chat_template",
    "decode",
    "filler",
    "filler_pieces",
    "pieces",
    "tokenize",
]

VOCAB_SIZE = 32000
RESERVED = 16
PAD, BOS, EOS = 0, 1, 2
SYSTEM, DEVELOPER, USER, ASSISTANT, TOOL, END_OF_TURN = 3, 4, 5, 6, 7, 8

ROLE_MARKERS: Mapping[str, int] = {
    "system": SYSTEM,
    "developer": DEVELOPER,
    "user": USER,
    "assistant": ASSISTANT,
    "tool": TOOL,
}

_PIECE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?(?:[^\w\s]|_){1,3}|\s+(?!\S)|\s+")

_SPAN = VOCAB_SIZE - RESERVED
_CACHE_LIMIT = 1 << 17
_cache: dict[str, int] = {}
_MEMO_MIN, _MEMO_MAX = 1024, 128 * 1024


def _piece_id(piece: str) -> int:
    return RESERVED + zlib.crc32(piece.encode("utf-8", "surrogatepass")) % _SPAN


def pieces(text: str) -> list[str]:
    """The pre-tokenised pieces of ``text`` (they join back to ``text``)."""
    return _PIECE.findall(text)


def _tokenize_uncached(text: str) -> list[int]:
    cache = _cache
    if len(cache) > _CACHE_LIMIT:  # bounded: adversarial text cannot grow it forever
        cache.clear()
    out: list[int] = []
    get = cache.get
    for piece in _PIECE.findall(text):
        tid = get(piece)
        if tid is None:
            tid = cache[piece] = _piece_id(piece)
        out.append(tid)
    return out


@lru_cache(maxsize=64)
def _tokenize_cached(text: str) -> tuple[int, ...]:
    return tuple(_tokenize_uncached(text))


def tokenize(text: str, add_bos: bool = False) -> list[int]:
    """Token ids of ``text``; ``add_bos`` prepends BOS as a Llama tokenizer does for prompts.

    Texts of 1-128 KB are memoised (64 of them): system prompts and earlier chat turns
    repeat across requests, and a repeat then costs a dict lookup instead of a regex pass.
    """
    if _MEMO_MIN <= len(text) <= _MEMO_MAX:
        ids = list(_tokenize_cached(text))
    else:
        ids = _tokenize_uncached(text)
    if add_bos:
        ids.insert(0, BOS)
    return ids


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise ValueError(f"{where}.content[{j}] must be an object with a 'type'")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"{where}.content[{j}] has type {kind!r}; this model accepts only "
                    "text parts ({'type': 'text', 'text': '...'})"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}.content[{j}].text must be a string")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _tool_calls_text(calls: object, where: str) -> list[str]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out: list[str] = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments", "") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not isinstance(args, str):
            raise ValueError(
                f"{where}.tool_calls[{j}] must be {{'function': {{'name': str, 'arguments': str}}}}"
            )
        out.append(f"{name}({args})")
    return out


def apply_chat_template(
    messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a chat, laid out as the module docstring specifies."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    out = [BOS]
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = msg.get("role")
        marker = ROLE_MARKERS.get(role) if isinstance(role, str) else None
        if marker is None:
            raise ValueError(f"{where}.role is {role!r}; expected one of {', '.join(ROLE_MARKERS)}")
        out.append(marker)
        content = msg.get("content")
        calls = msg.get("tool_calls")
        if content is None and not (role == "assistant" and calls):
            raise ValueError(
                f"{where}.content is missing (only an assistant message "
                "with tool_calls may omit it)"
            )
        if content is not None:
            out.extend(tokenize(_content_text(content, where)))
        if calls is not None:
            for call_text in _tool_calls_text(calls, where):
                out.extend(tokenize(call_text))
        out.append(END_OF_TURN)
    if add_generation_prompt:
        out.append(ASSISTANT)
    return out


FILLER_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on",
    "with", "as", "was", "at", "by", "this", "from", "or", "an", "be",
    "are", "but", "not", "have", "we", "can", "all", "one", "time", "new",
    "data", "each", "more", "when", "will", "into", "some", "what", "very", "also",
    "cache", "salt", "token", "block", "hit", "miss", "fast", "slow", "key", "node",
    "load", "path", "road", "tree", "leaf", "rain", "wind", "blue", "gold", "warm",
)  # fmt: skip
"""60 words of 1-6 ASCII letters: each, with or without a leading space, is one piece."""


def filler_pieces(n: int, seed: int) -> tuple[list[int], list[str]]:
    """``n`` filler tokens and the text of each (their concatenation re-tokenises to ids)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    texts: list[str] = []
    prev_dot = True
    nwords = len(FILLER_WORDS)
    for i in range(n):
        if i % 12 == 11:
            piece = "."
            prev_dot = True
        else:
            word = FILLER_WORDS[zlib.crc32(f"{seed}:{i}".encode()) % nwords]
            if prev_dot:
                word = word.capitalize()
            piece = word if i == 0 else " " + word
            prev_dot = False
        texts.append(piece)
    ids = [_cache.get(p) or _piece_id(p) for p in texts]
    return ids, texts


def filler(n: int, seed: int) -> tuple[list[int], str]:
    """``n`` filler tokens and their text; ``tokenize(text) == ids``."""
    ids, texts = filler_pieces(n, seed)
    return ids, "".join(texts)


@lru_cache(maxsize=1)
def _filler_table() -> dict[int, str]:
    table: dict[int, str] = {_piece_id("."): "."}
    for word in FILLER_WORDS:
        for form in (word, word.capitalize()):
            table[_piece_id(form)] = form
            table[_piece_id(" " + form)] = " " + form
    return table


def decode(ids: Sequence[int]) -> str:
    """The text of ``ids`` as the module docstring specifies (exact for filler output)."""
    table = _filler_table()
    return "".join(table.get(i, "\ufffd") for i in ids if RESERVED <= i < VOCAB_SIZE)
