"""Killing a writer mid-stream, for the ledgers' no-record-lost tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

CHILD = Path(__file__).parent.parent / "store" / "ledger_crash_child.py"


def acknowledged_before_sigkill(args: Sequence[str], lines: int) -> list[str]:
    """Run tests/store/ledger_crash_child.py with ``args`` (it prints a line for each
    record its ledger acknowledged), SIGKILL it once ``lines`` lines are out, and return
    the whole lines it printed: a torn last line is not an acknowledgement."""
    proc = subprocess.Popen([sys.executable, str(CHILD), *args], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    stdout = proc.stdout.fileno()
    out = bytearray()

    def drain() -> None:
        # Read continuously so a full pipe never throttles the child: it must be killed
        # while it runs flat out, not while it waits for us.
        while chunk := os.read(stdout, 1 << 16):
            out.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    deadline = time.monotonic() + 60
    try:
        while out.count(b"\n") < lines:
            assert proc.poll() is None, f"child exited early with {proc.returncode}"
            assert time.monotonic() < deadline, "child too slow"
            time.sleep(0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        reader.join(timeout=30)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    return [line.decode() for line in bytes(out).split(b"\n")[:-1]]
