"""The event lines' two formats (serving/event_log.py): what each line carries, without a
process (the process tests are tests/gateway/test_access_log.py and tests/serving)."""

from __future__ import annotations

import json
import logging
import re

import pytest

from saltgate.serving.event_log import EventFormatter

pytestmark = pytest.mark.unit


def record(message: str, *args: object, failure: BaseException | None = None) -> logging.LogRecord:
    exc_info = None if failure is None else (type(failure), failure, failure.__traceback__)
    made = logging.LogRecord(
        "saltgate.serving.supervisor", logging.WARNING, __file__, 1, message, args, exc_info
    )
    made.created = 1_764_936_000.25  # 2025-12-05 12:00:00.250 UTC
    return made


def test_a_text_line_has_time_level_process_and_module() -> None:
    line = EventFormatter("text", worker=1).format(record("worker %d: %s", 1, "x"))
    assert line == (
        "2025-12-05T12:00:00.250Z WARNING [worker 1] saltgate.serving.supervisor: worker 1: x"
    )
    assert "[supervisor]" in EventFormatter("text", supervisor=True).format(record("m"))
    assert "[gateway]" in EventFormatter("text").format(record("m"))
    forged = EventFormatter("text").format(record("%s", "x\n2025-12-05T00:00:00Z INFO \x1b[2J"))
    assert forged.endswith(": x\\x0a2025-12-05T00:00:00Z INFO \\x1b[2J"), forged


def test_a_json_line_is_one_object_with_the_same_fields() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError as exc:
        failure = exc
    line = EventFormatter("json", worker=0).format(record("said %s", "\x1b[2J", failure=failure))
    assert "\n" not in line  # one line, even with a traceback and an escape in it
    event = json.loads(line)
    assert event.pop("exception").endswith("ValueError: bad\nthing")
    assert event == {
        "time": "2025-12-05T12:00:00.250Z",
        "level": "warning",
        "process": "worker 0",
        "worker": 0,
        "logger": "saltgate.serving.supervisor",
        "message": "said \x1b[2J",
    }


def test_a_text_traceback_follows_its_line() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        line = EventFormatter("text").format(record("failed", failure=exc))
    first, *rest = line.splitlines()
    assert re.fullmatch(r"\S+Z WARNING \[gateway\] saltgate\.serving\.supervisor: failed", first)
    assert rest[-1] == "RuntimeError: boom"
