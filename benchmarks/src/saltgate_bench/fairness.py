"""`saltgate-bench fairness`: a quiet tenant beside a noisy one, through each router.

Method (docs/benchmarks.md, "Fairness"; the workload and measures are
fairness_metrics.py): saturating simulated replicas, a quiet tenant within its
share throughout, a noisy tenant ramping to 10x its share with long prompts in the middle
phase, the same schedule through each router in turn, each in front of fresh replicas.
The routers run as `saltgate-bench replay` runs them (replay.py, replay_fleet.py):
saltgate with the fair queue on and tenant limits (`saltgate`), saltgate as it is without
them (`saltgate-ungoverned`), smg and vllm-router with their own concurrency/queue
settings; with `--gateways 1,4` the saltgate arms run as a fleet of N gateways on one
PostgreSQL store and one Redis bus behind HAProxy. Tenants are two API keys of two
tenants for saltgate, and a cache_salt per tenant for the peers, which have no tenants.

Per router, gateway count and phase: the quiet tenant's TTFT p50/p99 and rejections, the
noisy tenant's throughput, the total throughput, the cached-token ratio and the VTC
service difference. Output: a table on stdout, --json OUT, --plot OUT (.png or .svg).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from saltgate.governance.limits import Limits
from saltgate_bench.fairness_metrics import (
    NOISY,
    PHASES,
    QUIET,
    Record,
    Workload,
    build_schedule,
    capacity_tokens_per_s,
    check_targets,
    markdown_table,
    phase_summary,
    records,
)
from saltgate_bench.procs import (
    BenchError,
    Tools,
    default_tools_venv,
    find_tools,
    machine_info,
    parse_counts,
    positive,
    run_header,
    tool_versions,
    workdir,
)
from saltgate_bench.replay import (
    Bench,
    Options,
    add_run_arguments,
    add_sim_arguments,
    sim_settings,
)
from saltgate_bench.replay_fleet import FleetOptions, variant_label
from saltgate_bench.replay_procs import SimSettings
from saltgate_bench.trace_schedule import ReplayRequest

ROUTERS = ("saltgate", "saltgate-ungoverned", "smg", "vllm-router")
GOVERNED = "saltgate"
GATEWAY_ROUTERS = ("saltgate", "saltgate-ungoverned")
# router -> the replay benchmark's policy that runs it
POLICY = {
    "saltgate": "saltgate",
    "saltgate-ungoverned": "saltgate",
    "smg": "sglang-router:cache_aware",
    "vllm-router": "vllm-router:cache_aware",
}
# smg's admission at its best here (docs/benchmarks.md, "Fairness", has what was tried):
# its cap is a token bucket refilled at the cap per second, so 4 admits at most 4
# requests/s, just under the peak offered, queueing the rest (default queue, 100 for 60 s).
SMG_ARGS = "--max-concurrent-requests 4"
# Saturating replicas on a small machine: 2.5k prompt tokens/s each, so 2 replicas are
# full at ~0.6 noisy requests/s of 8k tokens while the load generator, the routers and
# the simulators' tokenizers stay within a couple of cores. The replicas schedule as vLLM
# V1 does (docs/sim.md): steps of at most 256 prompt tokens (about 100 ms, a GPU step's
# order at this pace), running prefills first; `--long-prefill-token-threshold 64`, set
# as for interactive tenants, leaves each step's rest to newly arrived prompts. Without
# it (vLLM's default) the oldest running prefill takes every step until it is done, so a
# short prompt behind a noisy 8k prefill waits for it whatever the router does.
SIM = SimSettings(
    prefill_ms_per_1k_tokens=400.0,
    decode_ms_per_token=2.0,
    max_num_batched_tokens=256,
    long_prefill_token_threshold=64,
)


def governed_sections() -> str:
    """The governed arm's extra gateway tables, and the one place that writes them: the
    fair queue ([queue], docs/config.md) at its defaults, its prefill budget each
    replica's engine step as the replica reports it. A gateway that does not know [queue]
    refuses the config, and the arm reports that instead of running ungoverned."""
    return "\n[queue]\nenabled = true\n"


def ungoverned_sections() -> str:
    """The ungoverned arm's: the fair queue off (it is on by default)."""
    return "\n[queue]\nenabled = false\n"


