"""What vLLM 0.32's own code reads from the parts the gateway forwards (`pytest -m vllm`).

No multimodal model runs here (docs/multimodal.md says why); this checks the two claims
the media uuid rests on, with vLLM's request models and its content-part parser, in the
vLLM venv: the uuid the gateway sets survives the chat, Responses and tokenize request
models (and is dropped by the Anthropic one, as docs/multimodal.md says), and vLLM's
parser, which reads a part with a uuid by its members, reads from each rebuilt part
exactly the URL the uuid was computed over.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import orjson
import pytest
from tests.conformance.fleet import VLLM_DIR

from saltgate.derivations import media_uuid
from saltgate.policy.request import inspect, parse_body, prepare

pytestmark = pytest.mark.vllm

SALT = "sg1_" + "Q" * 43
PNG = "data:image/png;base64,iVBORw0KGgo="
WAV = "UklGRiQAAABXQVZF"
DECOY = {"image_url": {"url": "data:image/png;base64,ZGVjb3k="}, "uuid": "client"}

# Run by the vLLM venv's python: validate each body with the route's request model, then
# parse each part that kept a uuid with vLLM's own content-part parser.
PROBE = """
import json, sys
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest
from vllm.renderers.chat_utils import _parse_chat_message_content_mm_part as parse

MODELS = {"chat": ChatCompletionRequest, "responses": ResponsesRequest,
          "tokenize": TokenizeChatRequest, "messages": AnthropicMessagesRequest}
out = {}
for name, body in json.loads(sys.stdin.read()).items():
    request = MODELS[name].model_validate(body).model_dump(mode="json")
    items = request.get("messages") or request.get("input")
    parts = []
    for item in items:
        for member in ("content", "output"):
            value = item.get(member)
            if isinstance(value, list):
                parts += value
    out[name] = [
        {"uuid": p.get("uuid"), "read": list(parse(p)) if p.get("uuid") else None}
        for p in parts
    ]
print(json.dumps(out))
"""


def _forwarded(route: str, body: dict[str, Any]) -> dict[str, Any]:
    parsed = parse_body(orjson.dumps(body), 1 << 20)
    out: dict[str, Any] = orjson.loads(prepare(parsed, inspect(route, parsed.obj), SALT))
    return out


def test_vllm_reads_the_uuid_and_the_url_it_was_computed_over() -> None:
    python = VLLM_DIR / "venv" / "bin" / "python"
    if not python.exists():
        pytest.fail(f"real vLLM is not built: {python} is missing. Run `make vllm-env`.")
    chat_parts = [
        {"type": "image_url", "image_url": {"url": PNG}, "uuid": "client"},
        {"type": "video_url", "video_url": {"url": PNG}, **DECOY},
        {"type": "input_audio", "input_audio": {"data": WAV, "format": "wav"}},
    ]
    image = {"type": "input_image", "image_url": PNG, "uuid": "client"}
    bodies = {
        "chat": _forwarded(
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": chat_parts}]},
        ),
        "tokenize": _forwarded(
            "/tokenize", {"model": "m", "messages": [{"role": "user", "content": chat_parts}]}
        ),
        "responses": _forwarded(
            "/v1/responses",
            {
                "model": "m",
                "input": [
                    {"role": "user", "content": [image]},
                    {"type": "function_call_output", "call_id": "c", "output": [image]},
                ],
            },
        ),
        "messages": _forwarded(
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "AA==",
                                },
                                "uuid": "client",
                            }
                        ],
                    }
                ],
            },
        ),
    }
    done = subprocess.run(
        [str(python), "-c", PROBE],
        input=json.dumps(bodies).encode(),
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    seen = json.loads(done.stdout.decode().strip().splitlines()[-1])
    image_uuid = media_uuid(SALT, "image", PNG.encode())
    wav_url = f"data:audio/wav;base64,{WAV}"
    chat_want = [
        {"uuid": image_uuid, "read": ["image_url", PNG]},
        {"uuid": media_uuid(SALT, "video", PNG.encode()), "read": ["video_url", PNG]},
        {
            "uuid": media_uuid(SALT, "audio", wav_url.encode()),
            "read": ["input_audio", {"data": WAV, "format": "wav"}],
        },
    ]
    assert seen["chat"] == chat_want
    assert seen["tokenize"] == chat_want
    assert seen["responses"] == [{"uuid": image_uuid, "read": ["image_url", PNG]}] * 2
    assert seen["messages"] == [{"uuid": None, "read": None}]  # vLLM drops a block's uuid
