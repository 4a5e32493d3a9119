"""Children the tests and benchmarks start: each in its own process group (so stopping it
stops whatever it started), its output in a log file; and free loopback ports for them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO

# Under pytest-xdist each worker takes the ports it hands to servers from a block of its
# own, below Linux's ephemeral range (32768-60999 by default), where the kernel picks the
# ports of `bind(port 0)` and of outgoing connections.
FIRST_WORKER_PORT = 20_000
PORTS_PER_WORKER = 1_000
_WORKER_BLOCKS = 12  # 20000-31999; a worker past the twelfth shares a block


def _worker_block() -> range | None:
    """This pytest-xdist worker's ports (PYTEST_XDIST_WORKER=gwN, which the processes a
    test starts inherit), or None outside a worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw") or not worker[2:].isdigit():
        return None
    first = FIRST_WORKER_PORT + int(worker[2:]) % _WORKER_BLOCKS * PORTS_PER_WORKER
    return range(first, first + PORTS_PER_WORKER)


# Where this process looks next in its worker's block: from a random place, so that a
# process a test starts does not look where the test itself just found a port that its
# server has not bound yet, and onwards, so that two calls before a bind differ.
_cursor = random.randrange(PORTS_PER_WORKER)


def _bindable(ports: Sequence[int]) -> bool:
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port(run: int = 1) -> int:
    """A loopback port free now, the first of `run` free in a row (`saltgate up --port P`
    serves its admin listener on P + 1). Another process may take it before it is bound:
    outside pytest-xdist's workers any process may (the kernel picks it, port 0); within a
    run of the suite only this worker, whose servers started on four workers at once
    otherwise met each other's ports (one run beside two busy loops, 2026-12-05)."""
    global _cursor  # noqa: PLW0603 - one cursor per process
    block = _worker_block()
    if block is None:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port: int = s.getsockname()[1]
            if _bindable(range(port, port + run)):
                return port
    for _ in range(len(block)):
        port = block[_cursor % len(block)]
        _cursor += 1
        if port + run <= block.stop and _bindable(range(port, port + run)):
            _cursor += run - 1
            return port
    raise OSError(f"no {run} free loopback port(s) in a row in {block}")


class Proc:
    """A child in its own process group, its output in a log file; `stop()` ends it."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.popen = subprocess.Popen(  # noqa: S603 - argv built here, no shell
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash would end it, then reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.stop()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