@dataclass(frozen=True, slots=True)
class FairnessOptions:
    routers: tuple[str, ...]
    gateways: tuple[int, ...] | None  # None: one gateway, without balancer and bus
    replicas: int
    sim: SimSettings
    workload: Workload
    window_s: float
    tenant_limits: Limits | None  # the governed arm's, for each tenant
    peer_args: dict[str, tuple[str, ...]]
    drain_timeout_s: float
    startup_timeout_s: float
    progress: bool


@dataclass(slots=True)
class ArmRun:
    router: str
    gateways: int
    result: dict[str, Any]  # the replay benchmark's summary, or {"error": ...}
    rows: list[dict[str, Any]]
    records: list[Record]


def log(message: str) -> None:
    print(f"[fairness] {message}", file=sys.stderr, flush=True)


def replay_options(o: FairnessOptions, router: str) -> Options:
    fleet = None
    if o.gateways is not None and router in GATEWAY_ROUTERS:
        fleet = FleetOptions(o.gateways, (True,))  # one Redis bus for every count
    return Options(
        policies=(POLICY[router],),
        replicas=o.replicas,
        tenants=2,
        sim=o.sim,
        block_tokens=o.workload.block_tokens,
        text_prompts=True,
        router_settings=(),
        fault=None,
        drain_timeout_s=o.drain_timeout_s,
        startup_timeout_s=o.startup_timeout_s,
        progress=o.progress,
        fleet=fleet,
        gateway_sections=(
            governed_sections()
            if router == GOVERNED
            else ungoverned_sections()
            if router in GATEWAY_ROUTERS
            else ""
        ),
        tenant_limits=o.tenant_limits if router == GOVERNED else None,
        peer_args=o.peer_args.get(router, ()),
        # an 8k-token prompt takes ~60 ms to make on a busy machine: made while
        # sending, it would add that to the quiet tenant's measured TTFTs
        prebuild_requests=True,
    )


def arm_rows(
    o: FairnessOptions, router: str, gateways: int, run_records: Sequence[Record]
) -> list[dict[str, Any]]:
    return [
        {
            "router": router,
            "gateways": gateways,
            **phase_summary(run_records, o.workload, phase, o.window_s),
        }
        for phase in PHASES
    ]


async def run_arms(
    o: FairnessOptions, schedule: Sequence[ReplayRequest], tools: Tools, work: Path
) -> list[ArmRun]:
    """Every router in turn (a saltgate arm once per gateway count), each on fresh
    replicas and its own state, logs and configs under work/ROUTER."""
    arms = []
    for router in o.routers:
        options = replay_options(o, router)
        (work / router).mkdir(parents=True, exist_ok=True)
        log(f"{router}: {len(schedule)} requests over {3 * o.workload.phase_s:.0f} s")
        bench = Bench(options, schedule, tools, work / router)
        for result in await bench.run():
            gateways = int(result.get("gateways", 1))
            label = (
                variant_label(result["policy"], gateways, result["shared_state"])
                if options.fleet is not None
                else result["policy"]
            )
            run = bench.runs.get(label)
            rs: list[Record] = []
            if "error" in result or run is None:
                error = str(result.get("error", "no run"))
                rows = [
                    {"router": router, "gateways": gateways, "phase": p, "error": error}
                    for p in PHASES
                ]
            else:
                rs = records(schedule, run.outcomes, o.workload.block_tokens)
                rows = arm_rows(o, router, gateways, rs)
            arms.append(ArmRun(router, gateways, result, rows, rs))
    return arms


# -- output -------------------------------------------------------------------------------------


