"""parse_body: one JSON object, nothing two parsers could read differently."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from saltgate.policy.errors import ApiError
from saltgate.policy.request import MAX_JSON_DEPTH, parse_body

pytestmark = pytest.mark.unit

CAP = 1 << 20


def refused(raw: bytes, status: int = 400, cap: int = CAP) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_body(raw, cap)
    assert info.value.status == status
    assert len(info.value.message) > 15
    return info.value


def test_accepts_an_object() -> None:
    raw = b' {"model":"m","messages":[{"role":"user","content":"a: b"}],"n":1} \n'
    assert parse_body(raw, CAP).obj == json.loads(raw)


def test_size_cap_is_413() -> None:
    raw = b'{"a":"' + b"x" * 100 + b'"}'
    assert parse_body(raw, len(raw)).obj == {"a": "x" * 100}
    err = refused(raw, 413, cap=len(raw) - 1)
    assert str(len(raw) - 1) in err.message


@pytest.mark.parametrize(
    "raw",
    [
        b"[1,2,3]",
        b'"just a string"',
        b"42",
        b"null",
        b"",
        b"   ",
        b'{"a":1} x',
        b'{"a":1}{"b":2}',
        b'{"a":1},',
        b'{"a":1}\x00',
        b"\xef\xbb\xbf{}",  # BOM
        b"\xff\xfe{}",
        b'{"a":"\xff"}',
        b'{"a":"\xed\xa0\x80"}',  # UTF-8-encoded surrogate
        b'{"a":"\\ud800"}',  # lone high surrogate
        b'{"a":"\\udc00"}',  # lone low surrogate
        b'{"a":NaN}',
        b'{"a":Infinity}',
        b'{"a":-Infinity}',
        b'{"a":1e400}',
        b'{"a":"\x01"}',  # raw control character
        b"{'a':1}",
        b'{"a":1,}',
        b'{"a" 1}',
        b"[" * 2000 + b"]" * 2000,
        b'{"a":' + b"[" * 1100 + b"]" * 1100 + b"}",
    ],
)
def test_refuses_non_objects_and_invalid_json(raw: bytes) -> None:
    refused(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a":18446744073709551616}',
        b'{"a":-9223372036854775809}',
        b'{"a":[1,2,{"b":123456789012345678901234567890}]}',
        b'{"x":"one+two","a":99999999999999999999}',
    ],
)
def test_refuses_integers_beyond_64_bits(raw: bytes) -> None:
    assert refused(raw).code == "integer_out_of_range"


def test_accepts_64_bit_edges_and_big_floats() -> None:
    raw = b'{"a":18446744073709551615,"b":-9223372036854775808,"c":1e300,"d":1.5e+20}'
    obj = parse_body(raw, CAP).obj
    assert obj["a"] == 2**64 - 1 and obj["b"] == -(2**63)
    assert obj["c"] == 1e300 and obj["d"] == 1.5e20


@pytest.mark.parametrize(
    "raw",
    [
        b'{"cache_salt":"a","cache_salt":"b"}',
        b'{"model":"m","prompt":"P","cache_salt":"a","cache_salt":"victim-salt"}',
        b'{"cache_salt":"a","cache\\u005fsalt":"b"}',  # collide only after unescaping
        b'{"\\u0063ache_salt":1,"cache_salt":2}',
        b'{"a":{"b":1,"b":1}}',  # nested, identical values
        b'{"a":[{"x":1},{"y":1,"y":2}]}',  # inside an array
        b'{"k":1,"k":{"a:b":"c:d"}}',  # dropped value full of colons
        b'{"k\\u003ax":1,"k:x":2}',  # escaped colon in a key
        b'{"a":"\\u003a","b":1,"b":2}',  # escaped colon elsewhere masks a count
        b'{"a":"\\u003A\\u003a","z":{"b":1,"b":2},"c":3}',
        b'{"":1,"":2}',
        b'{"\xc3\xa9":1,"\\u00e9":2}',  # raw UTF-8 vs escape
        b'{"\xf0\x9f\x98\x80":1,"\\ud83d\\ude00":2}',  # astral, raw vs surrogate pair
    ],
)
def test_refuses_duplicate_keys_at_any_depth(raw: bytes) -> None:
    assert refused(raw).code == "duplicate_key"


def test_duplicate_message_names_the_key_but_truncates_it() -> None:
    assert "'cache_salt'" in refused(b'{"cache_salt":1,"cache_salt":2}').message
    long_key = "k" * 500
    raw = json.dumps({long_key: 1})[:-1].encode() + b"," + json.dumps({long_key: 2})[1:].encode()
    assert len(refused(raw).message) < 250


def test_escaped_colons_without_duplicates_are_fine() -> None:
    raw = b'{"a":"\\u003a\\u003A","b":{"c:d":"e\\u003af"}}'
    assert parse_body(raw, CAP).obj == {"a": "::", "b": {"c:d": "e:f"}}


# -- property: random documents, random duplicates ----------------------------------------


class Gen:
    """Random JSON-ish documents with awkward keys and strings (no hypothesis here)."""

    KEY_CHARS = 'ab:é漢😀"\\/\n'

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def key(self) -> str:
        return "".join(self.rng.choice(self.KEY_CHARS) for _ in range(self.rng.randint(0, 3)))

    def value(self, depth: int) -> Any:
        r = self.rng.random()
        if depth > 3 or r < 0.4:
            return self.rng.choice(
                [
                    None,
                    True,
                    False,
                    self.rng.randint(-(2**63), 2**64 - 1),
                    self.rng.randint(-100, 100),
                    self.rng.random() * 10 ** self.rng.randint(-20, 25),
                    self.key() * self.rng.randint(0, 4),
                ]
            )
        if r < 0.7:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        return {self.key(): self.value(depth + 1) for _ in range(self.rng.randint(0, 4))}

    def encode_str(self, s: str) -> str:
        """A JSON string literal, each character randomly escaped or raw."""
        out = ['"']
        for ch in s:
            if ch in '"\\' or ord(ch) < 0x20 or self.rng.random() < 0.3:
                if ord(ch) > 0xFFFF:
                    hi, lo = divmod(ord(ch) - 0x10000, 0x400)
                    out.append(f"\\u{0xD800 + hi:04x}\\u{0xDC00 + lo:04X}")
                else:
                    out.append(f"\\u{ord(ch):04{self.rng.choice('xX')}}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)

    def encode(self, v: Any, dup: list[int]) -> str:
        """Serialise; while dup[0] > 0, maybe repeat one key of an object (a duplicate)."""
        ws = self.rng.choice(["", " ", "\n  "])
        if isinstance(v, dict):
            items = [(self.encode_str(k), self.encode(x, dup)) for k, x in v.items()]
            if items and dup[0] > 0 and self.rng.random() < 0.5:
                k = self.rng.choice(list(v))
                items.insert(self.rng.randint(0, len(items)), (self.encode_str(k), "0"))
                dup[0] -= 1
            return "{" + ws + ",".join(f"{k}{ws}:{ws}{x}" for k, x in items) + "}"
        if isinstance(v, list):
            return "[" + ",".join(self.encode(x, dup) for x in v) + ws + "]"
        if isinstance(v, str):
            return self.encode_str(v)
        return json.dumps(v)


def test_random_documents_parse_like_the_stdlib() -> None:
    for seed in range(400):
        gen = Gen(seed)
        doc = {gen.key() + str(i): gen.value(0) for i in range(gen.rng.randint(1, 6))}
        raw = gen.encode(doc, [0]).encode()
        assert parse_body(raw, CAP).obj == json.loads(raw)


def test_random_duplicates_never_slip_through() -> None:
    caught = 0
    for seed in range(1500):
        gen = Gen(10_000 + seed)
        doc = {gen.key() + str(i): gen.value(0) for i in range(gen.rng.randint(1, 6))}
        dup = [1]
        raw = gen.encode(doc, dup).encode()
        if dup[0] == 1:
            continue  # the generator placed no duplicate this time
        with pytest.raises(ApiError) as info:
            parse_body(raw, CAP)
        assert info.value.code == "duplicate_key", raw
        caught += 1
    assert caught > 500


def test_the_fast_path_answers_the_document_it_was_given() -> None:
    """Checked against the document itself, not orjson, which the fast path is."""
    doc = {"a": [1, 2.5, "x:y", {"b": None}], "c": "ü"}
    assert parse_body(json.dumps(doc).encode(), CAP).obj == doc


def _nested(depth: int, shape: str) -> bytes:
    """A body ``depth`` levels deep, counting the outermost object."""
    inner = depth - 1
    if shape == "arrays":
        return b'{"model":"m","metadata":' + b"[" * inner + b"1" + b"]" * inner + b"}"
    return b'{"model":"m","metadata":' + b'{"a":' * inner + b"1" + b"}" * inner + b"}"


@pytest.mark.parametrize("shape", ["arrays", "objects"])
def test_one_depth_limit_holds_at_every_depth(shape: str) -> None:
    """Depths 1 to 20,000: up to MAX_JSON_DEPTH parses, deeper is one clear 400 (no other
    error, at no depth: 255 to 1,024 used to raise from the re-serialisation, a 500)."""
    for depth in range(1, 20_001):
        raw = _nested(depth, shape)
        if depth <= MAX_JSON_DEPTH:
            assert parse_body(raw, CAP).obj["model"] == "m"
            continue
        with pytest.raises(ApiError) as info:
            parse_body(raw, CAP)
        assert (info.value.status, info.value.code) == (400, "json_too_deep"), depth
        assert str(MAX_JSON_DEPTH) in info.value.message
