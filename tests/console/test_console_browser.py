"""The console as a person uses it: Debian's Chromium, driven by playwright, on a real
gateway stack (tests/support/console.py). Every page and form; the security properties
(cross-origin posts, expired and signed-out sessions, sign-in rate limit) each beside the
control that shows the test would see them broken.

`SALTGATE_CONSOLE_SHOTS=docs/console` saves the pages' screenshots there (docs/console.md).
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import expect
from tests.support.console import MODEL, Browser, ConsoleStack, browser, console_stack

from saltgate.console.security import COOKIE, CSP, SESSION_IDLE_S, SIGN_IN_PER_CLIENT
from saltgate.http import HttpServer, Request, Response
from saltgate.prices import Price, PriceVersion
from saltgate.store.tenants import TenantStore

PAGES = ("overview", "usage", "tenants", "keys", "fleet", "audit", "admin-tokens", "prices")


def shots_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get("SALTGATE_CONSOLE_SHOTS") or tmp_path / "shots")


def wait_for_charts(b: Browser) -> None:
    """Every chart on the page drawn (or said to have no data) by static/console.js."""
    # A locator, not wait_for_function: that evaluates a string, which the CSP refuses.
    expect(b.page.locator("[data-chart]:not([data-drawn='1'])")).to_have_count(0)


def get(stack: ConsoleStack, path: str, cookie: str | None, **kw: Any) -> httpx.Response:
    cookies = {COOKIE: cookie} if cookie else {}
    return httpx.get(stack.console_url + path, cookies=cookies, timeout=30, **kw)


def post(
    stack: ConsoleStack, path: str, data: dict[str, str], cookie: str | None, origin: str
) -> httpx.Response:
    cookies = {COOKIE: cookie} if cookie else {}
    return httpx.post(
        stack.console_url + path, data=data, cookies=cookies, headers={"origin": origin}, timeout=30
    )


def last_price_version(stack: ConsoleStack) -> str | None:
    """The price version of the ledger's newest record."""
    conn = sqlite3.connect(stack.state_dir / "saltgate.db")
    try:
        row = conn.execute("SELECT price_version FROM usage ORDER BY rowid DESC LIMIT 1").fetchone()
    finally:
        conn.close()
    return None if row is None else str(row[0])


def tenant_names(stack: ConsoleStack) -> set[str]:
    with TenantStore.from_state_dir(stack.state_dir) as store:
        return {t.name for t in store.list_tenants()}