def plot_ttft_over_time(w: Workload, runs: dict[str, list[Record]], path: Path) -> None:
    """TTFT against send time, per tenant, one panel per router run; the phases marked.
    The format follows the file's suffix (.png, .svg, .pdf)."""
    # Imported here: matplotlib takes about a second, and only --plot needs it.
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(runs), 1, figsize=(9, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, (label, rs) in zip(axes[:, 0], runs.items(), strict=True):
        for tenant, name, color in ((QUIET, "quiet", "C0"), (NOISY, "noisy", "C1")):
            pts = [(r.sent_at, t * 1000.0) for r in rs if r.tenant == tenant and (t := r.ttft_s)]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.scatter(xs, ys, s=6, color=color, label=name)
            refused = [r.sent_at for r in rs if r.tenant == tenant and not r.ok]
            if refused:
                ax.scatter(refused, [1.0] * len(refused), s=12, marker="x", color=color, alpha=0.6)
        for phase in PHASES[1:]:
            ax.axvline(w.bounds(phase)[0], color="grey", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylabel("TTFT ms")
        ax.set_title(label, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("send time (s); phases alone | noisy | after; x = not served")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line -------------------------------------------------------------------------------


def _routers(text: str) -> tuple[str, ...]:
    if text == "all":
        return ROUTERS
    names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in names if p not in ROUTERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown router {', '.join(bad) or '(none)'}; choose from {', '.join(ROUTERS)}"
        )
    return names


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text}")
    return value


HELP = "a quiet tenant beside a noisy one, through each router (fair share, VTC)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--routers",
        type=_routers,
        default=ROUTERS,
        help=f"comma-separated, run in this order, or 'all' (default): {', '.join(ROUTERS)}",
    )
    p.add_argument(
        "--gateways",
        type=parse_counts,
        help="comma-separated gateway counts for the saltgate arms, e.g. 1,4: each a fleet "
        "behind HAProxy on PostgreSQL and Redis (default: one gateway, none of those)",
    )
    p.add_argument("--replicas", type=positive(int), default=2, help="simulated replicas")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write TTFT over time per tenant here (.png/.svg)")
    t = p.add_argument_group("phases and tenants")
    t.add_argument(
        "--phase-s", type=positive(float), default=60.0, help="seconds of each of the 3 phases"
    )
    t.add_argument(
        "--window-s",
        type=positive(float),
        default=60.0,
        help="window of the service difference (scale it down with --phase-s)",
    )
    t.add_argument("--quiet-rps", type=positive(float), default=2.0, help="the quiet tenant's rate")
    t.add_argument(
        "--noisy-x",
        type=positive(float),
        default=10.0,
        help="the noisy tenant's peak, in multiples of its share (half the prefill capacity)",
    )
    for tenant, prompt, output in (("quiet", 200, 16), ("noisy", 8192, 64)):
        t.add_argument(
            f"--{tenant}-prompt-tokens",
            type=positive(int),
            default=prompt,
            help=f"the {tenant} tenant's prompt length (rounded up to whole blocks)",
        )
        t.add_argument(
            f"--{tenant}-max-tokens",
            type=positive(int),
            default=output,
            help=f"the {tenant} tenant's output tokens per request",
        )
    t.add_argument(
        "--shared-prefix",
        type=_fraction,
        default=0.5,
        help="share of each prompt that is a prefix the tenant's requests share",
    )
    t.add_argument(
        "--documents", type=positive(int), default=4, help="the noisy tenant's shared prefixes"
    )
    t.add_argument(
        "--block-tokens",
        type=positive(int),
        default=8,
        help="prompts are made of blocks of this many one-token words",
    )
    t.add_argument("--seed", type=int, default=0, help="seed of the arrivals")
    add_sim_arguments(p, SIM)
    r = p.add_argument_group("routers")
    r.add_argument(
        "--tenant-input-tpm",
        type=int,
        help="the governed arm's uncached input tokens per minute for each tenant "
        "(default: the replicas' whole prefill capacity; 0: no limits)",
    )
    r.add_argument(
        "--smg-args", default=SMG_ARGS, help=f"more smg launch arguments (default: {SMG_ARGS})"
    )
    r.add_argument("--vllm-router-args", default="", help="more vllm-router arguments")
    add_run_arguments(r)


