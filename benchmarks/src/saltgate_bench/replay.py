"""`saltgate-bench replay`: replay a real trace through each routing policy in turn.

Method (docs/benchmarks.md, "Replay benchmark"): the trace (Mooncake's conversation trace
by default) becomes a schedule (saltgate_bench.trace_schedule: sessions from the hash
chains, tenants by Zipf, token blocks, send times divided by --time-scale). For every
policy, fresh simulated replicas (finite caches, prefill time per uncached token) start,
the router under test starts in front of them, and one asyncio load generator sends the
same schedule as streaming completions, measuring time to first token and reading
cached tokens from the usage chunk. Gateway policies get an API key per tenant; the
peers get a cache_salt per tenant in the body, so their isolation is comparable.

Per policy (replay_metrics.summarize): cached-token ratio, TTFT p50/p90/p99, throughput,
requests per replica and max/mean, failed requests, cross-tenant cache hits, and the load
generator's own overhead. Output: a table on stdout, --json OUT, --plot OUT.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from saltgate.governance.limits import Limits
from saltgate.http import UpstreamPool
from saltgate_bench.gateway_setup import (
    GatewayState,
    envoy_argv,
    epp_argv,
    gateway_config,
    peer_argv,
    prepare_gateway_state,
    serve_argv,
    write_gateway_config,
)
from saltgate_bench.procs import (
    BenchError,
    Tools,
    checkout_dir,
    default_tools_venv,
    find_tools,
    machine_info,
    parse_counts,
    positive,
    run_header,
    tool_versions,
    workdir,
)
from saltgate_bench.replay_client import ReplayRun, RequestShape, replay
from saltgate_bench.replay_fleet import (
    FleetOptions,
    FleetServices,
    GatewayFleet,
    database_of,
    kill_gateway_later,
    killed_in_flight,
    ledger_check,
    variant_label,
)
from saltgate_bench.replay_metrics import (
    check_fleet_targets,
    check_targets,
    markdown_table,
    summarize,
)
from saltgate_bench.replay_procs import (
    EPP_POLICY,
    GATEWAY_POLICIES,
    PEER_POLICIES,
    POLICIES,
    Fleet,
    SimSettings,
    wait_ready,
)
from saltgate_bench.trace_schedule import (
    ReplayRequest,
    TraceError,
    build_schedule,
    load_trace,
    zipf_weights,
)
from saltgate_devkit.procs import Proc, free_port

MODEL = "sim-model"
# `--queue`: saltgate's arms with the saturation gate and the fair queue at their defaults
# (docs/fairness.md), to show what governance costs a trace that does not overload.
QUEUE_SECTION = "\n[queue]\nenabled = true\n"
# Mooncake's public trace (github.com/kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0),
# kept in the repo with its licence (data/traces/README.md).
DEFAULT_TRACE = checkout_dir() / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class Fault:
    replica: int
    kill_at_s: float
    revive_after_s: float | None


@dataclass(frozen=True, slots=True)
class Options:
    policies: tuple[str, ...]
    replicas: int
    tenants: int
    sim: SimSettings
    block_tokens: int
    text_prompts: bool
    router_settings: tuple[str, ...]
    fault: Fault | None
    drain_timeout_s: float
    startup_timeout_s: float
    progress: bool
    fleet: FleetOptions | None = None  # --gateways / --shared-state / --kill-gateway-at
    # What `saltgate-bench fairness` adds: more TOML tables for the gateways ([queue]),
    # limits for every tenant, and arguments for the peer router.
    gateway_sections: str = ""
    tenant_limits: Limits | None = None
    peer_args: tuple[str, ...] = ()
    prebuild_requests: bool = False  # make every request before the clock starts


class Bench:
    """Runs one policy after another on the same schedule; keeps every child accounted for."""

    def __init__(
        self, options: Options, schedule: Sequence[ReplayRequest], tools: Tools, workdir: Path
    ) -> None:
        self.o = options
        self.schedule = schedule
        self.tools = tools
        self.workdir = workdir
        self.state: GatewayState | None = None
        self.ttfts: dict[str, list[float]] = {}
        self.runs: dict[str, ReplayRun] = {}  # by label: every outcome, for finer summaries
        self.services: FleetServices | None = None

    def log(self, message: str) -> None:
        print(f"[replay] {message}", file=sys.stderr, flush=True)

    def shape(self, policy: str) -> RequestShape:
        if policy in GATEWAY_POLICIES or policy == EPP_POLICY:
            if self.state is None:
                tenants = [f"tenant-{i}" for i in range(self.o.tenants)]
                self.state = prepare_gateway_state(
                    self.workdir / "gateway-state", tenants, limits=self.o.tenant_limits
                )
            return RequestShape(
                MODEL, self.o.block_tokens, self.o.text_prompts, tenant_keys=self.state.api_keys
            )
        salts = tuple(f"bench-tenant-{i}" for i in range(self.o.tenants))
        return RequestShape(
            MODEL,
            self.o.block_tokens,
            self.o.text_prompts,
            tenant_salts=salts,
            session_header=policy.endswith(":consistent_hash"),
        )

    async def run(self) -> list[dict[str, Any]]:
        if self.o.fleet is not None:
            return await self.run_fleets(self.o.fleet)
        results = []
        for policy in self.o.policies:
            started = time.monotonic()
            try:
                result = await self.run_policy(policy, self.shape(policy))
            except BenchError as exc:
                self.log(f"{policy}: {exc}")
                result = {"policy": policy, "error": str(exc).splitlines()[0]}
            self.log(f"{policy}: done in {time.monotonic() - started:.0f} s")
            results.append({**result, "gateways": 1, "shared_state": False})
        return results

    async def run_fleets(self, fleet: FleetOptions) -> list[dict[str, Any]]:
        """Every policy through every (gateways, shared state) variant, in that order."""
        results = []
        self.services = FleetServices(fleet.needs_bus)
        try:
            for policy in self.o.policies:
                for gateways, shared in fleet.variants():
                    label = variant_label(policy, gateways, shared)
                    started = time.monotonic()
                    try:
                        result = await self.run_fleet(policy, gateways, shared)
                    except BenchError as exc:
                        self.log(f"{label}: {exc}")
                        result = {
                            "policy": policy,
                            "gateways": gateways,
                            "shared_state": shared,
                            "error": str(exc).splitlines()[0],
                        }
                    self.log(f"{label}: done in {time.monotonic() - started:.0f} s")
                    results.append(result)
        finally:
            self.services.stop()
        return results

    async def run_fleet(self, policy: str, gateways: int, shared: bool) -> dict[str, Any]:
        """One variant: fresh replicas and database, N gateways behind HAProxy."""
        fleet_o, services = self.o.fleet, self.services
        assert fleet_o is not None and services is not None
        label = variant_label(policy, gateways, shared)
        tag = label.replace(" ", "-").replace(":", "-")
        tenants = [f"tenant-{i}" for i in range(self.o.tenants)]
        state = services.new_store_state(
            self.workdir / f"{tag}-state", tenants, self.o.tenant_limits
        )
        shape = RequestShape(
            MODEL, self.o.block_tokens, self.o.text_prompts, tenant_keys=state.api_keys
        )
        replicas = Fleet(self.o.sim, self.o.replicas, self.workdir, tag)
        front: GatewayFleet | None = None
        kill: dict[str, Any] | None = None
        try:
            await replicas.start(self.o.startup_timeout_s)
            front = GatewayFleet(
                gateways,
                state,
                replicas.urls,
                policy=policy,
                router_settings=self.o.router_settings,
                bus=services.redis if shared else None,
                workdir=self.workdir,
                tag=tag,
                sections=self.o.gateway_sections,
            )
            port = await front.start(shape, self.o.startup_timeout_s)
            baseline = await replicas.served()
            pool = UpstreamPool(
                "127.0.0.1", port, max_idle=1024, response_timeout=None, read_timeout=None
            )
            extra = None
            if fleet_o.kill_gateway_at_s is not None:
                which = min(fleet_o.kill_gateway, gateways - 1)
                kill = {"gateway": which}
                extra = partial(kill_gateway_later, front, which, fleet_o.kill_gateway_at_s, kill)
            try:
                run, fault = await self.replay_with_fault(label, pool, shape, replicas, extra)
            finally:
                await pool.close()
            served = [b - a for a, b in zip(baseline, await replicas.served(), strict=True)]
        finally:
            if front is not None:
                front.stop()
            replicas.stop()
        result = self.summary(label, policy, run, served, fault)
        result["gateways"] = gateways
        result["shared_state"] = shared
        assert services.postgres is not None
        result["ledger"] = ledger_check(services.postgres, database_of(state), run.outcomes)
        if kill is not None:
            kill.update(killed_in_flight(run.outcomes, kill.get("killed_at_s")))
            result["gateway_fault"] = kill
        return result

    async def run_policy(self, policy: str, shape: RequestShape) -> dict[str, Any]:
        fleet = Fleet(self.o.sim, self.o.replicas, self.workdir, policy.replace(":", "-"))
        router: Proc | None = None
        behind: Proc | None = None  # envoy-epp: the EPP behind the Envoy in `router`
        try:
            await fleet.start(self.o.startup_timeout_s)
            port = free_port()
            if policy == EPP_POLICY:
                behind, router = self.start_envoy_epp(port, fleet)
            else:
                router = self.start_router(policy, port, fleet)
            await self.wait_ready(router, port, shape)
            baseline = await fleet.served()
            pool = UpstreamPool(
                "127.0.0.1", port, max_idle=1024, response_timeout=None, read_timeout=None
            )
            try:
                run, fault = await self.replay_with_fault(policy, pool, shape, fleet)
            finally:
                await pool.close()
            served = [b - a for a, b in zip(baseline, await fleet.served(), strict=True)]
        finally:
            for proc in (router, behind):
                if proc is not None:
                    proc.stop()
            fleet.stop()
        return self.summary(policy, policy, run, served, fault)

    def summary(
        self,
        label: str,
        policy: str,
        run: ReplayRun,
        served: list[int],
        fault: dict[str, Any] | None,
    ) -> dict[str, Any]:
        result = summarize(
            policy,
            self.schedule,
            run.outcomes,
            block_size=self.o.block_tokens,
            replica_requests=served,
        )
        result["isolating"] = result["cross_tenant_hits"] == 0
        result["loadgen"] = run.overhead()
        if fault is not None:
            result["fault"] = fault
        self.ttfts[label] = [t for o in run.outcomes if o and o.ok and (t := o.ttft_s)]
        self.runs[label] = run
        return result

    def start_router(self, policy: str, port: int, fleet: Fleet) -> Proc:
        tag = policy.replace(":", "-")
        if policy in GATEWAY_POLICIES:
            assert self.state is not None
            text = gateway_config(
                self.state,
                fleet.urls,
                port=port,
                admin_port=free_port(),
                policy=policy,
                router_settings=self.o.router_settings,
                sections=self.o.gateway_sections,
            )
            argv = serve_argv(write_gateway_config(self.workdir / f"{tag}.toml", text))
        else:
            tool, peer_policy = PEER_POLICIES[policy]
            argv = [*peer_argv(self.tools, tool, peer_policy, port, fleet.urls), *self.o.peer_args]
        return Proc(tag, argv, self.workdir / f"{tag}-router.log")

    def start_envoy_epp(self, port: int, fleet: Fleet) -> tuple[Proc, Proc]:
        """(`saltgate epp`, the Envoy in front of it on ``port``) with the configuration
        `saltgate epp --envoy-config` prints: the gateway's policy saltgate as Envoy's
        endpoint picker."""
        assert self.state is not None
        text = gateway_config(
            self.state,
            fleet.urls,
            port=free_port(),
            admin_port=free_port(),
            router_settings=self.o.router_settings,
            sections=f"{self.o.gateway_sections}\n[epp]\ngrpc_port = {free_port()}\n"
            f"envoy_port = {port}\n",
        )
        epp = epp_argv(write_gateway_config(self.workdir / f"{EPP_POLICY}.toml", text))
        envoy = envoy_argv(epp, self.workdir / f"{EPP_POLICY}-envoy.yaml")
        log = self.workdir / f"{EPP_POLICY}-epp.log"
        return Proc("saltgate-epp", epp, log), Proc(
            "envoy", envoy, self.workdir / f"{EPP_POLICY}-router.log"
        )

    async def wait_ready(self, router: Proc, port: int, shape: RequestShape) -> None:
        await wait_ready(router, port, shape, self.o.startup_timeout_s)

    async def replay_with_fault(
        self,
        policy: str,
        pool: UpstreamPool,
        shape: RequestShape,
        fleet: Fleet,
        also: Callable[[float], Coroutine[Any, Any, None]] | None = None,
    ) -> tuple[ReplayRun, dict[str, Any] | None]:
        """The replay, with the replica fault of --kill-replica-at and ``also(t0)``
        (another fault, say, timed from the schedule's start t0) running beside it."""
        built = [shape.parts(r) for r in self.schedule] if self.o.prebuild_requests else None
        t0 = time.monotonic()
        bar = self._progress(policy)
        tasks = []
        record: dict[str, Any] | None = None
        if self.o.fault is not None:
            record = {"replica": self.o.fault.replica}
            tasks.append(asyncio.create_task(self._fault(fleet, self.o.fault, record)))
        if also is not None:
            tasks.append(asyncio.create_task(also(t0)))
        try:
            run = await replay(
                pool,
                self.schedule,
                shape,
                drain_timeout_s=self.o.drain_timeout_s,
                on_done=bar.update if bar is not None else lambda: None,
                t0=t0,
                built=built,
            )
        finally:
            if bar is not None:
                bar.close()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return run, record

    async def _fault(self, fleet: Fleet, fault: Fault, record: dict[str, Any]) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(fault.kill_at_s)
        record["served_before_kill"] = await fleet.kill(fault.replica)
        record["killed_at_s"] = round(time.monotonic() - t0, 2)
        self.log(f"killed replica {fault.replica} at {record['killed_at_s']} s")
        if fault.revive_after_s is None:
            return
        await asyncio.sleep(fault.revive_after_s)
        await fleet.revive(fault.replica, self.o.startup_timeout_s)
        record["revived_at_s"] = round(time.monotonic() - t0, 2)
        self.log(f"replica {fault.replica} back (fresh cache) at {record['revived_at_s']} s")

    def _progress(self, policy: str) -> Any:
        if not self.o.progress:
            return None
        from tqdm import tqdm  # type: ignore[import-untyped]  # noqa: PLC0415 - only for runs

        return tqdm(total=len(self.schedule), desc=policy, unit="req", file=sys.stderr)


# -- output -------------------------------------------------------------------------------------


def plot_ttfts(ttfts: dict[str, list[float]], path: Path, title: str) -> None:
    """TTFT distributions as CDFs on a log time axis, one line per policy."""
    # Imported here: matplotlib takes about a second, and only --plot needs it.
    import matplotlib  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, values in ttfts.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values) * 1000.0)
        ys = np.arange(1, len(xs) + 1) / len(xs)
        ax.plot(xs, ys, label=policy, linestyle="-" if policy in GATEWAY_POLICIES else "--")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def schedule_info(schedule: Sequence[ReplayRequest], tenants: int) -> dict[str, Any]:
    per_tenant = [0] * tenants
    for req in schedule:
        per_tenant[req.tenant] += 1
    return {
        "requests": len(schedule),
        "sessions": len({r.session for r in schedule}),
        "duration_s": round(schedule[-1].at_s, 2) if schedule else 0.0,
        "offered_rps": round(len(schedule) / schedule[-1].at_s, 2)
        if schedule and schedule[-1].at_s
        else None,
        "requests_per_tenant": per_tenant,
    }


