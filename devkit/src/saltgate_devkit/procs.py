"""Children the tests and benchmarks start: each in its own process group (so stopping it
stops whatever it started), its output in a log file; and free loopback ports for them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO


def free_port() -> int:
    """A loopback port free now (another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
