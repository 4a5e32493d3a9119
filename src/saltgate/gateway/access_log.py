"""The access log: one line per request, as text or JSON, written in batches.

A line names the request (the gateway's own id, and the client's `x-request-id` as a
separate field: a client chooses it, so it is never an identity), the client's address
(the TCP peer, or the client a trusted balancer names: policy/forwarded.py), the tenant
(its id, never a key), the route, model, status, tokens and timings. Nothing a request
carries that could be secret or private reaches it: no key, salt, user secret or prompt
text.
Strings a client chose (model, its request id) are written JSON-quoted in both formats,
so no client can forge a line or a field.

Lines are buffered and written every `FLUSH_S` or once `FLUSH_BYTES` pile up: a busy
gateway makes one write a batch, not one per request. To a pipe or socket (stderr under
a supervisor, say), which the worker processes of `serve --workers N` share, a write
carries whole lines and at most PIPE_BUF bytes, the size the kernel writes atomically,
so lines of different workers never interleave mid-line.

A log file is reopened on SIGHUP (`reopen`, in every worker), for log rotation: logrotate
renames the file, then signals; no line is lost or written twice across the rename.
"""

from __future__ import annotations

import asyncio
import os
import re
import select
import stat
import time
from typing import Final

import orjson

from saltgate.gateway.context import RequestContext
from saltgate.gateway.usage import Usage

FLUSH_S: Final = 0.2
FLUSH_BYTES: Final = 64 * 1024
FORMATS: Final = ("text", "json")
MAX_PATH_CHARS: Final = 512  # an admin path's characters logged (a client chose them)
_CLIENT_ID: Final = re.compile(rb"[\x21-\x7e]{1,128}")
_METHOD: Final = re.compile(rb"[A-Z]{1,16}")
_NO_USAGE: Final = Usage()


class AccessLog:
    """Writes entries to a file descriptor (stderr, or a file opened for appending)."""

    def __init__(self, fd: int | None, fmt: str = "text", path: str | None = None) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"log format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fd = fd
        self.path = path  # the file `reopen` opens anew; None: stderr, or off
        self.json = fmt == "json"
        self._atomic = fd is not None and _is_pipe(fd)
        self._buffer: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._second = -1
        self._stamp = ""

    @classmethod
    def open(cls, target: str, fmt: str) -> AccessLog:
        """``target``: "stderr", "off", or a file path (appended to, created 0640)."""
        if target == "off":
            return cls(None, fmt)
        if target == "stderr":
            return cls(2, fmt)
        return cls(_open_append(target), fmt, target)

    def reopen(self) -> bool:
        """Log rotation (SIGHUP, after logrotate renamed the file): the lines so far go to
        the file as it was, later ones to a file opened anew at the path. False when there
        is no file to reopen (stderr, off); OSError, the old file kept, if it cannot be
        opened."""
        if self.path is None or self.fd is None:
            return False
        self.flush()
        fd = _open_append(self.path)
        old, self.fd = self.fd, fd
        self._atomic = _is_pipe(fd)
        os.close(old)
        return True

    def write(self, entry: RequestContext, status: int, usage: Usage | None = None) -> None:
        """The line of a request that ended (`RequestContext.end`)."""
        if self.fd is None:
            return
        now = time.monotonic()
        used = usage or _NO_USAGE
        total_ms = round((now - entry.started) * 1000, 3)
        first = entry.first_byte
        ttfb_ms = round((first - entry.started) * 1000, 3) if first else total_ms
        client_id = entry.client_request_id
        client = client_id.decode() if client_id and _CLIENT_ID.fullmatch(client_id) else None
        if self.json:
            line = orjson.dumps(
                {
                    "time": self._time(),
                    "request_id": entry.request_id,
                    "client_request_id": client,
                    "client_addr": entry.client_addr or None,
                    "tenant_id": entry.tenant_id or None,
                    "method": entry.method.decode("ascii", "replace"),
                    "route": entry.route or None,
                    "model": entry.model or None,
                    "status": status,
                    "prompt_tokens": used.prompt_tokens,
                    "cached_tokens": used.cached_tokens,
                    "completion_tokens": used.completion_tokens,
                    "ttfb_ms": ttfb_ms,
                    "total_ms": total_ms,
                }
            )
        else:
            line = (
                f"{self._time()} {entry.request_id} client={entry.client_addr or '-'} "
                f"tenant={entry.tenant_id or '-'} "
                f"{entry.method.decode('ascii', 'replace')} {entry.route or '-'} "
                f"model={_quoted(entry.model)} status={status} prompt={used.prompt_tokens} "
                f"cached={'-' if used.cached_tokens is None else used.cached_tokens} "
                f"completion={used.completion_tokens} "
                f"ttfb_ms={ttfb_ms} total_ms={total_ms} client_request_id={_quoted(client)}"
            ).encode()
        self._add(line)

    def _add(self, line: bytes) -> None:
        self._buffer.append(line + b"\n")
        self._size += len(line) + 1
        if self._size >= FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def write_admin(
        self,
        method: bytes,
        path: bytes,
        status: int,
        *,
        token_id: str | None,
        client_addr: str,
        started: float,
    ) -> None:
        """The line of a request on the admin listener (saltgate.serving.admin_listener):
        marked ``admin``, with the admin token's id, never the token, and the path without
        its query (which could carry what a client should not have put in a URL)."""
        if self.fd is None:
            return
        total_ms = round((time.monotonic() - started) * 1000, 3)
        shown = path.decode("utf-8", "replace")[:MAX_PATH_CHARS]
        verb = method.decode() if _METHOD.fullmatch(method) else "-"
        if self.json:
            line = orjson.dumps(
                {
                    "time": self._time(),
                    "listener": "admin",
                    "client_addr": client_addr or None,
                    "admin_token_id": token_id,
                    "method": verb,
                    "route": shown,  # the key the gateway's lines use for their path
                    "status": status,
                    "total_ms": total_ms,
                }
            )
        else:
            line = (
                f"{self._time()} admin client={client_addr or '-'} token={token_id or '-'} "
                f"{verb} path={_quoted(shown)} status={status} total_ms={total_ms}"
            ).encode()
        self._add(line)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._buffer or self.fd is None:
            return
        data = b"".join(self._buffer)
        self._buffer.clear()
        self._size = 0
        if self._atomic:
            for piece in _pieces(data, select.PIPE_BUF):
                _write_all(self.fd, piece)
        else:
            _write_all(self.fd, data)

    def close(self) -> None:
        self.flush()
        if self.fd is not None and self.fd > 2:
            os.close(self.fd)
        self.fd = None

    def _time(self) -> str:
        """UTC with milliseconds; the part down to the second is formatted once a second."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"


def _open_append(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)


def _is_pipe(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _pieces(data: bytes, limit: int) -> list[bytes]:
    """`data` cut after newlines into pieces of at most `limit` bytes (a longer line is
    a piece of its own)."""
    pieces = []
    start = 0
    while len(data) - start > limit:
        cut = data.rfind(b"\n", start, start + limit)
        end = cut + 1 if cut >= start else data.index(b"\n", start + limit) + 1
        pieces.append(data[start:end])
        start = end
    if start < len(data):
        pieces.append(data[start:])
    return pieces


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a short write to a pipe or file: write the rest
        written = os.write(fd, view)
        view = view[written:]


def _quoted(text: str | None) -> str:
    return orjson.dumps(text).decode() if text else "-"
