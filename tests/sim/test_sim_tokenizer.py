"""The simulator's tokenizer: determinism, the documented rules, chat layout, filler."""

from __future__ import annotations

import random
import zlib

import pytest

from saltgate.sim import tokenizer as tok

pytestmark = pytest.mark.unit


def piece_id(piece: str) -> int:
    return tok.RESERVED + zlib.crc32(piece.encode("utf-8")) % (tok.VOCAB_SIZE - tok.RESERVED)


def test_pieces_follow_the_documented_rules() -> None:
    text = "Hello, tokenizer_v2 splits 1234567 numbers.\n\n  def f(x): return x**2 "
    assert tok.pieces(text) == [
        "Hello", ",", " tokeni", "zer", "_", "v", "2", " splits", " 123", "456", "7",
        " number", "s", ".", "\n\n ", " def", " f", "(", "x", "):", " return", " x",
        "**", "2", " ",
    ]  # fmt: skip


def test_ids_are_crc32_of_pieces_and_deterministic() -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.tokenize(text)
    assert ids == [piece_id(p) for p in tok.pieces(text)]
    assert all(tok.RESERVED <= i < tok.VOCAB_SIZE for i in ids)
    assert tok.tokenize(text) == ids
    assert tok.tokenize(text, add_bos=True) == [tok.BOS, *ids]


def test_pieces_join_back_to_any_text() -> None:
    rng = random.Random(1)
    alphabet = "ab Z9_.,;\n\t  é日\u0301😀\u00a0\u2028"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert "".join(tok.pieces(text)) == text
        assert len(tok.tokenize(text)) == len(tok.pieces(text))


def test_lone_surrogate_does_not_crash() -> None:
    assert len(tok.tokenize("a\ud800b")) == 3


def test_about_four_chars_per_token() -> None:
    english = (
        "Prefix caching lets a server reuse the attention state of a prompt that it has "
        "already seen, so a second request with the same system prompt starts faster. "
    ) * 50
    ratio = len(english) / len(tok.tokenize(english))
    assert 3.3 < ratio < 5.0


def test_memoised_text_returns_a_fresh_list() -> None:
    text = "cached text " * 200
    first = tok.tokenize(text)
    first.append(-1)
    assert tok.tokenize(text)[-1] != -1
    assert tok.tokenize(text) == first[:-1]


def test_chat_template_layout() -> None:
    msgs: list[dict[str, object]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
        },
    ]
    ids = tok.apply_chat_template(msgs)
    assert ids == [
        tok.BOS,
        tok.SYSTEM, *tok.tokenize("Be brief."), tok.END_OF_TURN,
        tok.USER, *tok.tokenize("Hi\nthere"), tok.END_OF_TURN,
        tok.ASSISTANT,
    ]  # fmt: skip
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == ids[:-1]


def test_chat_template_all_roles_and_tool_calls() -> None:
    msgs: list[dict[str, object]] = [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get", "arguments": '{"a":1}'}}],
        },
        {"role": "tool", "content": "42"},
    ]
    ids = tok.apply_chat_template(msgs)
    assert ids[:4] == [tok.BOS, tok.DEVELOPER, *tok.tokenize("d"), tok.END_OF_TURN]
    call = tok.tokenize('get({"a":1})')
    i = ids.index(tok.ASSISTANT)
    assert ids[i + 1 : i + 1 + len(call)] == call
    assert ids[-1] == tok.ASSISTANT
    assert tok.TOOL in ids


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "wizard", "content": "x"}], "expected one of system"),
        ([{"content": "x"}], "role is None"),
        ([{"role": "user", "content": 5}], "must be a string or a list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text parts"),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text must be a string"),
        ([{"role": "user", "content": ["hi"]}], "content[0]"),
        ([{"role": "user"}], "content is missing"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "tool_calls[0]"),
        (["not a dict"], "messages[0]"),
        ([], "non-empty"),
    ],
)
def test_chat_template_errors_are_actionable(messages: list[object], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        tok.apply_chat_template(messages)  # type: ignore[arg-type]
    assert needle in str(info.value)


def test_filler_retokenises_exactly() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n, seed = rng.randint(0, 300), rng.randint(0, 2**31)
        ids, text = tok.filler(n, seed)
        assert len(ids) == n
        assert tok.tokenize(text) == ids


def test_filler_is_deterministic_and_seeded() -> None:
    assert tok.filler(50, 1) == tok.filler(50, 1)
    assert tok.filler(50, 1) != tok.filler(50, 2)
    ids, pieces = tok.filler_pieces(24, 9)
    assert pieces[11] == "." and pieces[12][1].isupper() and pieces[0][0].isupper()
    assert [tok.tokenize(p) for p in pieces[1:]] == [[i] for i in ids[1:]]
    assert tok.filler(0, 5) == ([], "")
    with pytest.raises(ValueError):
        tok.filler(-1, 0)


def test_filler_words_are_single_pieces() -> None:
    assert len(tok.FILLER_WORDS) == 60
    for word in tok.FILLER_WORDS:
        assert tok.pieces(" " + word.capitalize()) == [" " + word.capitalize()]
