"""Issue 40, "Fields", through a real gateway in front of recording replicas (the
simulator behind a tap): no stripped or refused field reaches a replica, and engine extras
in a replica's answer (per-request metrics, transfer parameters) never reach the client.
Cases: tests/support/adversarial_fields.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
from tests.gateway.stack import MODEL, Stack, run, stack
from tests.support.adversarial_fields import raw_duplicates, refused_cases, stripped_cases
from tests.support.http import async_client

from saltgate.policy.fields import ANSWER_FIELDS

EXTRAS = b'"metrics":{"queue_time":0.5},"kv_transfer_params":{"remote_block_ids":[7]},'
EXTRAS += b'"ec_transfer_params":{"x":1},'


def _with_extras(data: bytes) -> bytes:
    """What a replica with per-request metrics and a KV connector adds to each answer."""
    if data.startswith(b"{"):
        return b"{" + EXTRAS + data[1:]
    return data.replace(b"data: {", b"data: {" + EXTRAS)


def _named(case_body: dict[str, object]) -> dict[str, object]:
    return {**case_body, "model": MODEL}


def test_stripped_fields_never_reach_a_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("bob") as bob:
            for case in stripped_cases():
                before = len(s.forwarded())
                resp = await bob.post(case.route, json=_named(case.body))
                assert resp.status_code < 500, (case.name, resp.text)
                for request in s.forwarded()[before:]:
                    seen = orjson.loads(request.body)
                    assert not case.leaked(seen), (case.name, seen)
            assert len(s.forwarded()) >= len(list(stripped_cases()))  # they were forwarded

    run(main)


def test_refused_fields_never_reach_a_replica(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s, s.client("bob") as bob:
            for case in refused_cases():
                resp = await bob.post(case.route, json=_named(case.body))
                assert resp.status_code == 400, (case.name, resp.text)
                assert case.param in resp.text, (case.name, resp.text)
            for name, raw in raw_duplicates():
                resp = await bob.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json"}
                )
                assert resp.status_code == 400, (name, resp.text)
            assert s.forwarded() == []

    run(main)


async def _answers(s: Stack, stream: bool) -> list[bytes]:
    s.taps[0].answer = _with_extras
    out = []
    async with s.client("bob") as bob:
        routes: list[tuple[str, dict[str, Any]]] = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/responses", {"input": "hi"}),
        ]
        for route, body in routes:
            resp = await bob.post(route, json={"model": MODEL, "stream": stream, **body})
            assert resp.status_code == 200, (route, resp.text)
            out.append(resp.content)
    return out


def _assert_clean(answers: list[bytes]) -> None:
    for answer in answers:
        for name in ANSWER_FIELDS:
            assert f'"{name}"'.encode() not in answer, answer[:300]


def test_replica_extras_never_reach_the_client(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, replicas=1) as s:
            _assert_clean(await _answers(s, stream=False))
            _assert_clean(await _answers(s, stream=True))
            # Positive control: straight from the replica, the answer carries them.
            direct = f"http://127.0.0.1:{s.taps[0].port}"
            async with async_client(base_url=direct, timeout=30) as replica:
                body = {"model": MODEL, "prompt": "hi"}
                for stream in (False, True):
                    resp = await replica.post("/v1/completions", json={**body, "stream": stream})
                    assert all(f'"{n}"'.encode() in resp.content for n in ANSWER_FIELDS)

    run(main)


def test_with_priority_scheduling_the_replica_sees_the_band_s_priority(tmp_path: Path) -> None:
    async def main() -> None:
        async with (
            stack(tmp_path, replicas=1, replica_priority_scheduling=True) as s,
            s.client("bob") as bob,
        ):
            routes: list[tuple[str, dict[str, Any]]] = [
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ]
            for route, body in routes:
                resp = await bob.post(route, json={"model": MODEL, "priority": -1000, **body})
                assert resp.status_code == 200, resp.text
                assert orjson.loads(s.forwarded()[-1].body)["priority"] == 0  # interactive

    run(main)
