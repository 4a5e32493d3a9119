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
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import expect
from tests.support.console import MODEL, Browser, ConsoleStack, browser, console_stack
from tests.support.waiting import eventually_blocking

from saltgate.console.security import COOKIE, CSP, SESSION_IDLE_S, SIGN_IN_PER_KEY
from saltgate.http import HttpServer, Request, Response
from saltgate.prices import Price, PriceVersion
from saltgate.store.tenants import TenantStore

SENT = 7  # completions the first test sends before reading the pages
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


def admin_api(stack: ConsoleStack, path: str, **params: str) -> dict[str, Any]:
    """The admin API's answer to the signed-in token: what a page's twin must match."""
    answer = httpx.get(
        f"{stack.origin}/admin/v1/{path}",
        params=params,
        headers={"authorization": f"Bearer {stack.admin_token}"},
        timeout=30,
    )
    assert answer.status_code == 200, (path, answer.text)
    result: dict[str, Any] = answer.json()
    return result


def ledger_rows(stack: ConsoleStack) -> int:
    conn = sqlite3.connect(stack.state_dir / "saltgate.db")
    try:
        [(count,)] = conn.execute("SELECT count(*) FROM usage").fetchall()
    finally:
        conn.close()
    return int(count)


def first_table(b: Browser) -> list[dict[str, str]]:
    """The page's first table as the person reads it: one {header: cell text} a row."""
    table = b.page.locator("main > table").first  # not a chart's legend
    headers = table.locator("thead th").all_inner_texts()
    return [
        dict(zip(headers, row.locator("td").all_inner_texts(), strict=True))
        for row in table.locator("tbody tr").all()
    ]


def tiles(b: Browser) -> dict[str, str]:
    labels = b.page.locator(".tile .label").all_inner_texts()
    return dict(zip(labels, b.page.locator(".tile .value").all_inner_texts(), strict=True))


def usage_sums(stack: ConsoleStack, twin: dict[str, Any]) -> dict[str, int]:
    """The usage API's answer for a twin's range, summed per field as the overview adds
    them up."""
    usage = admin_api(
        stack,
        "usage/completions",
        start_time=str(twin["start_time"]),
        bucket_width=twin["bucket_width"],
        limit="168",  # the most a bucket width of 1h allows
    )
    fields = ("num_model_requests", "input_tokens", "input_cached_tokens", "output_tokens")
    return {f: sum(r[f] for b in usage["data"] for r in b["results"]) for f in fields}


