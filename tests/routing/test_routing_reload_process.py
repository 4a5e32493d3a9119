"""`saltgate serve` as a real process: SIGHUP reloads [[replicas]] without a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

from tests.gateway.stack import MODEL, long_prompt, new_state_dir, run
from tests.support.gateways import write_gateway_config
from tests.support.http import async_client

from saltgate.sim.run import RunningSim, SimConfig, start_sim

SALTGATE = Path(sys.executable).parent / "saltgate"


def write_config(path: Path, state: Path, sims: list[RunningSim]) -> None:
    write_gateway_config(
        path,
        state_dir=state,
        replicas=(s.url for s in sims),
        sections="[router]\nprobe_interval_s = 0.2\n",
    )


async def line_with(stream: asyncio.StreamReader, needle: str) -> str:
    while True:
        line = (await asyncio.wait_for(stream.readline(), 20)).decode()
        assert line, f"saltgate serve exited before printing {needle!r}"
        if needle in line:
            return line


def test_sighup_reloads_the_replica_list(tmp_path: Path) -> None:
    async def main() -> None:
        assert SALTGATE.exists(), f"missing {SALTGATE}: run `make install`"
        sims = [await start_sim(SimConfig(port=0)) for _ in range(3)]
        state = tmp_path / "state"
        key = new_state_dir(state, ("alice",))["alice"]
        config = tmp_path / "gateway.toml"
        write_config(config, state, sims[:2])
        proc = await asyncio.create_subprocess_exec(
            str(SALTGATE),
            "serve",
            "--config",
            str(config),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            url = (await line_with(proc.stdout, "serving on")).split()[3]
            headers = {"authorization": f"Bearer {key}"}
            async with async_client(base_url=url, headers=headers, timeout=30) as client:

                async def burst(tag: str, most: int = 12, until: int | None = None) -> list[int]:
                    """Send `most` fresh prompts, or fewer once replica `until` served one."""
                    before = [s.server.engine.requests_finished for s in sims]
                    served = before
                    for i in range(most):
                        body = {"model": MODEL, "prompt": long_prompt(f"{tag}{i}_", 800)}
                        resp = await client.post("/v1/completions", json=body | {"max_tokens": 2})
                        assert resp.status_code == 200, resp.text
                        served = [s.server.engine.requests_finished for s in sims]
                        if until is not None and served[until] > before[until]:
                            break
                    return [now - b for now, b in zip(served, before, strict=True)]

                assert (await burst("a"))[2] == 0
                write_config(config, state, sims)
                proc.send_signal(signal.SIGHUP)
                await line_with(proc.stdout, "reloaded")
                # The added replica takes its share. Each prompt's replica is a draw keyed
                # by the run's random route secret (1 in 3 for the added one), so a fixed
                # dozen misses it in 1 run of 130; sending until it serves one, at most 100
                # ((2/3)^100: under 1 in 10^17), proves the same without the lottery.
                assert (await burst("b", most=100, until=2))[2] > 0
                write_config(config, state, sims[1:])
                proc.send_signal(signal.SIGHUP)
                await line_with(proc.stdout, "reloaded")
                assert (await burst("c"))[0] == 0  # the removed one gets nothing
                config.write_text("[router]\npolicy = 'nope'\n")
                proc.send_signal(signal.SIGHUP)
                refused = await line_with(proc.stderr, "reload refused")
                assert "router.policy" in refused or "replicas" in refused
                assert (await burst("d"))[0] == 0  # still serving on the previous list
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
            for s in sims:
                await s.close()

    run(main)
