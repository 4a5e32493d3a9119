"""The admin listener as a whole (issue 41): /metrics behind a token, `Host` checked, a
pinned session shown nothing of another tenant on any page, an access log, TLS.

Each security property beside its control: the request the protection lets through.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from tests.support.console import ConsoleStack, browser, console_stack
from tests.support.gateways import cli
from tests.support.tls import make_pki
from tests.support.waiting import eventually_blocking

from saltgate.console.security import COOKIE
from saltgate.store.tenants import TenantStore

PAGES = ("overview", "usage", "tenants", "keys", "fleet", "audit", "admin-tokens", "prices")


def mint(stack: ConsoleStack, scopes: str, tenant: str | None = None) -> str:
    pinned = ("--tenant", tenant) if tenant else ()
    state = ("--state-dir", str(stack.state_dir))
    return cli("admin-tokens", "create", "--scopes", scopes, *pinned, *state)


def tenant_with_key(stack: ConsoleStack, name: str) -> tuple[str, str]:
    """A tenant and an API key, made over the admin API (the gateway serves them at once)."""
    auth = {"authorization": f"Bearer {stack.admin_token}"}
    tenant = httpx.post(f"{stack.origin}/admin/v1/tenants", json={"name": name}, headers=auth)
    tenant_id = tenant.json()["id"]
    key = httpx.post(f"{stack.origin}/admin/v1/tenants/{tenant_id}/keys", headers=auth)
    value = key.json()["value"]
    # A new key reaches the gateway's key snapshot within its refresh (issue 41 asks for
    # at once; that is the admin service's part): wait for it here.
    eventually_blocking(lambda: stack.complete(value).status_code == 200, what="the key served")
    return tenant_id, value


def metrics(stack: ConsoleStack, token: str | None, **kw: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{stack.origin}/metrics", headers=headers, timeout=30, **kw)


def sign_in(stack: ConsoleStack, token: str) -> str:
    answer = httpx.post(
        stack.console_url + "sign-in",
        data={"token": token},
        headers={"origin": stack.origin},
        timeout=30,
    )
    assert answer.status_code == 303, answer.text
    return answer.cookies[COOKIE]


def test_metrics_take_an_unpinned_usage_read_token(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        _, key = tenant_with_key(stack, "mine")
        assert stack.complete(key).status_code == 200
        ok = metrics(stack, stack.admin_token)  # the control: the operator's token reads it
        assert ok.status_code == 200 and "saltgate_tenant_requests_total{" in ok.text
        nobody = metrics(stack, None)
        assert nobody.status_code == 401 and "tenant_requests" not in nobody.text
        assert nobody.headers["www-authenticate"].startswith("Bearer")
        assert metrics(stack, "sgadm_" + "x" * 51).status_code == 401
        narrow = metrics(stack, mint(stack, "audit_log:read"))
        assert narrow.status_code == 403 and "usage:read" in narrow.text
        pinned = metrics(stack, mint(stack, "all", "mine"))
        assert pinned.status_code == 403 and "tenant_requests" not in pinned.text
        assert metrics(stack, mint(stack, "usage:read")).status_code == 200


def test_the_listener_answers_only_its_own_host_names(tmp_path: Path) -> None:
    with console_stack(tmp_path, admin_allowed_hosts=("admin.internal",)) as stack:
        port = stack.running.admin_port
        token = {"authorization": f"Bearer {stack.admin_token}"}
        hosts = (f"127.0.0.1:{port}", f"localhost:{port}", "admin.internal", "[::1]", "10.2.3.4")
        for host in hosts:  # names of the listener, and addresses (no rebinding by address)
            me = httpx.get(f"{stack.origin}/admin/v1/me", headers={**token, "host": host})
            assert me.status_code == 200, host  # the controls
        rebound = {"host": f"attacker.example:{port}"}
        for path in ("/metrics", "/admin/v1/me", "/console/sign-in"):
            answer = httpx.get(stack.origin + path, headers={**token, **rebound})
            assert answer.status_code == 421, path
            assert "tenant" not in answer.text
        posted = httpx.post(
            stack.console_url + "sign-in",
            data={"token": stack.admin_token},
            headers={**rebound, "origin": f"http://attacker.example:{port}"},
        )
        assert posted.status_code == 421 and "set-cookie" not in posted.headers


def _secrets_of(stack: ConsoleStack, other: str, other_key: str) -> list[str]:
    """What a page must not show a session pinned to another tenant."""
    with TenantStore.from_state_dir(stack.state_dir) as store:
        key_ids = [k.id for k in store.list_keys() if k.tenant_id == other]
    sim = stack.sim.url.removeprefix("http://")
    return [other, "other-tenant", *key_ids, other_key, sim, str(stack.state_dir)]


def test_a_pinned_session_sees_nothing_of_another_tenant_on_any_page(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        mine = tenant_with_key(stack, "mine")[0]
        other, other_key = tenant_with_key(stack, "other-tenant")
        for _ in range(3):  # the other tenant's traffic, streamed (TTFT) and not
            assert stack.complete(other_key, stream=True).status_code == 200
            assert stack.complete(other_key).status_code == 200
        mint(stack, "usage:read", "other-tenant")  # an admin token of the other tenant
        pinned = mint(stack, "all", "mine")
        hidden = _secrets_of(stack, other, other_key)

        operator = sign_in(stack, stack.admin_token)  # the control: the operator sees it all
        cookies = {COOKIE: operator}
        seen = "".join(
            httpx.get(f"{stack.console_url}{p}.json", cookies=cookies).text for p in PAGES
        )
        shown = [other, "other-tenant", stack.sim.url.removeprefix("http://"), str(stack.state_dir)]
        assert all(s in seen for s in shown), "the control saw nothing"
        overview = httpx.get(stack.console_url + "overview.json", cookies=cookies).json()
        assert overview["ttft"]["requests"] == 3

        with browser(stack) as b:
            b.sign_in(stack, pinned)
            cookie = b.session_cookie()
            for page in PAGES:
                b.page.goto(stack.console_url + page)
                shown = b.page.content()
                twin = httpx.get(f"{stack.console_url}{page}.json", cookies={COOKIE: cookie})
                for text in (shown, twin.text):
                    leaked = [s for s in hidden if s in text]
                    assert not leaked, f"{page} shows {leaked}"
            fleet = httpx.get(stack.console_url + "fleet.json", cookies={COOKIE: cookie})
            assert "pinned" in fleet.json()["error"] and "replicas" not in fleet.json()
            twin = httpx.get(stack.console_url + "overview.json", cookies={COOKIE: cookie})
            assert twin.json()["ttft"]["requests"] is None
            tenant = httpx.get(f"{stack.console_url}tenants/{mine}", cookies={COOKIE: cookie})
            assert tenant.status_code == 200 and not [s for s in hidden if s in tenant.text]
            b.assert_clean()


def test_the_admin_listener_logs_every_request_without_secrets(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    with console_stack(tmp_path, access_log=str(log), log_format="json") as stack:
        token = {"authorization": f"Bearer {stack.admin_token}"}
        me = httpx.get(f"{stack.origin}/admin/v1/me", headers=token).json()
        secret_query = "?api_key=sg_leaked_in_a_url"
        assert httpx.get(f"{stack.origin}/admin/v1/tenants{secret_query}", headers=token)
        wrong = {"authorization": "Bearer sgadm_" + "y" * 51}
        assert httpx.get(f"{stack.origin}/admin/v1/tenants", headers=wrong).status_code == 401
        scoped = {"authorization": f"Bearer {mint(stack, 'audit_log:read')}"}
        assert httpx.get(f"{stack.origin}/admin/v1/tenants", headers=scoped).status_code == 403
        failed = httpx.post(
            stack.console_url + "sign-in",
            data={"token": "sgadm_" + "z" * 51},
            headers={"origin": stack.origin},
        )
        assert failed.status_code == 401
        assert httpx.get(f"{stack.origin}/metrics", headers={"host": "evil.example"}).status_code
        cookie = sign_in(stack, stack.admin_token)
        assert httpx.get(stack.console_url + "tenants", cookies={COOKIE: cookie})

        def lines() -> list[dict[str, Any]]:
            text = log.read_text() if log.exists() else ""
            rows = [json.loads(line) for line in text.splitlines()]
            return [r for r in rows if r.get("listener") == "admin"]

        eventually_blocking(lambda: len(lines()) >= 8, what="the admin listener's lines")
        rows = lines()
        by = [(r["method"], r["route"], r["status"], r["admin_token_id"]) for r in rows]
        assert ("GET", "/admin/v1/me", 200, me["id"]) in by
        assert ("GET", "/admin/v1/tenants", 200, me["id"]) in by
        assert ("GET", "/admin/v1/tenants", 401, None) in by
        assert any(r[:3] == ("GET", "/admin/v1/tenants", 403) and r[3] for r in by)
        assert ("POST", "/console/sign-in", 401, None) in by
        assert ("GET", "/metrics", 421, None) in by
        assert ("GET", "/console/tenants", 200, me["id"]) in by
        assert all(r["client_addr"] and r["total_ms"] >= 0 for r in rows)
        text = log.read_text()
        assert stack.admin_token not in text and "sg_leaked" not in text
        assert "y" * 51 not in text and "z" * 51 not in text


def test_the_admin_listener_serves_tls_and_its_cookie_is_secure(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    files = {"admin_tls_cert_file": pki.server.cert, "admin_tls_key_file": pki.server.key}
    with console_stack(tmp_path, **files) as stack:
        assert stack.origin.startswith("https://")
        token = {"authorization": f"Bearer {stack.admin_token}"}
        me = httpx.get(f"{stack.origin}/admin/v1/me", headers=token, verify=str(pki.ca))
        assert me.status_code == 200
        plain = stack.origin.replace("https://", "http://")
        try:
            answer = httpx.get(f"{plain}/admin/v1/me", headers=token, timeout=5)
        except httpx.HTTPError:
            pass  # refused at the handshake: no token read in clear
        else:
            raise AssertionError(f"plain HTTP answered {answer.status_code}")
        signed_in = httpx.post(
            stack.console_url + "sign-in",
            data={"token": stack.admin_token},
            headers={"origin": stack.origin},
            verify=str(pki.ca),
        )
        assert signed_in.status_code == 303
        assert "; Secure" in signed_in.headers["set-cookie"]
