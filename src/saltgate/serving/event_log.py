"""The gateway's event lines on stderr: what happened to the process, not to a request
(the access log has those). Starts and stops, reloads and log reopens, workers that die,
replicas that go down, warnings from any saltgate module.

Each line carries what an SRE filters on: a UTC timestamp, a level, which process said it
(`supervisor`, `worker N`, or `gateway` for a single process) and the module; JSON lines
under `log_format = "json"` (docs/observability.md), like the access log. Messages are
written to carry no secret (keys, salts and user secrets are never formatted into them).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import UTC, datetime
from typing import Final

LOGGER: Final = "saltgate"
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


class EventFormatter(logging.Formatter):
    """One line per event: text (`TIME LEVEL [PROCESS] MODULE: MESSAGE`) or a JSON object
    (`time`, `level`, `process`, `worker`, `logger`, `message`, and `exception` if any)."""

    def __init__(
        self, log_format: str, *, worker: int | None = None, supervisor: bool = False
    ) -> None:
        super().__init__()
        self.json = log_format == "json"
        self.worker = worker
        if supervisor:
            self.process = "supervisor"
        else:
            self.process = "gateway" if worker is None else f"worker {worker}"

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        when = when.replace("+00:00", "Z")
        message = record.getMessage()
        failure = self.formatException(record.exc_info) if record.exc_info else None
        if self.json:
            event: dict[str, object] = {
                "time": when,
                "level": record.levelname.lower(),
                "process": self.process,
                "worker": self.worker,
                "logger": record.name,
                "message": message,
            }
            if failure is not None:
                event["exception"] = failure
            return json.dumps(event, ensure_ascii=False)
        # A message quoting something from outside (a file's content, a peer's error) must
        # not forge a line or drive the terminal: control characters escaped.
        message = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", message)
        line = f"{when} {record.levelname} [{self.process}] {record.name}: {message}"
        return line if failure is None else f"{line}\n{failure}"


def configure(log_format: str, *, worker: int | None = None, supervisor: bool = False) -> None:
    """Send every saltgate logger's events at INFO and above to stderr in one format (once
    per process: a second call replaces the first's handler)."""
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler.formatter, EventFormatter):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EventFormatter(log_format, worker=worker, supervisor=supervisor))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
