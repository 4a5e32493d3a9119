"""A gateway stack with its admin listener, and a real browser on its console, for one test.

The stack (a simulated replica and the gateway, as `start_gateway` composes them) runs on
an event loop of its own thread, so a test drives Chromium through playwright's sync API
and calls the inference API with httpx while the gateway serves. The browser is Debian's
Chromium (/usr/bin/chromium, scripts/services-setup.sh): playwright downloads none. A
test that needs it and does not find it fails, saying what is missing.

Every page the browser opens is watched: a Content-Security-Policy violation, a request
off the console's origin (refused, never sent) and a console error are recorded, and
`Browser.assert_clean` fails on any.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import pytest
from tests.support.gateways import cli

from saltgate.config import GatewayConfig, ReplicaConfig, create_master_key
from saltgate.console.app import Console
from saltgate.prices import Price
from saltgate.serving.run import RunningGateway, start_gateway
from saltgate.sim.run import RunningSim, SimConfig, start_sim

CHROMIUM = Path("/usr/bin/chromium")
MODEL = "sim-model"
PROMPT = "The console shows what this tenant sent and what the cache kept. " * 12
T = TypeVar("T")

# Runs in every page before its own scripts (playwright injects it; the page's CSP does
# not apply to it): collects the page's CSP violation events.
_WATCH_CSP = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(e.violatedDirective + " " + e.blockedURI);
});
"""


class _Loop:
    """An event loop on its own thread, for the gateway stack."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        done: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return done.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class ConsoleStack:
    """The gateway (inference on `url`, the console on `console_url`) and a sign-in token."""

    running: RunningGateway
    sim: RunningSim
    state_dir: Path
    admin_token: str
    loop: _Loop

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def origin(self) -> str:
        config = self.running.gateway.config
        scheme = "https" if config.admin_tls_cert_file is not None else "http"
        return f"{scheme}://{config.admin_host}:{self.running.admin_port}"

    @property
    def console_url(self) -> str:
        return self.origin + "/console/"

    @property
    def console(self) -> Console:
        assert self.running.console is not None
        return self.running.console

    def complete(self, api_key: str, *, stream: bool = False) -> httpx.Response:
        """One completion on the inference port with `api_key` (read to its end); the
        same long prompt each time, so repeats hit the replica's prefix cache."""
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
        headers = {"authorization": f"Bearer {api_key}"}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=30)


@contextmanager
def console_stack(tmp_path: Path, **options: Any) -> Iterator[ConsoleStack]:
    """A simulated replica and a gateway serving its admin listener on a free port, with
    prices (so the console shows cost) and an admin token of every scope, minted as an
    operator does (`saltgate admin-tokens create --scopes all`); `options` are more
    GatewayConfig fields."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    create_master_key(state / "master.key")
    token = cli("admin-tokens", "create", "--scopes", "all", "--state-dir", str(state))
    loop = _Loop()
    sim = loop.run(start_sim(SimConfig(port=0, model=MODEL)))
    config = GatewayConfig(
        replicas=(ReplicaConfig(sim.url),),
        state_dir=state,
        master_key_file=state / "master.key",
        port=0,
        admin_port=0,
        prices={MODEL: Price(2.0, 0.5, 8.0)},
        **options,
    )
    running = loop.run(start_gateway(config))
    try:
        yield ConsoleStack(running, sim, state, token, loop)
    finally:
        loop.run(running.close())
        loop.run(sim.close())
        loop.close()


@dataclass
class Watch:
    """What a page did that it must not: CSP violations, requests off its origin, errors."""

    origin: str
    also: set[str] = field(default_factory=set)  # other origins a test serves on purpose
    off_origin: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass
class Browser:
    page: Any  # playwright.sync_api.Page
    context: Any  # playwright.sync_api.BrowserContext
    watch: Watch

    def csp_violations(self) -> list[str]:
        found = self.page.evaluate("window.__csp || []")
        return [str(v) for v in found]

    def assert_clean(self) -> None:
        """No CSP violation, no request off the origin, no console error so far."""
        assert self.csp_violations() == [], f"CSP violations: {self.csp_violations()}"
        assert self.watch.off_origin == [], f"requests off the origin: {self.watch.off_origin}"
        assert self.watch.errors == [], f"console errors: {self.watch.errors}"

    def sign_in(self, stack: ConsoleStack, token: str | None = None) -> None:
        self.page.goto(stack.console_url + "sign-in")
        self.page.fill("input[name=token]", token or stack.admin_token)
        self.page.click("form[data-form=sign-in] button")
        self.page.wait_for_url("**/console/overview")
        # The overview's charts fetch its .json twin after the page loads: done before a
        # test moves on (say, expires the session under a fetch still in flight).
        self.page.wait_for_load_state("networkidle")

    def session_cookie(self) -> str:
        values = [c["value"] for c in self.context.cookies() if c["name"] == "saltgate_console"]
        assert values, "no session cookie"
        return str(values[0])


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@contextmanager
def browser(stack: ConsoleStack) -> Iterator[Browser]:
    """A fresh Chromium page, watched (see the module doc)."""
    if not CHROMIUM.exists():
        pytest.fail(
            f"Chromium is missing ({CHROMIUM}): the console's browser tests drive Debian's "
            "chromium package; install it with scripts/services-setup.sh (make services)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright package is missing: make install (the dev extra has it)")
    watch = Watch(stack.origin)
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        context = chromium.new_context(viewport={"width": 1280, "height": 900})
        context.add_init_script(_WATCH_CSP)

        def gate(route: Any) -> None:
            if _origin(route.request.url) in (watch.origin, *watch.also):
                route.continue_()
            else:
                watch.off_origin.append(route.request.url)
                route.abort()

        context.route("**/*", gate)
        page = context.new_page()
        page.on(
            "console",
            lambda msg: watch.errors.append(msg.text) if msg.type == "error" else None,
        )
        page.on("pageerror", lambda exc: watch.errors.append(str(exc)))
        try:
            yield Browser(page, context, watch)
        finally:
            context.close()
            chromium.close()
