"""Escaping is the console's default (issue 41): every helper of saltgate.console.html
escapes the text it is given unless it is Markup, and an attacker's text (a model name
in the store, a URL's query) reaches every page as text, never as markup."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from tests.support.console import ConsoleStack, console_stack

from saltgate.console import html
from saltgate.console.html import EMPTY, Markup, esc, fmt, raw
from saltgate.console.security import COOKIE

PAYLOAD = '"><img src=x onerror=alert(1)><script>alert(2)</script>'
RAW = ("<img src=x", "<script>alert")
PAGES = ("overview", "usage", "tenants", "keys", "fleet", "audit", "admin-tokens", "prices")
PARAMS = ("tenant", "after", "range", "group_by", "metric", "bucket_width", "done")


@pytest.mark.unit
def test_the_helpers_escape_text_and_pass_markup() -> None:
    cell = html.table(["h<1>"], [("<b>", esc("<i>"), raw("<em>ok</em>"))])
    assert "<td>&lt;b&gt;</td><td>&lt;i&gt;</td><td><em>ok</em></td>" in cell
    assert "<th>h&lt;1&gt;</th>" in cell
    assert fmt("<p>{}</p>", "<x>") == "<p>&lt;x&gt;</p>"
    assert raw("<p>") + "<x>" == "<p>&lt;x&gt;"  # what is added to markup is escaped
    assert "<x>" + raw("<p>") == "&lt;x&gt;<p>"
    assert EMPTY.join(["<a>", raw("<b>")]) == "&lt;a&gt;<b>"
    assert isinstance(raw("<p>") + "x", Markup)
    form = html.form("/a", "<input name=x>", "Go<")
    assert "&lt;input name=x&gt;" in form and "Go&lt;" in form  # a plain str field is text
    assert b"&lt;script&gt;" in html.page("t", "<script>")
    assert html.notice("<b>") == '<p class="notice info" role="status">&lt;b&gt;</p>'


def _put_model_name(stack: ConsoleStack, tenant_id: str) -> None:
    """Data in the store is data: a model name written past the API's validation."""
    conn = sqlite3.connect(stack.state_dir / "saltgate.db")
    try:
        conn.execute(
            "UPDATE tenants SET allowed_models = ? WHERE id = ?",
            (json.dumps(["sim-model", PAYLOAD]), tenant_id),
        )
        conn.commit()
    finally:
        conn.close()


def test_attacker_text_renders_escaped_on_every_page(tmp_path: Path) -> None:
    with console_stack(tmp_path) as stack:
        auth = {"authorization": f"Bearer {stack.admin_token}"}
        made = httpx.post(f"{stack.origin}/admin/v1/tenants", json={"name": "acme"}, headers=auth)
        tenant_id = made.json()["id"]
        _put_model_name(stack, tenant_id)
        signed_in = httpx.post(
            stack.console_url + "sign-in",
            data={"token": stack.admin_token},
            headers={"origin": stack.origin},
        )
        cookies = {COOKIE: signed_in.cookies[COOKIE]}
        query = dict.fromkeys(PARAMS, PAYLOAD)
        shown = 0
        for page in (*PAGES, f"tenants/{tenant_id}"):
            for params in ({}, query):
                text = httpx.get(stack.console_url + page, params=params, cookies=cookies).text
                assert not [r for r in RAW if r in text], f"{page} {params}: {text[:2000]}"
                shown += "&lt;img src=x" in text
        assert shown >= 2  # the control: the payload did reach pages, as text
