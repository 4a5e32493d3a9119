"""The simulator's unsafe settings (saltgate.sim.unsafe) beyond what the audit's probes
touch: fetched media reaches the multimodal caches, a torch file passes as prompt_embeds,
the store answers unknown ids as vLLM does, and nothing changes with every switch off."""

from __future__ import annotations

import asyncio
import base64

from tests.support.completions import SIM_MODEL as MODEL
from tests.support.sim import run, sim

from saltgate.audit.deployment import parse_counter
from saltgate.sim.unsafe import UnsafeOptions

IMAGE = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4


async def serve_image() -> tuple[asyncio.Server, str, list[str]]:
    """A one-route HTTP server with IMAGE at /img.png; returns it, its URL and the paths seen."""
    seen: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        seen.append(head.split(b" ")[1].decode())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\n")
        writer.write(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(IMAGE) + IMAGE)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/img.png", seen


def chat_with(url: str) -> dict[str, object]:
    part = {"type": "image_url", "image_url": {"url": url}}
    content = [part, {"type": "text", "text": "what is this?"}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


def test_fetched_media_is_processed_like_inlined_media() -> None:
    """With fetch_media the URL is fetched and its bytes go through the media caches: the
    same request again hits them, and the same bytes inlined as data: hit them too."""

    async def main() -> None:
        server, url, seen = await serve_image()
        try:
            async with sim(unsafe=UnsafeOptions(fetch_media=True)) as (running, client):
                first = await client.post("/v1/chat/completions", json=chat_with(url))
                assert first.status_code == 200, first.text
                inline = "data:image/png;base64," + base64.b64encode(IMAGE).decode()
                again = await client.post("/v1/chat/completions", json=chat_with(inline))
                assert again.status_code == 200, again.text
                metrics = running.server.metrics().decode()
                assert parse_counter(metrics, "vllm:mm_cache_hits_total") == 1.0
                assert seen == ["/img.png"]
            async with sim() as (_, client):  # switch off: the simulator fetches nothing
                refused = await client.post("/v1/chat/completions", json=chat_with(url))
                assert refused.status_code == 400 and seen == ["/img.png"]
        finally:
            server.close()
            await server.wait_closed()

    run(main)


def test_prompt_embeds_take_a_torch_file_and_the_store_answers_unknown_ids() -> None:
    async def main() -> None:
        options = UnsafeOptions(prompt_embeds=True, responses_store=True, runtime_lora=True)
        async with sim(unsafe=options) as (_, client):
            torch_file = base64.b64encode(b"PK\x03\x04 a zip, as torch.save writes").decode()
            body = {"model": MODEL, "prompt_embeds": torch_file, "max_tokens": 1}
            taken = await client.post("/v1/completions", json=body)
            assert taken.status_code == 200, taken.text
            unknown = await client.get("/v1/responses/resp_0123456789abcdef")
            assert unknown.status_code == 404
            assert unknown.json()["error"]["message"] == (
                "Response with id 'resp_0123456789abcdef' not found."
            )
            assert (await client.get("/v1/load_lora_adapter")).status_code == 405
        async with sim() as (_, client):
            body = {"model": MODEL, "prompt_embeds": torch_file, "max_tokens": 1}
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 400 and "--enable-prompt-embeds" in refused.text
            assert (await client.get("/v1/load_lora_adapter")).status_code == 404

    run(main)