# -- command line -------------------------------------------------------------------------------


def _policies(text: str) -> tuple[str, ...]:
    if text == "all":
        return POLICIES
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    known = (*POLICIES, EPP_POLICY)
    bad = [p for p in names if p not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or '(none)'}; choose from {', '.join(known)}"
        )
    return names


def _switches(text: str) -> tuple[bool, ...]:
    words = [part.strip() for part in text.split(",") if part.strip()]
    if not words or any(w not in ("on", "off") for w in words):
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return tuple(w == "on" for w in dict.fromkeys(words))


def add_sim_arguments(p: argparse.ArgumentParser, d: SimSettings) -> None:
    """The replicas' time and cache model (SimSettings), with ``d`` as the defaults."""
    s = p.add_argument_group("simulated replicas")
    s.add_argument(
        "--sim-block-size", type=positive(int), default=d.block_size, help="tokens per KV block"
    )
    s.add_argument(
        "--num-blocks", type=positive(int), default=d.num_blocks, help="KV blocks per replica"
    )
    s.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=positive(float),
        default=d.prefill_ms_per_1k_tokens,
        help="prefill time of uncached prompt tokens (serial per replica)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="prompt tokens one prefill step computes (vLLM's; 0: one whole prompt a step)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most tokens of a step one running prefill takes (vLLM's; 0: no cap)",
    )
    s.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=d.decode_ms_per_token,
        help="time per output token",
    )
    s.add_argument(
        "--max-concurrency",
        type=positive(int),
        default=d.max_concurrency,
        help="requests a replica runs at once",
    )


