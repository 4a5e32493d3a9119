"""httpx clients for tests, all on one TLS context made once.

httpx builds a new SSLContext for every client, parsing the whole CA bundle: ~30 ms on
an idle machine, 350 ms beside two CPU hogs, and all of it blocks the event loop. In
most tests that loop also runs the simulated replicas and their taps, so a test polling
/metrics with a fresh client each time starved its own replicas: their health probes
timed out (2 s, twice) and the gateway rightly took them out of service
(tests/serving/test_workers.py failed 4 runs in 5 under hogs that way). Test clients
speak plain HTTP to loopback; the one context is there only because httpx insists.
"""

from __future__ import annotations

import ssl
from typing import Any

import httpx

TLS = ssl.create_default_context()


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    """An `httpx.AsyncClient` that costs no CA-bundle parse to make (``verify``: a
    context of a test CA's, made once by the caller)."""
    return httpx.AsyncClient(**{"verify": TLS, **kwargs})