def without_last_use(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keys and tokens without their last use, which a write once a minute may move
    between the twin's read and the API's."""
    return [{k: v for k, v in item.items() if k != "last_used_at"} for item in items]


@dataclass
class Seen:
    """What the test did before reading the pages, which they must show."""

    tenant_id: str
    key_id: str
    token_id: str
    started: float


def check_overview(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    assert tiles(b)["Requests"] == str(SENT)
    sums = usage_sums(stack, twin)
    assert sums["num_model_requests"] == SENT
    assert {k: twin["totals"][k] for k in sums} == sums


def check_usage(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    """The default view: prompt tokens over 24 h, not grouped."""
    prompt = usage_sums(stack, twin)["input_tokens"]
    assert prompt > 0 and twin["totals"] == [{"group": "all", "total": prompt}]
    assert first_table(b) == [{"Group": "all", "Prompt tokens": f"{prompt:,}"}]


def check_tenants(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    listed = admin_api(stack, "tenants")["data"]
    assert [
        {k: t[k] for k in api} for t, api in zip(twin["tenants"], listed, strict=True)
    ] == listed
    assert [(t["id"], t["name"], t["live_keys"]) for t in twin["tenants"]] == [
        (seen.tenant_id, "acme", 1)
    ]
    [row] = first_table(b)
    assert (row["Tenant"], row["Id"], row["Live keys"]) == ("acme", seen.tenant_id, "1")


def check_keys(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    listed = admin_api(stack, f"tenants/{seen.tenant_id}/keys")["data"]
    assert without_last_use(twin["keys"]) == without_last_use(listed)
    [row] = first_table(b)
    assert (row["Key id"], row["State"]) == (seen.key_id, "live")


def check_fleet(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    replica = stack.sim.url
    replicas = [(r["replica"], r["healthy"], r["canary"]) for r in twin["replicas"]]
    assert replicas == [(replica, True, "pass")]
    [row] = first_table(b)
    assert (row["Replica"], row["Health"], row["Isolation canary"]) == (
        replica,
        "healthy",
        "pass",
    )


def check_audit(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    """The tenant's creation: by the signed-in token, at a time shown (the API's
    `effective_at`), within the test."""
    assert twin["entries"] == admin_api(stack, "audit_logs", limit="50")["data"]
    rows = first_table(b)
    created = [r for r in rows if (r["What"], r["Resource"]) == ("tenant.created", seen.tenant_id)]
    assert len(created) == 1, f"one tenant.created row of {seen.tenant_id}: {rows}"
    assert created[0]["Who"] == seen.token_id, created
    assert created[0]["Time"], f"no time shown: {created}"
    at = datetime.strptime(created[0]["Time"], "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
    # Shown to the second, so up to a second before the test's start.
    assert seen.started - 1 <= at.timestamp() <= time.time(), created


def check_admin_tokens(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    listed = admin_api(stack, "admin_tokens")["data"]
    assert without_last_use(twin["admin_tokens"]) == without_last_use(listed)
    [row] = first_table(b)
    assert (row["Id"], row["State"]) == (seen.token_id, "live")


def check_prices(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    assert twin["prices"] == admin_api(stack, "prices")["data"]
    [row] = first_table(b)
    assert (row["Model"], row["Output / Mtok"], row["Source"]) == (MODEL, "$8.000000", "config")


def check_tenant(b: Browser, stack: ConsoleStack, twin: dict[str, Any], seen: Seen) -> None:
    assert twin["tenant"] == admin_api(stack, f"tenants/{seen.tenant_id}")
    [row] = first_table(b)
    assert (row["Name"], row["Id"]) == ("acme", seen.tenant_id)


PageCheck = Callable[[Browser, ConsoleStack, dict[str, Any], Seen], None]
CHECKS: dict[str, PageCheck] = {
    "overview": check_overview,
    "usage": check_usage,
    "tenants": check_tenants,
    "keys": check_keys,
    "fleet": check_fleet,
    "audit": check_audit,
    "admin-tokens": check_admin_tokens,
    "prices": check_prices,
    "tenant": check_tenant,
}


def test_every_page_loads_clean_with_its_json_twin(tmp_path: Path) -> None:
    """Every page shows what was done before it was read (the tenant, its key, the
    requests, who did it and when), without an error notice, and its .json twin holds
    what the admin API answers the same query."""
    shots = shots_dir(tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    started = time.time()
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
        tenant_id = tenant_page.removeprefix("tenants/")
        b.page.goto(stack.console_url + "keys")
        b.page.click("form[data-form=create-key] button")
        key = b.page.inner_text("code.secret")
        for i in range(SENT - 1):  # the same prompt: cache hits after the first
            assert stack.complete(key, stream=i % 2 == 1).status_code == 200
        b.page.goto(stack.console_url + "overview")  # a TTFT sample, then one more request
        assert stack.complete(key, stream=True).status_code == 200
        # A streamed request is recorded as its stream ends: the pages are read after.
        eventually_blocking(lambda: ledger_rows(stack) == SENT, what="every request recorded")
        [key_id] = [k["id"] for k in admin_api(stack, f"tenants/{tenant_id}/keys")["data"]]
        seen = Seen(tenant_id, key_id, admin_api(stack, "me")["id"], started)

        for name in (*PAGES, tenant_page):
            response = b.page.goto(stack.console_url + name)
            assert response is not None and response.status == 200, name
            headers = response.headers
            assert headers["content-security-policy"] == CSP.decode()
            assert not [h for h in headers if h.startswith("access-control-")], headers
            wait_for_charts(b)
            b.assert_clean()
            errors = b.page.locator(".notice.error").all_inner_texts()
            assert errors == [], (name, errors)
            twin = b.page.request.get(stack.console_url + name + ".json")
            assert twin.status == 200, name
            shot = "tenant" if name == tenant_page else name
            CHECKS[shot](b, stack, twin.json(), seen)
            b.page.screenshot(path=str(shots / f"{shot}.png"), full_page=True)
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

        # Set a limit: one request a minute; the requests above already used it. And the
        # tenant's fair-share weight, its own setting shown beside the limits (issue 42).
        b.page.goto(stack.console_url + f"tenants/{tenant_id}")
        b.page.fill("form[data-form=limits] input[name=rpm]", "1")
        b.page.fill("form[data-form=limits] input[name=weight]", "2.5")
        # A budget in dollars and days, as the CLI takes it (issue 41).
        b.page.fill("form[data-form=limits] input[name=budget_usd]", "1000.5")
        b.page.fill("form[data-form=limits] input[name=budget_period]", "30d")
        b.page.click("form[data-form=limits] button")
        b.page.wait_for_url(f"**/console/tenants/{tenant_id}?done=*")
        assert "rpm=1 budget=$1000.5/30d" in b.page.inner_text("main")
        assert b.page.locator("main table td").nth(6).inner_text() == "2.5"  # Weight
        twin = b.page.request.get(stack.console_url + f"tenants/{tenant_id}.json").json()
        assert (twin["tenant"]["weight"], twin["tenant"]["limits"]["rpm"]) == (2.5, 1)
        assert b.page.input_value("form[data-form=limits] input[name=weight]") == "2.5"
        assert b.page.input_value("form[data-form=limits] input[name=budget_period]") == "30d"
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
        for _ in range(2 * SIGN_IN_PER_KEY):  # successes count nothing
            again = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
            assert again.status_code == 303
        # Everyone behind the SSH tunnel is 127.0.0.1: another client's failures (with
        # other tokens) use up their own budget, not the operator's.
        wrong = "sgadm_wrong" + "x" * 40
        for _ in range(SIGN_IN_PER_KEY):
            assert post(stack, "sign-in", {"token": wrong}, None, stack.origin).status_code == 401
        limited = post(stack, "sign-in", {"token": wrong}, None, stack.origin)
        assert limited.status_code == 429
        assert "set-cookie" not in limited.headers
        ok = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
        assert ok.status_code == 303
        # The operator's own mistyped token (their prefix) does meet the limit.
        typo = stack.admin_token[:-3] + "zzz"
        for _ in range(SIGN_IN_PER_KEY):
            assert post(stack, "sign-in", {"token": typo}, None, stack.origin).status_code == 401
        limited = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
        assert limited.status_code == 429


def test_done_shows_only_the_console_s_own_messages(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        ok = post(stack, "sign-in", {"token": stack.admin_token}, None, stack.origin)
        cookie = ok.cookies[COOKIE]
        known = get(stack, "overview", cookie, params={"done": "limits-saved"})
        assert "Limits saved." in known.text  # the control: a code of ours is shown
        phish = "Session expired. Re-enter your admin token at https://evil.example/saltgate"
        page = get(stack, "overview", cookie, params={"done": phish})
        assert page.status_code == 200
        assert "evil.example" not in page.text and "Session expired" not in page.text
        assert 'role="status"' not in page.text