def sim_settings(args: argparse.Namespace) -> SimSettings:
    return SimSettings(
        block_size=args.sim_block_size,
        num_blocks=args.num_blocks,
        prefill_ms_per_1k_tokens=args.prefill_ms_per_1k_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        decode_ms_per_token=args.decode_ms_per_token,
        max_concurrency=args.max_concurrency,
    )


def add_run_arguments(r: argparse._ArgumentGroup) -> None:
    """Where the tools are, how long to wait, where to keep logs, and the progress bar."""
    r.add_argument("--tools-venv", type=Path, help="venv with smg and vllm-router")
    r.add_argument(
        "--drain-timeout",
        type=positive(float),
        default=120.0,
        help="seconds to wait for answers after the last request is sent",
    )
    r.add_argument(
        "--startup-timeout",
        type=positive(float),
        default=60.0,
        help="seconds a replica, router or gateway may take to come up",
    )
    r.add_argument("--workdir", type=Path, help="keep logs and configs here (default: temp)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")


HELP = "replay a real trace through each routing policy"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="trace file (JSONL)")
    p.add_argument("--replicas", type=positive(int), default=4, help="simulated replicas")
    p.add_argument("--tenants", type=positive(int), default=8, help="tenants (Zipf over them)")
    p.add_argument(
        "--policy",
        type=_policies,
        default=POLICIES,
        help=f"comma-separated, run in this order, or 'all' (default): {', '.join(POLICIES)}; "
        f"also {EPP_POLICY} (saltgate as Envoy's endpoint picker), when named",
    )
    p.add_argument("--time-scale", type=positive(float), default=10.0, help="replay S times faster")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG of the TTFT distributions here")
    w = p.add_argument_group("trace window and tenants")
    w.add_argument("--start", type=float, default=0.0, help="trace seconds to skip")
    w.add_argument(
        "--duration", type=positive(float), default=600.0, help="trace seconds to replay"
    )
    w.add_argument("--limit", type=positive(int), help="at most this many requests")
    w.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of tenant sizes")
    w.add_argument("--seed", type=int, default=0, help="seed of the tenant assignment")
    w.add_argument(
        "--block-tokens",
        type=positive(int),
        default=64,
        help="tokens per 512-token trace block (a multiple of --sim-block-size)",
    )
    w.add_argument(
        "--prompt-format",
        choices=("text", "ids"),
        default="text",
        help="prompts as one-token words (default; smg refuses token ids) or token ids",
    )
    add_sim_arguments(p, SimSettings())
    r = p.add_argument_group("routers and faults")
    r.add_argument(
        "--router-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra TOML line for the gateway's [router] section (repeatable)",
    )
    r.add_argument("--kill-replica-at", type=float, help="kill a replica this many s in")
    r.add_argument("--revive-after", type=float, help="bring it back this many s later")
    r.add_argument("--kill-replica", type=int, default=0, help="which replica to kill")
    g = p.add_argument_group(
        "a fleet of gateways (any of these: N saltgate serve behind HAProxy, one PostgreSQL "
        "store, and the Redis cluster bus when shared state is on)"
    )
    g.add_argument(
        "--gateways",
        type=parse_counts,
        help="comma-separated gateway counts, each a run (default 1), e.g. 1,4",
    )
    g.add_argument(
        "--shared-state",
        type=_switches,
        help="on, off or on,off: gateways share routing state over the bus (default on)",
    )
    g.add_argument(
        "--kill-gateway-at", type=float, help="SIGKILL one gateway this many s into each run"
    )
    g.add_argument("--kill-gateway", type=int, default=0, help="which gateway to kill")
    r.add_argument(
        "--queue",
        action="store_true",
        help="saltgate's policies with the saturation gate and fair queue on ([queue])",
    )
    add_run_arguments(r)


