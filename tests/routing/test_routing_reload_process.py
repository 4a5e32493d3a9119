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

                async def served_by(prompt: str) -> int:
                    """Send one prompt; the index of the replica that served it."""
                    before = [s.server.engine.requests_finished for s in sims]
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                    resp = await client.post("/v1/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    after = [s.server.engine.requests_finished for s in sims]
                    [index] = [
                        i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a > b
                    ]
                    return index

                async def burst(tag: str, until: set[int]) -> dict[str, int]:
                    """Fresh prompts until each replica of `until` served one (at most 100),
                    and which replica served each."""
                    served: dict[str, int] = {}
                    for i in range(100):
                        prompt = long_prompt(f"{tag}{i}_", 800)
                        served[prompt] = await served_by(prompt)
                        if until <= set(served.values()):
                            break
                    return served

                assert 2 not in (await burst("a", until={0, 1})).values()
                write_config(config, state, sims)
                proc.send_signal(signal.SIGHUP)
                await line_with(proc.stderr, "reloaded")
                # The added replica takes its share. Each prompt's replica is a draw keyed
                # by the run's random route secret (1 in 3 for each), so prompts are sent
                # until the added one and the first have each served one, at most 100
                # ((2/3)^100: under 1 in 10^17), not a fixed dozen that may miss it.
                ranked = await burst("b", until={0, 2})
                assert 2 in ranked.values() and 0 in ranked.values()
                # Prompts the first replica served: its own while it is on the list, and
                # again if it stayed (the draw is the same), so none of them reaching it
                # shows it gone, without another draw.
                its_own = [prompt for prompt, index in ranked.items() if index == 0]
                write_config(config, state, sims[1:])
                proc.send_signal(signal.SIGHUP)
                await line_with(proc.stderr, "reloaded")
                assert 0 not in [await served_by(p) for p in its_own]  # the removed one
                config.write_text("[router]\npolicy = 'nope'\n")
                proc.send_signal(signal.SIGHUP)
                refused = await line_with(proc.stderr, "reload refused")
                assert "router.policy" in refused or "replicas" in refused
                # Still serving on the previous list: its prompts again, and fresh ones.
                assert 0 not in [await served_by(p) for p in its_own]
                assert 0 not in (await burst("d", until={1, 2})).values()
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 20)
            for s in sims:
                await s.close()

    run(main)
