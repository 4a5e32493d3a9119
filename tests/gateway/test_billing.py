"""Billing what a replica really reported: vLLM without --enable-prompt-tokens-details
(the simulator told so) leaves cached tokens unknown in the ledger, the metrics, the log
and `saltgate usage`; each request is recorded with its cost (docs/billing.md)."""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

import httpx
import orjson
import pytest
from tests.gateway.stack import MODEL, Stack, ledger_rows, long_prompt, run, stack

from saltgate.cli import main as saltgate
from saltgate.prices import Price, PriceVersion
from saltgate.sim.run import SimConfig

PRICE = PriceVersion.of(MODEL, Price(1.0, 0.1, 2.0))  # the stack's [prices]
UNREPORTED = "saltgate_replica_cached_tokens_unreported_total"
WARNING = "reports no cached tokens"


async def _traffic(client: httpx.AsyncClient, details: bool) -> None:
    """The same prompt on completions (twice: the repeat hits the cache), a chat stream
    with usage, Anthropic messages whole and streamed."""
    prompt = long_prompt("bill")
    for _ in range(2):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/chat/completions", json=chat) as resp:
        assert resp.status_code == 200
        events = [line async for line in resp.aiter_lines() if '"usage"' in line]
    assert ("prompt_tokens_details" in orjson.loads(events[-1][5:])["usage"]) is details
    messages = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": prompt}]}
    for stream in (False, True):
        resp = await client.post("/v1/messages", json={**messages, "stream": stream})
        assert resp.status_code == 200


async def _metrics(s: Stack) -> str:
    return await s.scrape()


@pytest.mark.parametrize("details", [False, True])
def test_unreported_cached_tokens_are_recorded_unknown_counted_and_warned_once(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    details: bool,
) -> None:
    """Without the flag: every row NULL, priced at the full input price, the replica's
    counter at 5, one warning, "unknown" in the report. With it (the control): numbers,
    the repeat's cache hit billed at the cached price, no counter, no warning."""
    caplog.set_level(logging.WARNING, logger="saltgate")
    sim = SimConfig(port=0, enable_prompt_tokens_details=details)

    async def main() -> None:
        async with stack(tmp_path, replicas=1, sim=sim) as s, s.client("alice") as alice:
            await _traffic(alice, details)
            rows = ledger_rows(s)
            assert len(rows) == 5 and {r["status"] for r in rows} == {200}
            for row in rows:
                cached = row["cached_tokens"]
                assert (cached is None) is not details
                assert row["price_version"] == PRICE.version
                assert row["cost_micro_usd"] == PRICE.cost_micro_usd(
                    row["prompt_tokens"], cached, row["completion_tokens"]
                )
            if details:  # the control: the repeat's hit is billed below the full price
                assert rows[1]["cached_tokens"] > 0
                full = PRICE.cost_micro_usd(rows[1]["prompt_tokens"], None, 3)
                assert rows[1]["cost_micro_usd"] < full
            url = f"http://127.0.0.1:{s.taps[0].port}"
            counted = f'{UNREPORTED}{{replica="{url}"}} 5.0'
            text = await _metrics(s)
            assert (counted in text) is not details, text
            # An unknown cached count is not a 0: without the flag no cached tokens are
            # counted at all; with it (the control) the repeat's hit is.
            assert ('saltgate_tokens_total{kind="cached"' in text) is details, text

    run(main)
    warnings = [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]
    assert len(warnings) == (0 if details else 1)
    for message in warnings:
        assert "http://127.0.0.1:" in message and "sg_" not in message  # no API key

    state = str(tmp_path / "state")
    assert saltgate(["usage", "--state-dir", state, "--csv"]) == 0
    [alice, _bob] = csv.DictReader(io.StringIO(capsys.readouterr().out))
    assert alice["requests"] == "5"
    assert (alice["cached_tokens"] == "unknown") is not details
    assert alice["unknown_cached_requests"] == ("0" if details else "5")
    assert alice["priced_at_report_requests"] == "0"  # the recorded cost, not today's prices