def _options(args: argparse.Namespace) -> Options:
    if args.block_tokens % args.sim_block_size:
        raise BenchError("--block-tokens must be a multiple of --sim-block-size")
    if args.revive_after is not None and args.kill_replica_at is None:
        raise BenchError("--revive-after needs --kill-replica-at")
    if not 0 <= args.kill_replica < args.replicas:
        raise BenchError(f"--kill-replica must be in 0..{args.replicas - 1}")
    for line in args.router_set:
        if "=" not in line:
            raise BenchError(f"--router-set expects KEY=VALUE, got {line!r}")
    fault = None
    if args.kill_replica_at is not None:
        fault = Fault(args.kill_replica, args.kill_replica_at, args.revive_after)
    fleet = None
    if args.gateways or args.shared_state or args.kill_gateway_at is not None:
        peers = [p for p in args.policy if p not in GATEWAY_POLICIES]
        if peers:
            raise BenchError(
                f"--gateways and friends run saltgate's own policies only, not {', '.join(peers)}"
            )
        gateways = args.gateways or (1,)
        if args.kill_gateway_at is not None and not 0 <= args.kill_gateway < min(gateways):
            raise BenchError(f"--kill-gateway must be in 0..{min(gateways) - 1}")
        fleet = FleetOptions(
            gateways,
            args.shared_state or (True,),
            args.kill_gateway_at,
            args.kill_gateway,
        )
    return Options(
        policies=args.policy,
        replicas=args.replicas,
        tenants=args.tenants,
        sim=sim_settings(args),
        block_tokens=args.block_tokens,
        text_prompts=args.prompt_format == "text",
        router_settings=tuple(
            f"{k.strip()} = {v.strip()}" for k, v in (s.split("=", 1) for s in args.router_set)
        ),
        fault=fault,
        drain_timeout_s=args.drain_timeout,
        startup_timeout_s=args.startup_timeout,
        progress=not args.no_progress,
        fleet=fleet,
        gateway_sections=QUEUE_SECTION if args.queue else "",
    )


