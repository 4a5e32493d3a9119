"""The access log: one line per request, joined to the response by its request id, and no
secret or prompt in it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from tests.gateway.stack import MODEL, ledger_rows, run, stack
from tests.support.leaks import Secret, leaks
from tests.support.waiting import eventually

from saltgate.config import load_master_key
from saltgate.gateway.access_log import AccessLog, _pieces
from saltgate.gateway.context import RequestContext
from saltgate.gateway.usage import Usage
from saltgate.store.tenants import new_api_key


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_one_line_per_request_and_no_secret_in_it(tmp_path: Path, fmt: str) -> None:
    log = tmp_path / "access.log"
    marker = "PROMPTMARKER-7f3a"
    secret = "user-secret-" + "x" * 20
    planted = new_api_key()  # sent as the client's request id, which the log keeps

    async def main() -> None:
        async with stack(tmp_path, replicas=1, access_log=str(log), log_format=fmt) as s:
            async with s.client("alice") as alice:
                ids = []
                for body in (
                    {"model": MODEL, "prompt": marker, "max_tokens": 2},
                    {
                        "model": MODEL,
                        "prompt": marker,
                        "max_tokens": 2,
                        "user_cache_secret": secret,
                    },
                    {"model": MODEL, "prompt": marker, "max_tokens": 2, "stream": True},
                ):
                    resp = await alice.post(
                        "/v1/completions", json=body, headers={"x-request-id": planted}
                    )
                    assert resp.status_code == 200
                    ids.append(resp.headers["x-request-id"])
                refused = await alice.post("/v1/completions", content=b"{")
                assert refused.status_code == 400
                ids.append(refused.headers["x-request-id"])
            async with s.client() as anonymous:
                resp = await anonymous.get("/v1/models")
                assert resp.status_code == 401
                ids.append(resp.headers["x-request-id"])
            bodies = s.seen_bodies()
            salts = {orjson.loads(b)["cache_salt"] for b in bodies}
            assert all(marker.encode() in b for b in bodies)  # the traffic carried the marker
            tenant = ledger_rows(s)[0]["tenant_id"]
        text = log.read_text()
        lines = text.splitlines()
        assert len(lines) == len(ids)
        for line, request_id in zip(lines, ids, strict=True):
            assert request_id in line
        if fmt == "json":
            docs = [orjson.loads(line) for line in lines]
            assert [d["status"] for d in docs] == [200, 200, 200, 400, 401]
            assert [d["tenant_id"] for d in docs] == [tenant] * 4 + [None]
            assert docs[0]["prompt_tokens"] > 0 and docs[0]["completion_tokens"] == 2
            assert docs[2]["ttfb_ms"] <= docs[2]["total_ms"]
            assert {d["client_request_id"] for d in docs} == {planted, None}
            assert docs[0]["route"] == "/v1/completions" and docs[0]["model"] == MODEL
        else:
            assert re.search(r"status=200 prompt=[1-9]\d* cached=\d+ completion=2 ", lines[0])
            assert f"tenant={tenant}" in lines[0] and "tenant=- " in lines[4]
        secrets: dict[str, Secret] = {
            "prompt": marker,
            "user_cache_secret": secret,
            "master_key": load_master_key(tmp_path / "state" / "master.key"),
            "api_key": s.keys["alice"],
            **{f"salt_{i}": salt for i, salt in enumerate(salts)},
        }
        assert not leaks(text, **secrets)
        # Positive control: the key-shaped string the client chose is in the log, and the
        # same scan of the same text finds it.
        assert leaks(text, planted=planted)

    run(main)


def test_client_chosen_strings_cannot_forge_a_line(tmp_path: Path) -> None:
    async def main() -> None:
        out = tmp_path / "log"
        log = AccessLog.open(str(out), "text")
        entry = RequestContext(log, b"POST", b"id\nforged line", 0.0)
        entry.model = 'm" status=200\nforged'
        log.write(entry, 400, Usage(1, 0, 0))
        log.close()
        [line] = out.read_text().splitlines()
        assert 'model="m\\" status=200\\nforged"' in line
        assert "client_request_id=-" in line  # not printable ASCII: left out

    asyncio.run(main())


def test_lines_are_written_in_batches(tmp_path: Path) -> None:
    async def main() -> None:
        out = tmp_path / "log"
        log = AccessLog.open(str(out), "json")
        for _ in range(3):
            RequestContext(log, b"GET", None, 0.0).end(200)
        assert out.read_text() == ""  # held until the flush timer
        await eventually(lambda: len(out.read_text().splitlines()) == 3, what="the timed flush")
        log.close()

    asyncio.run(main())


_PIPE_WRITER = """
import asyncio, sys
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.context import RequestContext

async def main() -> None:
    log = AccessLog(int(sys.argv[1]), "json")
    log._atomic = sys.argv[2] == "on"  # "off": the positive control
    for _ in range(4000):
        entry = RequestContext(log, b"POST", None, 0.0)
        entry.model = sys.argv[3] * 150
        entry.end(200)  # 64 KiB batches, far over PIPE_BUF
    log.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("atomic", ["on", "off"])
def test_workers_sharing_a_pipe_never_split_a_line(atomic: str) -> None:
    """Two processes log to one pipe (the stderr of `serve --workers 2` under a
    supervisor) while the reader is slow, so the pipe is full and writes block part-way.
    Writes of whole lines up to PIPE_BUF keep every line whole; the positive control
    (one write per batch) shows lines of the two writers cut into each other."""
    read_end, write_end = os.pipe()
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _PIPE_WRITER, str(write_end), atomic, mark],
            pass_fds=(write_end,),
        )
        for mark in "ab"
    ]
    os.close(write_end)
    data = bytearray()
    while chunk := os.read(read_end, 4096):
        data += chunk
        time.sleep(0.0005)
    os.close(read_end)
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    lines = bytes(data).splitlines()
    assert len(lines) == 8000

    def whole(line: bytes) -> bool:
        try:
            return len(set(orjson.loads(line)["model"])) == 1
        except (orjson.JSONDecodeError, KeyError, TypeError):  # a fragment, say "200}"
            return False

    broken = sum(not whole(line) for line in lines)
    if atomic == "on":
        assert broken == 0
    else:
        assert broken > 0


def test_a_batch_is_cut_after_newlines_into_atomic_pieces() -> None:
    lines = [b"x" * n + b"\n" for n in (10, 3000, 2000, 5000, 1)]
    data = b"".join(lines)
    pieces = _pieces(data, 4096)
    assert b"".join(pieces) == data
    assert pieces == [lines[0] + lines[1], lines[2], lines[3], lines[4]]
    assert all(p.endswith(b"\n") for p in pieces)
    assert _pieces(b"a\n", 4096) == [b"a\n"]
