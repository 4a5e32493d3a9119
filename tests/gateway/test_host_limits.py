"""A worker's end of the host's one count (gateway/host_limits.py) over a real socket pair:
answers from the supervisor's arbiter, and the fallback to the worker's share when it
does not answer (docs/limits.md, "Workers")."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from tests.gateway.stack import MODEL, run
from tests.support.waiting import eventually

from saltgate.derivations.derive import ROUTE_CHAT
from saltgate.gateway.admission import Admission
from saltgate.gateway.host_limits import HostLimits, HostTicket, HostUnreachable
from saltgate.governance.arbiter import MAX_LINE_BYTES, Arbiter
from saltgate.governance.kinds import Scope, Subject
from saltgate.governance.limits import Demand, Limits
from saltgate.policy.errors import ApiError
from saltgate.prices import PriceBook
from saltgate.store.tenants import Principal

PRINCIPAL = Principal("tn_1", "acme", "key_1", 0, limits=Limits(rpm=3))
TIMEOUT_S = 0.2


@asynccontextmanager
async def supervisor(
    arbiter: Arbiter | None, workers: int = 1
) -> AsyncIterator[tuple[list[HostLimits], list[bytes]]]:
    """`workers` channels to an arbiter served as the supervisor serves it; with None, a
    supervisor that reads every line (kept in the list) and answers none."""
    heard: list[bytes] = []
    tasks = []
    engines = []

    async def serve(channel: int, sock: socket.socket) -> None:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
        while line := await reader.readline():
            heard.append(line)
            answer = None if arbiter is None else arbiter.answer(channel, line, 1.0)
            if answer is not None:
                writer.write(answer + b"\n")
        writer.close()

    for channel in range(workers):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        tasks.append(asyncio.create_task(serve(channel, ours)))
        engines.append(await HostLimits.open(theirs, timeout_s=TIMEOUT_S))
    try:
        yield engines, heard
    finally:
        for engine in engines:
            await engine.aclose()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_two_workers_admit_through_one_count() -> None:
    async def main() -> None:
        async with supervisor(Arbiter(), workers=2) as ((a, b), _):
            admissions = [Admission(PriceBook(), share=2, shared=engine) for engine in (a, a, b, b)]
            tickets = []
            for admission in admissions[:3]:
                ticket, headers = await admission.admit(PRINCIPAL, ROUTE_CHAT, MODEL, 40, 1)
                assert isinstance(ticket, HostTicket) and ticket.local is not None
                tickets.append(ticket)
            assert (b"x-ratelimit-limit-requests", b"3") in headers
            with pytest.raises(ApiError, match="Limit 3, Used 3"):
                await admissions[3].admit(PRINCIPAL, ROUTE_CHAT, MODEL, 40, 1)

    run(main)


def test_an_unanswering_supervisor_means_the_share_and_a_late_admission_given_back(
    caplog: Any,
) -> None:
    """No answer within the timeout: HostUnreachable, and a settlement of that id at zero
    follows the question (so an admission the supervisor makes late holds no lease); the
    gateway then enforces its share (3 // 2 = 1) and says so."""

    async def main() -> None:
        async with supervisor(None) as ((engine,), heard):
            with pytest.raises(HostUnreachable):
                await engine.admit([(Subject(Scope.TENANT, "tn_1"), Limits(rpm=3))], Demand(1, 1))
            await eventually(lambda: len(heard) >= 2, what="the question and its cancel")
            assert heard[0].startswith(b'["a",1,') and heard[1] == b'["s",1,[0,0,0]]\n'
            admission = Admission(PriceBook(), share=2, shared=engine)
            with caplog.at_level(logging.WARNING):
                await admission.admit(PRINCIPAL, ROUTE_CHAT, MODEL, 40, 1)
            assert not admission.shared_up
            assert "limits: the supervisor unreachable (HostUnreachable)" in caplog.text
            # Within the second before the supervisor is asked again: the share alone.
            with pytest.raises(ApiError, match="Limit 1, Used 1"):
                await admission.admit(PRINCIPAL, ROUTE_CHAT, MODEL, 40, 1)

    run(main)


def test_a_closed_channel_fails_at_once() -> None:
    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        engine = await HostLimits.open(theirs, timeout_s=30.0)
        ours.close()
        started = asyncio.get_running_loop().time()
        with pytest.raises(HostUnreachable):
            await engine.admit([(Subject(Scope.TENANT, "tn_1"), Limits(rpm=3))], Demand(1, 1))
        assert asyncio.get_running_loop().time() - started < 5.0  # not the 30 s timeout
        await engine.aclose()

    run(main)