def _options(args: argparse.Namespace) -> FairnessOptions:
    sim = sim_settings(args)
    capacity = capacity_tokens_per_s(args.replicas, sim.prefill_ms_per_1k_tokens)
    share = capacity / 2
    block = args.block_tokens
    quiet_blocks = -(-args.quiet_prompt_tokens // block)
    noisy_blocks = -(-args.noisy_prompt_tokens // block)
    if args.quiet_rps * quiet_blocks * block > share:
        raise BenchError(
            f"the quiet tenant must stay within its share: {args.quiet_rps} req/s of "
            f"{quiet_blocks * block} tokens is more than {share:.0f} prompt tokens/s"
        )
    workload = Workload(
        phase_s=args.phase_s,
        quiet_rps=args.quiet_rps,
        noisy_peak_rps=args.noisy_x * share / (noisy_blocks * block),
        quiet_blocks=quiet_blocks,
        noisy_blocks=noisy_blocks,
        block_tokens=block,
        quiet_max_tokens=args.quiet_max_tokens,
        noisy_max_tokens=args.noisy_max_tokens,
        shared_fraction=args.shared_prefix,
        documents=args.documents,
        seed=args.seed,
    )
    tpm = args.tenant_input_tpm if args.tenant_input_tpm is not None else round(capacity * 60)
    if tpm < 0:
        raise BenchError("--tenant-input-tpm must be 0 (no limits) or more")
    return FairnessOptions(
        routers=args.routers,
        gateways=args.gateways,
        replicas=args.replicas,
        sim=sim,
        workload=workload,
        window_s=args.window_s,
        tenant_limits=Limits(input_tpm=tpm) if tpm else None,
        peer_args={
            "smg": tuple(shlex.split(args.smg_args)),
            "vllm-router": tuple(shlex.split(args.vllm_router_args)),
        },
        drain_timeout_s=args.drain_timeout,
        startup_timeout_s=args.startup_timeout,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """The `saltgate-bench fairness` command; 0 when every router ran, 1 if one could not."""
    try:
        options = _options(args)
        schedule = build_schedule(options.workload)
        tools = find_tools(args.tools_venv or default_tools_venv())
        for router in options.routers:
            if router not in GATEWAY_ROUTERS:
                tools.need(router)
    except BenchError as exc:
        print(f"saltgate-bench fairness: {exc}", file=sys.stderr)
        return 2
    w = options.workload
    quiet = sum(1 for r in schedule if r.tenant == QUIET)
    log(
        f"{len(schedule)} requests: quiet {quiet} ({w.quiet_rps} req/s, "
        f"{w.quiet_blocks * w.block_tokens} tokens), noisy {len(schedule) - quiet} in the "
        f"noisy phase (up to {w.noisy_peak_rps:.2f} req/s, {w.noisy_blocks * w.block_tokens} "
        f"tokens); 3 phases of {w.phase_s:.0f} s"
    )
    started = time.time()
    with workdir("saltgate-fairness-", args.workdir) as work:
        arms = asyncio.run(run_arms(options, schedule, tools, work))
    rows = [row for arm in arms for row in arm.rows]
    targets = check_targets(rows)
    print(markdown_table(rows))
    for line in targets:
        print(line)
    if args.json is not None:
        report = {
            "benchmark": "fairness",
            **run_header(started),
            "config": {
                "replicas": options.replicas,
                "sim": asdict(options.sim),
                "workload": asdict(w),
                "window_s": options.window_s,
                "capacity_prompt_tokens_per_s": capacity_tokens_per_s(
                    options.replicas, options.sim.prefill_ms_per_1k_tokens
                ),
                "governed_sections": governed_sections(),
                "tenant_limits": asdict(options.tenant_limits) if options.tenant_limits else None,
                "peer_args": {k: list(v) for k, v in options.peer_args.items()},
                "requests": len(schedule),
            },
            "machine": asdict(machine_info()),
            "tools": tool_versions(tools),
            "results": rows,
            "runs": [
                {"router": a.router, "gateways": a.gateways, "replay": a.result} for a in arms
            ],
            "targets": targets,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        panels = {f"{a.router} x{a.gateways}": a.records for a in arms if a.records}
        plot_ttft_over_time(w, panels, args.plot)
    return 1 if any("error" in a.result for a in arms) else 0