def test_every_page_loads_clean_with_its_json_twin(tmp_path: Path) -> None:
    shots = shots_dir(tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with console_stack(tmp_path) as stack, browser(stack) as b:
        b.page.goto(stack.console_url)
        b.page.wait_for_url("**/console/sign-in")
        b.page.screenshot(path=str(shots / "sign-in.png"), full_page=True)
        b.sign_in(stack)
        # Some traffic and a tenant of our own, so the pages have something to show.
        b.page.goto(stack.console_url + "tenants")
        b.page.fill("form[data-form=create-tenant] input[name=name]", "acme")
        b.page.click("form[data-form=create-tenant] button")
        b.page.wait_for_url("**/console/tenants/tn_*")
        tenant_page = b.page.url.split("/console/")[1].split("?")[0]
        b.page.goto(stack.console_url + "keys")
        b.page.click("form[data-form=create-key] button")
        key = b.page.inner_text("code.secret")
        for i in range(6):  # the same prompt: cache hits after the first
            assert stack.complete(key, stream=i % 2 == 1).status_code == 200
        b.page.goto(stack.console_url + "overview")  # a TTFT sample, then one more request
        assert stack.complete(key, stream=True).status_code == 200

        for name in (*PAGES, tenant_page):
            response = b.page.goto(stack.console_url + name)
            assert response is not None and response.status == 200, name
            headers = response.headers
            assert headers["content-security-policy"] == CSP.decode()
            assert not [h for h in headers if h.startswith("access-control-")], headers
            wait_for_charts(b)
            b.assert_clean()
            twin = b.page.request.get(stack.console_url + name + ".json")
            assert twin.status == 200, name
            assert isinstance(twin.json(), dict)
            shot = "tenant" if name == tenant_page else name
            b.page.screenshot(path=str(shots / f"{shot}.png"), full_page=True)
        # The twin holds the page's data: the tenant made above, by name.
        tenants = b.page.request.get(stack.console_url + "tenants.json").json()["tenants"]
        assert "acme" in {t["name"] for t in tenants}
    assert {p.stem for p in shots.glob("*.png")} >= {*PAGES, "tenant", "sign-in"}


def test_forms_tenant_key_limit_usage_and_revocation(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack, browser(stack) as b:
        b.sign_in(stack)
        b.page.goto(stack.console_url + "tenants")
        b.page.fill("form[data-form=create-tenant] input[name=name]", "shop")
        b.page.click("form[data-form=create-tenant] button")
        b.page.wait_for_url("**/console/tenants/tn_*")
        assert "shop" in tenant_names(stack)
        tenant_id = b.page.url.split("/tenants/")[1].split("?")[0]

        # Mint a key and call the inference API with it.
        b.page.goto(stack.console_url + f"keys?tenant={tenant_id}")
        b.page.click("form[data-form=create-key] button")
        key = b.page.inner_text("code.secret")
        assert key.startswith("sg_")
        assert stack.complete(key).status_code == 200

        # The usage chart after that traffic: a point drawn from the ledger's rollups.
        b.page.goto(stack.console_url + "usage?metric=num_model_requests&group_by=tenant&range=1h")
        wait_for_charts(b)
        assert int(b.page.get_attribute("[data-chart]", "data-points") or 0) >= 1
        assert "shop" in b.page.inner_text("table") or tenant_id in b.page.inner_text("table")
        href = b.page.get_attribute("text=Download as CSV", "href") or ""
        csv = b.page.request.get(stack.origin + href)
        assert csv.status == 200 and csv.headers["content-type"].startswith("text/csv")
        header, *rows = csv.text().splitlines()
        assert header.startswith("start_time,end_time,tenant_id,api_key_id,model,replica,num_model")
        assert any(r.split(",")[2] == tenant_id for r in rows), rows
        b.assert_clean()

        # Set the model's price over the config's, see the key billed with it, clear it.
        b.page.goto(stack.console_url + "prices")
        assert "config" in b.page.inner_text("table")
        for name, value in (
            ("model", MODEL),
            ("input_per_mtok", "3"),
            ("cached_input_per_mtok", "0.3"),
            ("output_per_mtok", "12.5"),
        ):
            b.page.fill(f"form[data-form=set-price] input[name={name}]", value)
        b.page.click("form[data-form=set-price] button")
        b.page.wait_for_url("**/console/prices?done=*")
        new = PriceVersion.of(MODEL, Price(3.0, 0.3, 12.5)).version
        assert new in b.page.inner_text("table")
        twin = b.page.request.get(stack.console_url + "prices.json").json()["prices"]
        assert [(p["source"], p["version"], p["output_per_mtok"]) for p in twin] == [
            ("store", new, "12.500000")
        ]
        deadline = time.monotonic() + 10
        while last_price_version(stack) != new:
            assert stack.complete(key).status_code == 200 and time.monotonic() < deadline
        b.page.click(f"form[data-form='clear-price-{MODEL}'] button")
        b.page.wait_for_url("**/console/prices?done=*")
        twin = b.page.request.get(stack.console_url + "prices.json").json()["prices"]
        assert [p["source"] for p in twin] == ["config"]
        assert b.page.locator("form[data-form^=clear-price-]").count() == 0
        b.assert_clean()

        # Set a limit: one request a minute; the requests above already used it. And a
        # fair-share weight, kept beside it (saving the form again keeps it).
        b.page.goto(stack.console_url + f"tenants/{tenant_id}")
        b.page.fill("form[data-form=limits] input[name=rpm]", "1")
        b.page.fill("form[data-form=limits] input[name=weight]", "2.5")
        b.page.click("form[data-form=limits] button")
        b.page.wait_for_url(f"**/console/tenants/{tenant_id}?done=*")
        assert "rpm 1, weight 2.5" in b.page.inner_text("main")
        assert b.page.input_value("form[data-form=limits] input[name=weight]") == "2.5"
        deadline = time.monotonic() + 10
        while (status := stack.complete(key).status_code) != 429:
            assert status == 200 and time.monotonic() < deadline, f"no 429 under rpm 1: {status}"

        # Revoke the key and see it refused.
        b.page.goto(stack.console_url + f"keys?tenant={tenant_id}")
        b.page.click("form[data-form^=revoke-] button")
        b.page.wait_for_url("**/console/keys?*done=*")
        assert "revoked" in b.page.inner_text("table")
        deadline = time.monotonic() + 10
        while (status := stack.complete(key).status_code) != 401:
            assert time.monotonic() < deadline, f"a revoked key still answered {status}"
        b.assert_clean()


def test_a_post_from_another_origin_is_refused(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack, browser(stack) as b:
        b.sign_in(stack)
        cookie = b.session_cookie()

        # Another site (localhost is another site than 127.0.0.1) posting to the console
        # from the signed-in browser.
        attack = (
            "<!doctype html><form id=f method=post action="
            f"'{stack.console_url}tenants'><input name=name value=evil></form>"
            "<script>document.getElementById('f').submit()</script>"
        ).encode()

        async def serve(request: Request) -> Response:
            return Response(200, [(b"content-type", b"text/html")], attack)

        server = HttpServer(serve)
        port = stack.loop.run(server.start("127.0.0.1", 0))
        evil = f"http://localhost:{port}"
        b.watch.also.add(evil)
        try:
            with b.page.expect_response(stack.console_url + "tenants") as answer:
                b.page.goto(evil + "/")
            assert answer.value.status == 403
        finally:
            stack.loop.run(server.close())
        assert "evil" not in tenant_names(stack)

        # The origin check alone: even with the session cookie attached (a browser without
        # SameSite), another origin is refused, while this origin is served.
        refused = post(stack, "tenants", {"name": "evil2"}, cookie, evil)
        assert refused.status_code == 403
        assert "evil2" not in tenant_names(stack)
        served = post(stack, "tenants", {"name": "mine"}, cookie, stack.origin)
        assert served.status_code == 303
        assert "mine" in tenant_names(stack)


def test_expired_and_signed_out_sessions_are_refused(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack, browser(stack) as b:
        b.sign_in(stack)
        cookie = b.session_cookie()
        assert get(stack, "overview.json", cookie).status_code == 200  # the control

        sessions = stack.console.sessions
        sessions.clock = lambda: time.monotonic() + SESSION_IDLE_S + 1
        try:
            assert get(stack, "overview.json", cookie).status_code == 401
            b.page.goto(stack.console_url + "tenants")
            b.page.wait_for_url("**/console/sign-in")
        finally:
            sessions.clock = time.monotonic

        b.sign_in(stack)
        cookie = b.session_cookie()
        assert get(stack, "tenants.json", cookie).status_code == 200  # the control
        b.page.click("form[data-form=sign-out] button")
        b.page.wait_for_url("**/console/sign-in")
        assert get(stack, "tenants.json", cookie).status_code == 401
        page = get(stack, "tenants", cookie, follow_redirects=False)
        assert page.status_code == 303 and page.headers["location"] == "/console/sign-in"
        b.assert_clean()


def test_session_cookie_is_httponly_strict_and_sign_in_is_rate_limited(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        ok = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
        assert ok.status_code == 303  # the control: the right token signs in
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/console/" in cookie
        assert stack.admin_token not in cookie
        for _ in range(SIGN_IN_PER_CLIENT - 1):
            wrong = post(stack, "sign-in", {"token": "sgadm_wrong"}, None, stack.origin)
            assert wrong.status_code == 401
        limited = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
        assert limited.status_code == 429
        assert "set-cookie" not in limited.headers
