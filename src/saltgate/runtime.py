"""Running a long-lived service from the command line, the same way for every command.

uvloop (the servers were measured on it, docs/benchmarks.md), a clean stop on SIGINT or
SIGTERM, and one line on stderr with a clear exit status instead of a traceback: 2 for
a usage or configuration mistake, 1 when the service cannot run (a port in use).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import uvloop


class StartError(OSError):
    """What could not start, named (a listener and the options that set it, a worker):
    printed as it is, exit status 1 (the service cannot run now; it may later)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(errno or 0, message)


def listen_error(what: str, host: str, port: int, exc: OSError) -> StartError:
    """A failed bind as an operator reads it: which listener, which options set it."""
    return StartError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}", exc.errno)


def install_uvloop() -> None:
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def until_stopped() -> None:
    """Return when the process is asked to stop (SIGINT or SIGTERM)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_service(
    main: Callable[[], Coroutine[Any, Any, None]],
    name: str,
    *,
    cannot_run: str,
    usage_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Run `main` on uvloop; `cannot_run` prefixes the message of an OSError that does
    not name its cause itself (a StartError does)."""
    install_uvloop()
    try:
        asyncio.run(main())
    except usage_errors as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    except StartError as exc:
        print(f"{name}: {exc.strerror}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{name}: {cannot_run}: {exc}", file=sys.stderr)
        return 1
    return 0
