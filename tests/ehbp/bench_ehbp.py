"""Measure what EHBP costs per request (not a test; run by hand, results in docs/benchmarks.md).

    PYTHONPATH=. .venv/bin/python tests/ehbp/bench_ehbp.py [--rounds 40] [--e2e 150]

Part 1, the crypto alone (microseconds, minimum over interleaved rounds): a ~4.4 KB chat
body (the same generator as tests/policy/bench_parse.py) sealed by the client and opened
by the gateway, and the answer sealed by the gateway and opened by the client: a
streamed chat answer of 19 SSE events (role, 16 tokens, usage, [DONE]: the
gateway-overhead streaming scenario) and a ~1 KB JSON answer. Part 2, end to end over
loopback: a real stack (one simulated replica with zero compute), streamed completions
of 16 tokens, plaintext vs sealed (the tinfoil-ehbp transport, and saltgate's own, which
also splices a user_cache_secret in), interleaved; median and p90 of the whole exchange.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import ehbp
from tests.gateway.stack import MODEL, stack
from tests.policy.bench_parse import chat_body
from tests.support.http import async_client

from saltgate.client.transport import AsyncSaltgateTransport
from saltgate.ehbp.frames import (
    KEYS_PATH,
    PUBLIC_KEY_BYTES,
    RESPONSE_NONCE_BYTES,
    ServerKey,
    parse_hex_field,
    seal_request,
)
from saltgate.sim.run import SimConfig

STREAM_TOKENS = 16


def sse_events() -> list[bytes]:
    """A chat stream as the gateway relays it: role, 16 tokens, usage, [DONE]."""
    base = {"id": "chatcmpl-" + "a" * 32, "object": "chat.completion.chunk", "model": MODEL}
    events: list[dict[str, object]] = [
        {**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
    ]
    events += [
        {**base, "choices": [{"index": 0, "delta": {"content": f" tok{i}"}}]}
        for i in range(STREAM_TOKENS)
    ]
    events.append(
        {**base, "choices": [], "usage": {"prompt_tokens": 1100, "completion_tokens": 16}}
    )
    return [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def measure(cases: dict[str, Callable[[], object]], rounds: int, number: int) -> dict[str, float]:
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, fn in cases.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def crypto(rounds: int) -> None:
    key = ServerKey.generate()
    body = json.dumps(chat_body(random.Random(7), 6, 500)).encode()
    events = sse_events()
    answer = json.dumps({"choices": [{"text": "x" * 700}], "usage": {"prompt_tokens": 1}}).encode()
    sealed = seal_request(key.config, body)
    enc_hex = sealed.enc.hex()
    identity = ehbp.ServerIdentity.unmarshal_public_config(key.config.encode())

    def gateway_open() -> object:
        enc = parse_hex_field(enc_hex, PUBLIC_KEY_BYTES, "enc")
        return key.open_request(enc, sealed.body)

    opened_request = key.open_request(sealed.enc, sealed.body)

    def gateway_seal_stream() -> list[bytes]:
        sealer = opened_request.response_sealer(os.urandom(RESPONSE_NONCE_BYTES))
        return [sealer.seal(e) for e in events]

    def gateway_seal_json() -> bytes:
        return opened_request.response_sealer(os.urandom(RESPONSE_NONCE_BYTES)).seal(answer)

    nonce = os.urandom(RESPONSE_NONCE_BYTES)
    sealer = opened_request.response_sealer(nonce)
    stream_wire = [sealer.seal(e) for e in events]

    def client_open_stream() -> list[bytes]:
        opener = sealed.response_opener(nonce)
        return [p for f in stream_wire for p in opener.push(f)]

    tinfoil = identity.encrypt_request_body(body)
    tinfoil_sealer = key.open_request(tinfoil.encapsulated_key, tinfoil.body).response_sealer(nonce)
    tinfoil_wire = b"".join(tinfoil_sealer.seal(e) for e in events)

    cases: dict[str, Callable[[], object]] = {
        "gateway: open 4.4 KB request": gateway_open,
        "gateway: seal streamed answer (19 events)": gateway_seal_stream,
        "gateway: seal 1 KB JSON answer": gateway_seal_json,
        "client (saltgate): seal 4.4 KB request": lambda: seal_request(key.config, body),
        "client (saltgate): open streamed answer": client_open_stream,
        "client (tinfoil-ehbp): seal 4.4 KB request": lambda: identity.encrypt_request_body(body),
        "client (tinfoil-ehbp): open streamed answer": lambda: tinfoil.token.decrypt_response_body(
            nonce, tinfoil_wire
        ),
    }
    best = measure(cases, rounds, 100)
    print(f"body {len(body)} bytes; {len(events)} SSE events, {sum(map(len, events))} bytes")
    print(f"{'us per request (min over ' + str(rounds) + ' rounds)':<48}")
    for name, us in best.items():
        print(f"  {name:<46} {us:8.1f}")
    gateway = (
        best["gateway: open 4.4 KB request"] + best["gateway: seal streamed answer (19 events)"]
    )
    print(f"  {'gateway total, streamed request':<46} {gateway:8.1f}")


async def end_to_end(requests: int) -> None:
    sim = SimConfig(port=0, prefill_ms_per_1k_tokens=0, decode_ms_per_token=0)
    with tempfile.TemporaryDirectory() as tmp:
        async with stack(Path(tmp), replicas=1, sim=sim) as s:
            async with async_client() as plain_fetch:
                config = (await plain_fetch.get(s.url + KEYS_PATH)).content
            identity = ehbp.ServerIdentity.unmarshal_public_config(config)
            headers = {"authorization": f"Bearer {s.keys['alice']}"}
            body = {
                "model": MODEL,
                "prompt": json.dumps(chat_body(random.Random(7), 6, 500)),
                "max_tokens": STREAM_TOKENS,
                "stream": True,
            }
            arms = {
                "plaintext": async_client(base_url=s.url, headers=headers),
                "EHBP (tinfoil-ehbp transport)": async_client(
                    base_url=s.url,
                    headers=headers,
                    transport=ehbp.AsyncEHBPTransport(identity),
                ),
                "EHBP (saltgate client transport)": async_client(
                    base_url=s.url,
                    headers=headers,
                    transport=AsyncSaltgateTransport(
                        s.url, user_cache_secret="b" * 64, state_dir=Path(tmp) / "client"
                    ),
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in arms}
            for i in range(requests + 10):
                for name, client in arms.items():
                    started = time.perf_counter()
                    async with client.stream("POST", "/v1/completions", json=body) as resp:
                        assert resp.status_code == 200
                        async for _ in resp.aiter_bytes():
                            pass
                    if i >= 10:  # warm-up
                        times[name].append((time.perf_counter() - started) * 1e3)
            for client in arms.values():
                await client.aclose()
    print(f"end to end, streamed completion, {requests} requests per arm (ms)")
    for name, samples in times.items():
        p90 = statistics.quantiles(samples, n=10)[-1]
        print(f"  {name:<34} p50 {statistics.median(samples):6.2f}   p90 {p90:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--e2e", type=int, default=150, help="requests per arm (0: skip)")
    args = parser.parse_args()
    crypto(args.rounds)
    if args.e2e:
        asyncio.run(end_to_end(args.e2e))


if __name__ == "__main__":
    main()
