"""Content parts (policy/content.py): every route's shape, every refusal, the media uuid."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from saltgate.derivations import media_uuid
from saltgate.policy import content
from saltgate.policy.errors import AnthropicApiError, ApiError
from saltgate.policy.request import inspect, parse_body, prepare

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
SALT_A = "sg1_" + "A" * 43
SALT_B = "sg1_" + "B" * 43
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="
OTHER_PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAE="
WAV = "UklGRiQAAABXQVZF"
METADATA = "http://169.254.169.254/latest/meta-data/"


def chat(*parts: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": list(parts)}], **extra}


def image(url: str | None = PNG, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": None if url is None else {"url": url}, **extra}


def anthropic_image(source: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "image", "source": source, **extra}


def b64_source(data: str = "iVBORw0KGgo=") -> dict[str, str]:
    return {"type": "base64", "media_type": "image/png", "data": data}


def messages(*blocks: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": list(blocks)}],
        **extra,
    }


def forwarded(route: str, body: dict[str, Any], salt: str | None = SALT_A) -> dict[str, Any]:
    parsed = parse_body(orjson.dumps(body), 1 << 24)
    out: dict[str, Any] = orjson.loads(prepare(parsed, inspect(route, parsed.obj), salt))
    return out


def refused(route: str, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        inspect(route, body)
    assert info.value.status == 400
    return info.value


def parts_of(out: dict[str, Any]) -> list[Any]:
    parts: list[Any] = out["messages"][0]["content"]
    return parts


# -- uuids --------------------------------------------------------------------------------


def test_client_uuids_are_dropped_and_the_media_uuid_set() -> None:
    body = chat({"type": "text", "text": "hi", "uuid": "t"}, image(uuid="A's uuid"))
    text, img = parts_of(forwarded(CHAT, body))
    assert text == {"type": "text", "text": "hi"}
    assert img["uuid"] == media_uuid(SALT_A, "image", PNG.encode())
    assert img["uuid"] != "A's uuid"


def test_same_media_same_uuid_within_a_namespace_never_across() -> None:
    body = chat(image(), image())
    first, second = parts_of(forwarded(CHAT, body))
    assert first["uuid"] == second["uuid"]
    (b_part, _) = parts_of(forwarded(CHAT, body, SALT_B))
    assert b_part["uuid"] != first["uuid"]
    (other, _) = parts_of(forwarded(CHAT, chat(image(OTHER_PNG), image())))
    assert other["uuid"] != first["uuid"]


def test_salting_off_sets_no_uuid_but_still_drops_the_client_s() -> None:
    out = forwarded(CHAT, chat(image(uuid="A's uuid"), {"type": "text", "text": "x", "uuid": "u"}))
    out_unsalted = forwarded(CHAT, chat(image(uuid="A's uuid")), salt=None)
    assert "uuid" not in parts_of(out_unsalted)[0]
    assert "cache_salt" not in out_unsalted
    assert "A's uuid" not in orjson.dumps(out).decode()


def test_the_body_given_is_not_changed() -> None:
    body = chat(image(uuid="u"), mm_processor_kwargs={"fps": 1})
    before = copy.deepcopy(body)
    parsed = parse_body(orjson.dumps(body), 1 << 20)
    prepare(parsed, inspect(CHAT, parsed.obj), SALT_A)
    assert parsed.obj == before


def test_a_media_part_is_rebuilt_from_what_vllm_reads() -> None:
    """vLLM reads a part with a uuid by its members (the first it finds), not its type: a
    decoy member must not survive beside the one the uuid is computed over."""
    decoy = {
        "type": "video_url",
        "video_url": {"url": "data:video/mp4;base64,AAAA"},
        "image_url": {"url": OTHER_PNG},
        "image_embeds": "x",
    }
    (part,) = parts_of(forwarded(CHAT, chat(decoy)))
    assert set(part) == {"type", "video_url", "uuid"}
    assert part["uuid"] == media_uuid(SALT_A, "video", b"data:video/mp4;base64,AAAA")


def test_a_part_without_type_is_read_as_vllm_reads_it() -> None:
    (part,) = parts_of(forwarded(CHAT, chat({"image_url": {"url": PNG}, "uuid": "u"})))
    assert part == {
        "type": "image_url",
        "image_url": {"url": PNG},
        "uuid": media_uuid(SALT_A, "image", PNG.encode()),
    }
    refused(CHAT, chat({"image_url": None, "uuid": "u"}))
    refused(CHAT, chat({"text": "no type"}))


def test_same_bytes_as_two_modalities_get_two_uuids() -> None:
    url = "data:application/octet-stream;base64,AAAA"
    img, vid = parts_of(
        forwarded(CHAT, chat(image(url), {"type": "video_url", "video_url": {"url": url}}))
    )
    assert img["uuid"] != vid["uuid"]


def test_detail_is_kept() -> None:
    (part,) = parts_of(
        forwarded(CHAT, chat({"type": "image_url", "image_url": {"url": PNG, "detail": "low"}}))
    )
    assert part["image_url"] == {"url": PNG, "detail": "low"}


def test_input_audio_is_hashed_as_vllm_builds_its_url() -> None:
    part = {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav", "x": 1}}
    (out,) = parts_of(forwarded(CHAT, chat(part)))
    assert out["input_audio"] == {"data": WAV, "format": "wav"}
    assert out["uuid"] == media_uuid(SALT_A, "audio", f"data:audio/wav;base64,{WAV}".encode())


# -- every route's shape --------------------------------------------------------------------


def test_responses_message_items_bare_parts_and_tool_outputs() -> None:
    body = {
        "model": "m",
        "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": PNG, "uuid": "u"}]},
            {"type": "input_image", "image_url": PNG, "uuid": "u"},
            {
                "type": "function_call_output",
                "call_id": "c",
                "output": [{"type": "input_image", "image_url": PNG, "uuid": "u"}],
            },
            {"type": "input_text", "text": "x", "uuid": "u"},  # a bare text part, too
        ],
    }
    out = forwarded(RESPONSES, body)
    want = media_uuid(SALT_A, "image", PNG.encode())
    assert out["input"][0]["content"][0]["uuid"] == want
    assert out["input"][1]["uuid"] == want
    assert out["input"][2]["output"][0]["uuid"] == want
    assert out["input"][2]["call_id"] == "c"
    assert out["input"][3] == {"type": "input_text", "text": "x"}


def test_responses_file_id_only_image_is_missing_media() -> None:
    body = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
    }
    assert refused(RESPONSES, body).param == "input[0].content[0].image_url"


def test_anthropic_blocks_lose_uuids_get_none_and_nested_tool_results_are_walked() -> None:
    body = messages(
        anthropic_image(b64_source(), uuid="A's uuid"),
        {
            "type": "tool_result",
            "tool_use_id": "t",
            "content": [anthropic_image(b64_source(), uuid="u"), {"type": "text", "text": "x"}],
        },
        system=[{"type": "text", "text": "s", "uuid": "u"}],
    )
    out = forwarded(MESSAGES, body)
    blocks = out["messages"][0]["content"]
    assert blocks[0] == anthropic_image(b64_source())  # vLLM would drop a uuid here anyway
    assert blocks[1]["content"][0] == anthropic_image(b64_source())
    assert out["system"] == [{"type": "text", "text": "s"}]


@pytest.mark.parametrize(
    "source",
    [
        None,
        {"type": "base64", "media_type": "image/png"},
        b64_source(""),
        {"type": "file", "file_id": "f"},
    ],
)
def test_anthropic_image_without_data_is_refused_in_anthropic_s_shape(source: Any) -> None:
    error = refused(MESSAGES, messages(anthropic_image(source)))
    assert isinstance(error, AnthropicApiError)
    assert error.param == "messages[0].content[0].source"


def test_nested_tool_result_image_is_checked() -> None:
    block = {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [anthropic_image({"type": "url", "url": "http://127.0.0.1:22/"})],
    }
    error = refused("/v1/messages/count_tokens", messages(block))
    assert error.code == "remote_media_refused"
    assert error.param == "messages[0].content[0].content[0].source"


@pytest.mark.parametrize("route", ["/tokenize", "/v1/embeddings", "/pooling", "/classify"])
def test_chat_shaped_messages_on_other_routes(route: str) -> None:
    (part,) = parts_of(forwarded(route, chat(image(uuid="u"))))
    assert part["uuid"] == media_uuid(SALT_A, "image", PNG.encode())
    refused(route, chat(image(None, uuid="u")))


def test_score_inputs_with_content() -> None:
    body = {"model": "m", "queries": "q", "documents": [{"content": [image(uuid="u")]}]}
    out = forwarded("/score", body)
    assert out["documents"][0]["content"][0]["uuid"] == media_uuid(SALT_A, "image", PNG.encode())
    bad = {"model": "m", "query": {"content": [image(METADATA)]}, "documents": ["d"]}
    assert refused("/rerank", bad).param == "query.content[0].image_url"


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "part",
    [
        image(None, uuid="A's uuid"),
        {"type": "image_url", "image_url": {"url": None}, "uuid": "u"},
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url"},
        {"type": "audio_url", "audio_url": None, "uuid": "u"},
        {"type": "video_url", "video_url": {}, "uuid": "u"},
        {"type": "input_audio", "input_audio": {"format": "wav"}, "uuid": "u"},
        {"type": "input_image", "image_url": None, "uuid": "u"},
    ],
)
def test_null_media_is_refused(part: dict[str, Any]) -> None:
    error = refused(CHAT, chat({"type": "text", "text": "x"}, part))
    assert error.code == "missing_media"
    assert error.param is not None and error.param.startswith("messages[0].content[1].")


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_embeds", "image_embeds": "AAAA"},
        {"type": "audio_embeds", "audio_embeds": {"a": "b"}},
        {"type": "video_embeds", "video_embeds": "AAAA"},
        {"type": "prompt_embeds", "data": "AAAA"},
        {"image_embeds": None, "uuid": "u"},  # no type: vLLM reads the member
    ],
)
def test_embeds_parts_are_refused(part: dict[str, Any]) -> None:
    assert refused(CHAT, chat(part)).code == "embeds_refused"


@pytest.mark.parametrize("route", ["/v1/completions", CHAT, "/tokenize"])
def test_prompt_embeds_field_is_refused(route: str) -> None:
    body = {"model": "m", "prompt": "x", "messages": [], "prompt_embeds": "AAAA"}
    error = refused(route, body)
    assert (error.code, error.param) == ("embeds_refused", "prompt_embeds")
    inspect(route, {**body, "prompt_embeds": None})  # null is absent


@pytest.mark.parametrize(
    "url",
    [
        METADATA,
        "https://example.com/cat.png",
        "HTTP://10.0.0.1/x.png",
        "http://[::1]:8000/x",
    ],
)
def test_remote_media_is_refused_saying_why(url: str) -> None:
    error = refused(CHAT, chat(image(url)))
    assert error.code == "remote_media_refused"
    assert "fetch" in error.message and "data: URL" in error.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://h/x", "x.png", "//h/x"])
def test_other_schemes_are_refused(url: str) -> None:
    assert refused(CHAT, chat(image(url))).code == "invalid_media_url"


def test_anthropic_url_image_is_refused() -> None:
    block = anthropic_image({"type": "url", "url": "http://127.0.0.1:22/"})
    error = refused(MESSAGES, messages(block))
    assert isinstance(error, AnthropicApiError)
    assert error.code == "remote_media_refused"
    assert b'"type":"error"' in error.body()


@pytest.mark.parametrize("kind", ["file", "input_file", "image_pil", "vision_chunk", 7, None])
def test_unknown_part_types_are_refused(kind: Any) -> None:
    part = {"type": kind, "x": 1} if kind is not None else {"x": 1}
    assert refused(CHAT, chat(part)).code == "unsupported_content_part"


def test_unknown_anthropic_block_is_refused() -> None:
    assert refused(MESSAGES, messages({"type": "document", "source": {}})).code == (
        "unsupported_content_part"
    )


def test_media_cap() -> None:
    at_cap = chat(*[image() for _ in range(content.MAX_MEDIA_ITEMS)])
    assert content.check(CHAT, at_cap).media == content.MAX_MEDIA_ITEMS
    over = {**at_cap, "messages": [*at_cap["messages"], {"role": "user", "content": [image()]}]}
    assert refused(CHAT, over).code == "too_many_media_items"
    nested = messages(
        *[anthropic_image(b64_source()) for _ in range(content.MAX_MEDIA_ITEMS)],
        {"type": "tool_result", "tool_use_id": "t", "content": [anthropic_image(b64_source())]},
    )
    assert refused(MESSAGES, nested).code == "too_many_media_items"


@pytest.mark.parametrize("name", sorted(content.MM_STRIPPED_FIELDS))
def test_mm_kwargs_are_stripped(name: str) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "x"}],
        name: {"num_frames": 10**6},
    }
    out = forwarded(CHAT, body)
    assert name not in out
    assert out["cache_salt"] == SALT_A


# -- the fast path and the fetcher's API --------------------------------------------------------


def test_text_bodies_are_not_rewritten() -> None:
    text = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
    }
    assert content.check(CHAT, text) == content.NO_CONTENT
    plain = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert content.check(CHAT, plain) == content.NO_CONTENT
    parsed = parse_body(orjson.dumps(plain), 1 << 20)
    assert inspect(CHAT, parsed.obj).content_rewrite is False
    assert prepare(parsed, inspect(CHAT, parsed.obj), None) == parsed.serialized


def test_remote_media_lists_every_remote_reference_in_body_order() -> None:
    body = chat(
        image("https://a/x.png"), image(), {"type": "video_url", "video_url": {"url": "http://b/v"}}
    )
    found = content.remote_media(CHAT, body)
    assert found == [
        content.RemoteMedia("messages[0].content[0].image_url", "https://a/x.png", "image"),
        content.RemoteMedia("messages[0].content[2].video_url", "http://b/v", "video"),
    ]
    anthropic = messages(anthropic_image({"type": "url", "url": "https://c/y.jpg"}))
    assert content.remote_media(MESSAGES, anthropic)[0].url == "https://c/y.jpg"
    with pytest.raises(ApiError):  # what no fetch can fix is refused first
        content.remote_media(CHAT, chat(image(None, uuid="u")))


def test_inline_media_replaces_the_given_references() -> None:
    body = chat(image("https://a/x.png", uuid="u"), image("https://a/other.png"))
    out = content.inline_media(CHAT, copy.deepcopy(body), {"https://a/x.png": PNG})
    assert parts_of(out)[0]["image_url"] == {"url": PNG}
    assert parts_of(out)[1]["image_url"] == {"url": "https://a/other.png"}
    with pytest.raises(ApiError):  # the one left is still refused
        inspect(CHAT, out)
    done = content.inline_media(CHAT, out, {"https://a/other.png": OTHER_PNG})
    assert content.check(CHAT, done).media == 2
    anthropic = messages(anthropic_image({"type": "url", "url": "https://c/y.jpg"}))
    inlined = content.inline_media(
        MESSAGES, anthropic, {"https://c/y.jpg": "data:image/jpeg;base64,QUJD"}
    )
    assert inlined["messages"][0]["content"][0]["source"] == {
        "type": "base64",
        "media_type": "image/jpeg",
        "data": "QUJD",
    }
    responses = {"model": "m", "input": [{"type": "input_image", "image_url": "https://a/x.png"}]}
    assert (
        content.inline_media(RESPONSES, responses, {"https://a/x.png": PNG})["input"][0][
            "image_url"
        ]
        == PNG
    )
