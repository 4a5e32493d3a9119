"""The replay's fleet of `saltgate sim` replicas, and which router each policy runs.

Each policy gets fresh replicas (empty caches). Gateway policies run `saltgate serve`
with `[router] policy = P`; the peers run as their own binaries from the bench venv
(scripts/bench-setup.sh), both started as gateway_setup.py says. Children run in
their own process groups (saltgate_devkit/procs.py) with their output in log files under the work
directory, and listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from saltgate.http import UpstreamError, UpstreamPool
from saltgate.routing import POLICIES as ROUTER_POLICIES
from saltgate.sim.run import sim_command
from saltgate_bench.procs import (
    BenchError,
)
from saltgate_bench.replay_client import RequestShape
from saltgate_devkit.procs import Proc, free_port

GATEWAY_POLICIES = ROUTER_POLICIES  # the gateway's own router, under each policy
# policy name -> (tool, its --policy)
PEER_POLICIES = {
    "sglang-router:cache_aware": ("smg", "cache_aware"),
    "vllm-router:cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router:consistent_hash": ("vllm-router", "consistent_hash"),
}
POLICIES = (*GATEWAY_POLICIES, *PEER_POLICIES)  # `--policy all`
# saltgate as Envoy's endpoint picker (docs/epp.md): a real Envoy, `saltgate epp` behind it,
# the gateway's own router (policy saltgate); run when named.
EPP_POLICY = "envoy-epp"
SERVED_METRIC = "vllm:request_success_total"


def metric_total(text: str, name: str) -> float | None:
    """Sum of a Prometheus metric's samples (all label sets) in an exposition text."""
    total: float | None = None
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
    return total


async def http_get(port: int, path: bytes, timeout: float = 2.0) -> tuple[int, bytes]:
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=timeout, response_timeout=timeout)
    try:
        resp = await pool.request(b"GET", path, [])
        return resp.status, await resp.read()
    finally:
        await pool.close()


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The replicas' cache and time model (docs/sim.md), the same for every policy."""

    block_size: int = 16
    num_blocks: int = 8192
    prefill_ms_per_1k_tokens: float = 60.0
    max_num_batched_tokens: int = 0
    long_prefill_token_threshold: int = 0
    decode_ms_per_token: float = 2.0
    max_concurrency: int = 64

    def argv(self, port: int) -> list[str]:
        return sim_command(
            port,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            prefill_ms_per_1k_tokens=self.prefill_ms_per_1k_tokens,
            max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            decode_ms_per_token=self.decode_ms_per_token,
            max_concurrency=self.max_concurrency,
        )


class Fleet:
    """N simulated replicas on fixed ports; a replica can be killed and brought back."""

    def __init__(self, settings: SimSettings, count: int, workdir: Path, tag: str) -> None:
        self.settings = settings
        self.workdir = workdir
        self.tag = tag
        self.ports = [free_port() for _ in range(count)]
        self.procs: list[Proc | None] = [None] * count
        self._served_before: list[float] = [0.0] * count
        self._lives = [0] * count

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _spawn(self, i: int) -> None:
        self._lives[i] += 1
        log = self.workdir / f"{self.tag}-sim{i}-{self._lives[i]}.log"
        self.procs[i] = Proc(f"sim{i}", self.settings.argv(self.ports[i]), log)

    async def start(self, timeout: float) -> None:
        for i in range(len(self.ports)):
            self._spawn(i)
        await asyncio.gather(*(self.wait_healthy(i, timeout) for i in range(len(self.ports))))

    async def wait_healthy(self, i: int, timeout: float) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        last = "no answer"
        while asyncio.get_running_loop().time() < deadline:
            proc = self.procs[i]
            if proc is None or not proc.alive():
                tail = proc.tail() if proc else ""
                raise BenchError(f"replica {i} exited before it was healthy:\n{tail}")
            try:
                status, _ = await http_get(self.ports[i], b"/health")
                if status == 200:
                    return
                last = f"HTTP {status}"
            except UpstreamError as exc:
                last = str(exc)
            await asyncio.sleep(0.1)
        raise BenchError(
            f"replica {i} on port {self.ports[i]} not healthy after {timeout} s: {last}"
        )

    async def served(self) -> list[int]:
        """Requests each replica finished, over all its lives (a killed life counts too)."""
        counts = []
        for i, port in enumerate(self.ports):
            now = 0.0
            proc = self.procs[i]
            if proc is not None and proc.alive():
                with contextlib.suppress(UpstreamError):
                    status, body = await http_get(port, b"/metrics")
                    if status == 200:
                        now = metric_total(body.decode(errors="replace"), SERVED_METRIC) or 0.0
            counts.append(int(self._served_before[i] + now))
        return counts

    async def kill(self, i: int) -> int:
        """SIGKILL replica i, as a crash would; returns (and keeps) what it served so far."""
        self._served_before[i] = float((await self.served())[i])
        proc = self.procs[i]
        if proc is not None:
            proc.kill()
            self.procs[i] = None
        return int(self._served_before[i])

    async def revive(self, i: int, timeout: float) -> None:
        """A fresh replica (empty cache) on the same port."""
        self._spawn(i)
        await self.wait_healthy(i, timeout)

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                proc.stop()
        self.procs = [None] * len(self.ports)


async def wait_ready(router: Proc, port: int, shape: RequestShape, timeout_s: float) -> None:
    """Ready when a real (tiny) completion comes back through ``port``: the router (or the
    balancer in front of gateways) has its replicas."""
    headers, body = shape.probe_parts()
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    pool = UpstreamPool("127.0.0.1", port, connect_timeout=2.0, response_timeout=10.0)
    try:
        while time.monotonic() < deadline:
            if not router.alive():
                raise BenchError(
                    f"{router.name} exited ({router.popen.returncode}) before it was "
                    f"ready; log {router.log_path}:\n{router.tail()}"
                )
            try:
                resp = await pool.request(b"POST", b"/v1/completions", headers, body)
                answer = await resp.read()
                if resp.status == 200 and b'"choices"' in answer:
                    return
                last = f"HTTP {resp.status}: {answer[:200]!r}"
            except UpstreamError as exc:
                last = str(exc)
            await asyncio.sleep(0.2)
    finally:
        await pool.close()
    raise BenchError(f"{router.name} not ready after {timeout_s} s: {last}")
