"""Which build of saltgate is running: compiled with mypyc, or pure Python.

`make install-compiled` builds a wheel whose request-path modules (COMPILED_MODULES) are
C extensions (setup.py) and installs it, not editable; `make install` installs the
sources, editable, and so replaces it. Both builds run the same source; the compiled one
spends about a third less CPU per request (docs/benchmarks.md).

The build a module came from is read off its file: an extension module is compiled. A
wheel built with the compiled build asked for records in `_build.json` what it got, and
why it fell back to pure Python when the compiler failed.

A compiled coroutine never suspends inside an except or finally block (nor uses
`async with`, whose exit runs in one; nor does a compiled generator yield in one): mypyc
gives it no exception state of its own, so
while it waits there the exception it handles is the whole thread's `sys.exc_info()`,
and after a `finally` it can stay there. Every other task then chains its errors to it,
and the build crashed under client aborts amid other requests. The modules keep the
exception, leave the handler, then await (tests/architecture/test_builds.py checks the
source; ExceptionWatch in tests/support/exceptions.py the running gateway).

This module stays interpreted: it must answer in both builds, and the build (setup.py)
reads COMPILED_MODULES from this file without importing the package.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
from pathlib import Path
from typing import Final

COMPILED: Final = "compiled"
PURE: Final = "pure Python"
BUILD_RECORD: Final = "_build.json"

# The request path: what a request passes through from the socket to the ledger and back.
# Not the tools on top (cli, audit, client, sim, demo): they run once per command
# and would only lengthen the build.
COMPILED_MODULES: Final = (
    "saltgate.derivations.derive",
    "saltgate.derivations.encoding",
    "saltgate.derivations.labels",
    "saltgate.ehbp.frames",
    "saltgate.gateway.access_log",
    "saltgate.gateway.cluster",
    "saltgate.gateway.context",
    "saltgate.gateway.ehbp",
    "saltgate.gateway.exchange",
    "saltgate.gateway.fairshare",
    "saltgate.gateway.governor",
    "saltgate.gateway.metrics",
    "saltgate.gateway.replicas",
    "saltgate.gateway.server",
    "saltgate.gateway.usage",
    "saltgate.governance.placement",
    "saltgate.http.client",
    "saltgate.http.server",
    "saltgate.policy.errors",
    "saltgate.policy.forwarded",
    "saltgate.policy.headers",
    "saltgate.policy.request",
    "saltgate.routing.affinity",
    "saltgate.routing.baselines",
    "saltgate.routing.cluster",
    "saltgate.routing.domain",
    "saltgate.routing.health",
    "saltgate.routing.hotkeys",
    "saltgate.routing.rendezvous",
    "saltgate.routing.router",
    "saltgate.routing.state",
    "saltgate.serving.acceptor",
    "saltgate.store.db",
    "saltgate.store.errors",
    "saltgate.store.ledger",
    "saltgate.store.sqlite",
    "saltgate.store.tenants",
)


def is_compiled(module: str) -> bool:
    """Whether `module` loads from an extension module (without importing it)."""
    spec = importlib.util.find_spec(module)
    origin = spec.origin if spec is not None else None
    return origin is not None and origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def build_kind() -> str:
    """COMPILED when every request-path module is, PURE when none is; anything between
    is a broken install, and says how many modules are compiled."""
    compiled = [m for m in COMPILED_MODULES if is_compiled(m)]
    if len(compiled) == len(COMPILED_MODULES):
        return COMPILED
    if not compiled:
        return PURE
    return f"mixed: {len(compiled)} of {len(COMPILED_MODULES)} modules compiled (reinstall)"


def package_dir() -> Path:
    return Path(__file__).resolve().parent


def build_record() -> dict[str, str]:
    """What setup.py wrote about a compiled build it was asked for; empty otherwise."""
    try:
        record = json.loads((package_dir() / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in record.items()} if isinstance(record, dict) else {}


def describe() -> str:
    """The build, as `saltgate --version` says it: with the fallback's reason, if any."""
    kind = build_kind()
    reason = build_record().get("fallback_reason")
    if kind == PURE and reason:
        return f"{PURE}: the compiled build fell back ({reason})"
    return kind