def run(args: argparse.Namespace) -> int:
    """The `saltgate-bench replay` command; 0 when every policy ran, 1 if one could not."""
    try:
        options = _options(args)
        trace = load_trace(args.trace)
        schedule = build_schedule(
            trace,
            tenants=options.tenants,
            zipf_exponent=args.zipf,
            seed=args.seed,
            block_size=options.block_tokens,
            time_scale=args.time_scale,
            start_s=args.start,
            duration_s=args.duration,
            limit=args.limit,
        )
        if not schedule:
            raise BenchError("the trace window holds no requests; check --start/--duration")
        venv = args.tools_venv or default_tools_venv()
        tools = find_tools(venv)
        peers = [p for p in options.policies if p not in GATEWAY_POLICIES]
        for policy in peers:
            tools.need("smg" if policy.startswith("sglang") else "vllm-router")
    except (BenchError, TraceError) as exc:
        print(f"saltgate-bench replay: {exc}", file=sys.stderr)
        return 2
    info = schedule_info(schedule, options.tenants)
    print(
        f"[replay] {info['requests']} requests, {info['sessions']} sessions, "
        f"{info['duration_s']} s at x{args.time_scale} ({info['offered_rps']} req/s offered); "
        f"requests per tenant {info['requests_per_tenant']}",
        file=sys.stderr,
        flush=True,
    )
    started = time.time()
    with workdir("saltgate-replay-", args.workdir) as work:
        bench = Bench(options, schedule, tools, work)
        results = asyncio.run(bench.run())
        ttfts = bench.ttfts
    targets = check_targets(results) if options.fleet is None else check_fleet_targets(results)
    print(markdown_table(results))
    for line in targets:
        print(line)
    if args.json is not None:
        report = {
            "benchmark": "replay",
            **run_header(started),
            "trace": str(args.trace),
            "schedule": info,
            "tenant_weights": [round(w, 4) for w in zipf_weights(options.tenants, args.zipf)],
            "config": {
                "replicas": options.replicas,
                "tenants": options.tenants,
                "zipf": args.zipf,
                "seed": args.seed,
                "time_scale": args.time_scale,
                "start_s": args.start,
                "duration_s": args.duration,
                "limit": args.limit,
                "block_tokens": options.block_tokens,
                "prompt_format": args.prompt_format,
                "sim": asdict(options.sim),
                "router_settings": list(options.router_settings),
                "fault": asdict(options.fault) if options.fault else None,
                "fleet": asdict(options.fleet) if options.fleet else None,
                "queue": bool(options.gateway_sections),
            },
            "machine": asdict(machine_info()),
            "tools": tool_versions(tools),
            "results": results,
            "targets": targets,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plot_ttfts(
            ttfts,
            args.plot,
            f"TTFT, {info['requests']} requests of {args.trace.name}, x{args.time_scale}, "
            f"{options.replicas} replicas, {options.tenants} tenants",
        )
    return 1 if any("error" in r for r in results) else 0
