"""`saltgate up` as a user starts it (the command, in its own process), for one test."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from saltgate_devkit.procs import free_port


@dataclass(frozen=True)
class Up:
    url: str
    banner: str  # what it printed: the URL, the EHBP key's fingerprint, a key per demo tenant

    def api_key(self, tenant: str = "demo-alice") -> str:
        found = re.search(rf"tenant {re.escape(tenant)}: API key (\S+)", self.banner)
        assert found, f"no key for {tenant} in: {self.banner}"
        return found.group(1)

    def admin_token(self) -> str:
        found = re.search(r"admin token \(every scope\): (\S+)", self.banner)
        assert found, f"no admin token in: {self.banner}"
        return found.group(1)

    @property
    def admin_url(self) -> str:
        """The admin listener: `up` serves it on --port + 1."""
        host, _, port = self.url.rpartition(":")
        return f"{host}:{int(port) + 1}"


@asynccontextmanager
async def saltgate_up(
    state_dir: Path,
    replicas: int = 1,
    command: Sequence[str] = (sys.executable, "-m", "saltgate.cli"),
) -> AsyncIterator[Up]:
    """Run `saltgate up` (by default this environment's; `command` names another install's
    `saltgate`); yields once it printed its banner, stops it (SIGINT) after."""
    port = free_port(run=2)  # `up` serves its admin listener on port + 1
    proc = await asyncio.create_subprocess_exec(
        *command, "up", "--port", str(port),
        "--replicas", str(replicas), "--state-dir", str(state_dir),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any(line.lstrip().startswith("try:") for line in lines):
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line, f"saltgate up exited early: {lines}"
            lines.append(line)
        yield Up(f"http://127.0.0.1:{port}", "".join(lines))
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), 30)
