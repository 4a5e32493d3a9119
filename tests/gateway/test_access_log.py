"""The access log: one line per request, joined to the response by its request id, and no
secret or prompt in it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest
from tests.gateway.stack import MODEL, ledger_rows, run, stack
from tests.support.gateways import GatewayProcess, write_gateway_config
from tests.support.http import async_client
from tests.support.leaks import Secret, leaks
from tests.support.waiting import eventually

from saltgate.config import create_master_key, load_master_key
from saltgate.gateway.access_log import AccessLog, _pieces
from saltgate.gateway.context import RequestContext
from saltgate.gateway.usage import Usage
from saltgate.policy.forwarded import TrustedProxies
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
            assert {d["client_addr"] for d in docs} == {"127.0.0.1"}
        else:
            assert re.search(r"status=200 prompt=[1-9]\d* cached=\d+ completion=2 ", lines[0])
            assert all(" client=127.0.0.1 " in line for line in lines)
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


@pytest.mark.parametrize("trusted", [["127.0.0.1"], ["10.0.0.0/8"]])
def test_the_client_address_is_read_from_x_forwarded_for_only_from_a_trusted_proxy(
    tmp_path: Path, trusted: list[str]
) -> None:
    """The test client stands for a balancer on loopback: trusted, its X-Forwarded-For
    names the client; not trusted, the header is ignored (a client cannot choose its
    address). Either way the header does not reach the replica."""
    log = tmp_path / "access.log"

    async def main() -> None:
        async with (
            stack(
                tmp_path,
                replicas=1,
                access_log=str(log),
                log_format="json",
                trusted_proxies=TrustedProxies.parse(trusted),
            ) as s,
            s.client("alice") as alice,
        ):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            xff = {"x-forwarded-for": "6.6.6.6, 203.0.113.7"}
            assert (await alice.post("/v1/completions", json=body, headers=xff)).is_success
            assert (await alice.get("/health", headers=xff)).is_success
            [forwarded] = s.forwarded()
            assert forwarded.header(b"x-forwarded-for") is None

    run(main)
    docs = [orjson.loads(line) for line in log.read_text().splitlines()]
    expected = "203.0.113.7" if trusted == ["127.0.0.1"] else "127.0.0.1"
    assert [d["client_addr"] for d in docs] == [expected, expected]


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_reopens_the_access_log_after_rotation(tmp_path: Path, workers: int) -> None:
    """`mv gw.log gw.log.1` and SIGHUP, as logrotate does, under traffic: the lines after
    the reopen go to a new gw.log, in every worker, and each request has exactly one line
    across the two files."""
    log = tmp_path / "gw.log"
    master = tmp_path / "master.key"
    create_master_key(master)
    config = write_gateway_config(
        tmp_path / "gw.toml",
        state_dir=tmp_path / "state",
        master_key_file=master,
        replicas=["http://127.0.0.1:9"],  # /health needs no replica
        gateway_extra=f'access_log = "{log}"\nlog_format = "json"\n',
    )

    async def main() -> tuple[list[str], list[str]]:
        gateway = await GatewayProcess.start(config, tmp_path / "stderr.log", workers=workers)
        sent: list[str] = []
        stop = asyncio.Event()
        try:
            async with async_client(base_url=gateway.url, timeout=10) as http:

                async def traffic() -> None:
                    while not stop.is_set():
                        resp = await http.get("/health")
                        assert resp.status_code == 200
                        sent.append(resp.headers["x-request-id"])

                senders = [asyncio.create_task(traffic()) for _ in range(4)]
                await eventually(lambda: log.exists() and log.stat().st_size > 0, what="lines")
                log.rename(tmp_path / "gw.log.1")
                since = gateway.log.stat().st_size
                gateway.proc.send_signal(signal.SIGHUP)
                line = await gateway.event("reopened the access log", since=since)
                event = orjson.loads(line)  # log_format = "json": event lines are JSON too
                assert event["level"] == "info", event
                assert event["process"] == ("supervisor" if workers > 1 else "gateway"), event
                assert f"in {workers} of {workers} workers" in event["message"] or workers == 1
                after = []
                for _ in range(20):
                    resp = await http.get("/health")
                    after.append(resp.headers["x-request-id"])
                stop.set()
                await asyncio.gather(*senders)
        finally:
            await gateway.stop()  # flushes what the workers hold
        return sent + after, after

    sent, after = asyncio.run(main())

    def ids(path: Path) -> list[str]:
        return [orjson.loads(line)["request_id"] for line in path.read_text().splitlines()]

    old, new = ids(tmp_path / "gw.log.1"), ids(log)
    assert old and new
    assert set(after) <= set(new)  # after the reopen: the new file only
    counts = Counter(old + new)
    assert set(counts) == set(sent) and max(counts.values()) == 1  # none lost, none twice
    # Every event line on stderr is JSON too, from the supervisor and each worker, and
    # the shutdown is said (issue 43: reload, reopen and shutdown left no line).
    events = [orjson.loads(line) for line in (tmp_path / "stderr.log").read_text().splitlines()]
    said = [(e["process"], e["message"]) for e in events]
    first = "supervisor" if workers > 1 else "gateway"
    assert said[-1] == (first, "stopped"), said
    assert any(p == first and m.startswith("stopping: ") for p, m in said), said
    assert all(e["time"].endswith("Z") and e["level"] in ("info", "warning") for e in events)
    if workers > 1:  # each worker names itself (its warning: limits not shared)
        assert {e["worker"] for e in events} == {None, 0, 1}, events


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
    print("ready", flush=True)
    sys.stdin.readline()  # both writers start together, however slow each was to start
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
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for mark in "ab"
    ]
    os.close(write_end)
    for w in writers:  # on a busy machine one could otherwise be done before the other starts
        assert w.stdout is not None and w.stdout.readline() == b"ready\n"
        w.stdout.close()
    for w in writers:
        assert w.stdin is not None
        w.stdin.write(b"go\n")
        w.stdin.close()
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
