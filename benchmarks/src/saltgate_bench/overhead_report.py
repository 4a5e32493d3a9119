"""The overhead benchmark's results: typed records, medians over rounds, the latency each
router adds over going direct, saltgate's ratios to the peers, the py-spy summary, and
the JSON and markdown they are written as (docs/benchmarks.md quotes both).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from saltgate_bench.cpu import CpuUse
from saltgate_bench.procs import Machine
from saltgate_bench.wrk import WrkResult

TARGETS = (
    "direct",
    "saltgate",
    "saltgate-tls",
    "saltgate-noqueue",
    "envoy-epp",
    "smg",
    "vllm-router",
)
# saltgate-tls (saltgate serving HTTPS: TLS at the edge) and saltgate-noqueue (saltgate
# with [queue] enabled = false) run when asked for; envoy-epp (saltgate as Envoy's
# endpoint picker, docs/epp.md) beside saltgate's own edge by default.
DEFAULT_TARGETS = ("direct", "saltgate", "envoy-epp", "smg", "vllm-router")
PEERS = ("smg", "vllm-router")
SCENARIOS = ("nginx", "sim-stream")
SCENARIO_TITLES = {
    "nginx": "nginx backend: fixed chat-completion JSON, non-streaming",
    "sim-stream": "simulated replicas (saltgate sim, zero compute), streaming chat (SSE)",
}
BACKEND_BOUND = 0.85
LOAD_CPU_SATURATED = 90.0
# The CPU figures a point reports: medians over its rounds of the samples' CpuUse.
POINT_CPU_KEYS = (
    "router_proc_cpu_pct",
    "other_on_router_cpu_pct",
    "router_cpu_steal_pct",
    "load_cpu_busy_pct",
    "wrk_cpu_pct",
    "backend_cpu_pct",
    "other_on_load_cpu_pct",
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One wrk run against one target at one concurrency, in one round."""

    scenario: str
    target: str
    round: int
    concurrency: int
    wrk: WrkResult
    cpu: CpuUse = field(default_factory=CpuUse)

    def to_json(self) -> dict[str, Any]:
        head = {k: getattr(self, k) for k in ("scenario", "target", "round", "concurrency")}
        return {**head, **asdict(self.wrk), "cpu": self.cpu.to_json()}


@dataclass(slots=True)
class Point:
    """Medians over rounds for (scenario, target, concurrency), and what that adds."""

    scenario: str
    target: str
    concurrency: int
    rounds: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int
    router_proc_cpu_pct: float | None = None
    other_on_router_cpu_pct: float | None = None
    router_cpu_steal_pct: float | None = None
    load_cpu_busy_pct: float | None = None
    wrk_cpu_pct: float | None = None
    backend_cpu_pct: float | None = None
    other_on_load_cpu_pct: float | None = None
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    backend_bound: bool = False


@dataclass(frozen=True, slots=True)
class Ratio:
    """saltgate over one peer at one point (req/s: higher is better; added latency: lower)."""

    scenario: str
    concurrency: int
    peer: str
    rps_ratio: float | None
    added_p50_ratio: float | None
    added_p99_ratio: float | None
    added_p50_ms: float | None
    peer_added_p50_ms: float | None


@dataclass(frozen=True, slots=True)
class Ranked:
    frame: str
    samples: int
    pct: float


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    """py-spy's collapsed stacks as the top frames by own and total time, and by file."""

    samples: int
    top_own: list[Ranked]
    top_total: list[Ranked]
    own_by_file: list[Ranked]


@dataclass(frozen=True, slots=True)
class Profile:
    """A profile of saltgate under the highest concurrency, with where its files are."""

    summary: ProfileSummary
    scenario: str
    concurrency: int
    raw: str
    svg: str
    rps_while_profiling: float
    cpu_while_profiling: CpuUse

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self.summary),
            "scenario": self.scenario,
            "concurrency": self.concurrency,
            "raw": self.raw,
            "svg": self.svg,
            "rps_while_profiling": self.rps_while_profiling,
            "cpu_while_profiling": self.cpu_while_profiling.to_json(),
        }


@dataclass(frozen=True, slots=True)
class Pinning:
    load_and_backend_cpu: int | None
    router_cpus: list[int] | None  # one core, or every core with saltgate workers


@dataclass(frozen=True, slots=True)
class Meta:
    """How, when and on what the run was made."""

    started: str
    elapsed_s: float
    command: str
    machine: Machine
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]
    pinning: Pinning
    duration_s: int
    warmup_s: int
    rounds: int
    store: str  # saltgate's store: sqlite or postgres
    saltgate_workers: int  # `saltgate serve --workers N`
    concurrency: list[int]
    body_bytes: dict[str, int]
    versions: dict[str, str]
    saltgate_source: str
    upstream: str = "http"  # how the routers reach the backends: http, or https (TLS)
    limited: bool = False  # the tenant has limits that never refuse (--limited)


@dataclass(frozen=True, slots=True)
class OverheadResult:
    meta: Meta
    support: dict[str, dict[str, str]]  # target -> scenario -> how it went
    points: list[Point]
    ratios: list[Ratio]
    profiles: list[Profile]
    notes: list[str]
    samples: list[Sample]

    def to_json(self) -> dict[str, Any]:
        """The `--json` document (its shape is what docs/benchmarks.md describes)."""
        return {
            "meta": asdict(self.meta),
            "support": self.support,
            "points": [asdict(p) for p in self.points],
            "ratios": [asdict(r) for r in self.ratios],
            "profiles": [p.to_json() for p in self.profiles],
            "notes": self.notes,
            "samples": [s.to_json() for s in self.samples],
        }


# -- aggregation ----------------------------------------------------------------------------


def aggregate(samples: Sequence[Sample]) -> list[Point]:
    """Median over rounds per (scenario, target, concurrency), with latency added over direct."""
    groups: dict[tuple[str, str, int], list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.scenario, s.target, s.concurrency), []).append(s)
    points = []
    for (scenario, target, conc), group in groups.items():
        point = Point(
            scenario=scenario,
            target=target,
            concurrency=conc,
            rounds=len(group),
            rps=statistics.median(g.wrk.rps for g in group),
            p50_ms=statistics.median(g.wrk.p50_ms for g in group),
            p99_ms=statistics.median(g.wrk.p99_ms for g in group),
            errors=sum(g.wrk.errors for g in group),
            requests=sum(g.wrk.requests for g in group),
        )
        for key in POINT_CPU_KEYS:
            setattr(point, key, _median_cpu(group, key))
        points.append(point)
    direct = {(p.scenario, p.concurrency): p for p in points if p.target == "direct"}
    for p in points:
        d = direct.get((p.scenario, p.concurrency))
        p.added_p50_ms = p.p50_ms - d.p50_ms if d else None
        p.added_p99_ms = p.p99_ms - d.p99_ms if d else None
        # Within 15% of going direct, or wrk + backend themselves filling the load core: the
        # backend, not the router, set the pace, and "added latency" means little. (Other
        # tenants' load on that core is noise, reported in its own column, not this.)
        ours = (p.wrk_cpu_pct or 0.0) + (p.backend_cpu_pct or 0.0)
        p.backend_bound = bool(
            d and p is not d and (p.rps >= BACKEND_BOUND * d.rps or ours >= LOAD_CPU_SATURATED)
        )
    return points


def _median_cpu(group: Sequence[Sample], key: str) -> float | None:
    values = [v for g in group if (v := getattr(g.cpu, key)) is not None]
    return round(statistics.median(values), 1) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def ratios(points: Sequence[Point]) -> list[Ratio]:
    """saltgate over each peer, per scenario and concurrency (rps: higher is better)."""
    by_key = {(p.scenario, p.target, p.concurrency): p for p in points}
    out = []
    for (scenario, target, conc), p in sorted(by_key.items()):
        if target != "saltgate":
            continue
        for peer in PEERS:
            q = by_key.get((scenario, peer, conc))
            if q is None:
                continue
            out.append(
                Ratio(
                    scenario=scenario,
                    concurrency=conc,
                    peer=peer,
                    rps_ratio=_ratio(p.rps, q.rps),
                    added_p50_ratio=_ratio(p.added_p50_ms, q.added_p50_ms),
                    added_p99_ratio=_ratio(p.added_p99_ms, q.added_p99_ms),
                    added_p50_ms=p.added_p50_ms,
                    peer_added_p50_ms=q.added_p50_ms,
                )
            )
    return out


# -- the markdown report --------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} us" if abs(value) < 1 else f"{value:.2f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _cpus(cpus: list[int] | None) -> str:
    return "unpinned" if cpus is None else ",".join(str(c) for c in cpus)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(result: OverheadResult) -> str:
    meta = result.meta
    lines = [
        "## Gateway overhead: results",
        "",
        f"{meta.started}; {meta.machine.cpu} ({meta.machine.cpus} CPUs); "
        f"load average before {meta.loadavg_before[0]:.2f}, after "
        f"{meta.loadavg_after[0]:.2f}; wrk -t1, {meta.duration_s} s per point after a "
        f"{meta.warmup_s} s warm-up, median of {meta.rounds} round(s); pinning: wrk and "
        f"backend on CPU {meta.pinning.load_and_backend_cpu}, routers on CPU "
        f"{_cpus(meta.pinning.router_cpus)}; saltgate's store: {meta.store}; "
        f"saltgate workers: {meta.saltgate_workers}; "
        f"tenant limited: {'yes' if meta.limited else 'no'}; "
        f"routers to backends: {meta.upstream}; "
        f"saltgate source {meta.saltgate_source}.",
        "",
        "Scenario support (a target is run in every scenario; this is how it went):",
        "",
        "| target | " + " | ".join(SCENARIOS) + " |",
        "|---|" + "---|" * len(SCENARIOS),
    ]
    for target, per in result.support.items():
        lines.append(f"| {target} | " + " | ".join(per.get(s, "not run") for s in SCENARIOS) + " |")
    for scenario in SCENARIOS:
        points = [p for p in result.points if p.scenario == scenario]
        if not points:
            continue
        lines += [
            "",
            f"### {SCENARIO_TITLES[scenario]}",
            "",
            "| target | conc | req/s | p50 | p99 | added p50 | added p99 | errors "
            "| router CPU | others on router core | load core busy (wrk/backend/others) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        order = {t: i for i, t in enumerate(TARGETS)}
        for p in sorted(points, key=lambda p: (p.concurrency, order.get(p.target, 9))):
            bound = " (backend-bound)" if p.backend_bound else ""
            lines.append(
                f"| {p.target} | {p.concurrency} | {p.rps:,.0f}{bound} | "
                f"{_ms(p.p50_ms)} | {_ms(p.p99_ms)} | {_ms(p.added_p50_ms)} | "
                f"{_ms(p.added_p99_ms)} | {p.errors} | "
                f"{_pct(p.router_proc_cpu_pct)} | "
                f"{_pct(p.other_on_router_cpu_pct)} | "
                f"{_pct(p.load_cpu_busy_pct)} ({_pct(p.wrk_cpu_pct)}/"
                f"{_pct(p.backend_cpu_pct)}/{_pct(p.other_on_load_cpu_pct)}) |"
            )
    lines += tls_cost(result.points)
    if result.ratios:
        lines += [
            "",
            "### saltgate relative to the peers (req/s: higher is better; added latency: lower)",
            "",
            "| scenario | conc | peer | req/s ratio | added p50 ratio | added p99 ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in result.ratios:
            lines.append(
                f"| {r.scenario} | {r.concurrency} | {r.peer} | {_x(r.rps_ratio)} | "
                f"{_x(r.added_p50_ratio)} | {_x(r.added_p99_ratio)} |"
            )
        lines += ["", *target_checks(result.ratios)]
    for prof in result.profiles:
        lines += ["", *profile_markdown(prof)]
    if result.notes:
        lines += ["", "Notes:", *(f"- {n}" for n in result.notes)]
    return "\n".join(lines) + "\n"


def tls_cost(points: Sequence[Point]) -> list[str]:
    """What TLS at the edge costs: saltgate-tls against saltgate of the same run, per
    scenario and concurrency (latency added, req/s kept, the router's CPU per request:
    the steadiest of the three on a shared machine)."""
    by_key = {(p.scenario, p.target, p.concurrency): p for p in points}
    rows = [
        f"| {scenario} | {conc} | {plain.rps:,.0f} | {tls.rps:,.0f} | "
        f"{_x(_ratio(tls.rps, plain.rps))} | {_ms(tls.p50_ms - plain.p50_ms)} | "
        f"{_ms(tls.p99_ms - plain.p99_ms)} | {_ms(_cpu_ms(plain))} | {_ms(_cpu_ms(tls))} |"
        for (scenario, target, conc), tls in sorted(by_key.items())
        if target == "saltgate-tls" and (plain := by_key.get((scenario, "saltgate", conc)))
    ]
    if not rows:
        return []
    return [
        "",
        "### TLS at the edge: saltgate-tls against saltgate (HTTPS vs HTTP to the gateway)",
        "",
        "| scenario | conc | req/s HTTP | req/s HTTPS | HTTPS/HTTP | added p50 | added p99 "
        "| CPU/request HTTP | CPU/request HTTPS |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def _cpu_ms(p: Point) -> float | None:
    """The router's CPU time per request, in ms (its CPU share over its req/s)."""
    if p.router_proc_cpu_pct is None or p.rps <= 0:
        return None
    return p.router_proc_cpu_pct * 10 / p.rps


def target_checks(rows: Sequence[Ratio]) -> list[str]:
    """The issue's targets: >= 1.0x smg's req/s at high concurrency; added p50 at c=1 <= smg's."""
    out = []
    for r in rows:
        if r.peer != "smg":
            continue
        if r.concurrency > 1 and r.rps_ratio is not None:
            verdict = "met" if r.rps_ratio >= 1.0 else "NOT met"
            out.append(
                f"- target saltgate req/s >= 1.0x smg ({r.scenario}, c={r.concurrency}): "
                f"{r.rps_ratio:.2f}x, {verdict}"
            )
        if r.concurrency == 1 and r.added_p50_ms is not None and r.peer_added_p50_ms:
            verdict = "met" if r.added_p50_ms <= r.peer_added_p50_ms else "NOT met"
            out.append(
                f"- target added p50 at c=1 <= smg's ({r.scenario}): "
                f"{_ms(r.added_p50_ms)} vs {_ms(r.peer_added_p50_ms)}, {verdict}"
            )
    return out


# -- profile summary ------------------------------------------------------------------------


def summarize_profile(raw: str, top: int = 20) -> ProfileSummary:
    """py-spy `--format raw` (collapsed stacks) to top frames by own and by total samples."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    files: dict[str, int] = {}
    samples = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        # --subprocesses (saltgate's workers) puts 'process PID:"argv"' frames on top.
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")]
        if not frames:
            continue
        samples += count
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + count
        files[_frame_file(leaf)] = files.get(_frame_file(leaf), 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count

    def ranked(table: dict[str, int]) -> list[Ranked]:
        rows = sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:top]
        return [Ranked(k, v, round(100.0 * v / samples, 1) if samples else 0.0) for k, v in rows]

    return ProfileSummary(samples, ranked(own), ranked(total), ranked(files))


def _frame_file(frame: str) -> str:
    match = re.search(r"\(([^():]+)(?::\d+)?\)\s*$", frame)
    if match is None:
        return frame
    path = match.group(1)
    for marker in ("site-packages/", "/src/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _short_frame(frame: str) -> str:
    match = re.fullmatch(r"(.*?) \((.*?)\)\s*", frame)
    if match is None:
        return frame
    return f"{match.group(1)} ({_frame_file(frame)}{_line_of(match.group(2))})"


def _line_of(location: str) -> str:
    match = re.search(r":(\d+)$", location)
    return f":{match.group(1)}" if match else ""


def profile_markdown(prof: Profile, top: int = 15) -> list[str]:
    summary = prof.summary
    lines = [
        f"### py-spy --gil: saltgate, {prof.scenario}, c={prof.concurrency} "
        f"({summary.samples} samples, {prof.rps_while_profiling:,.0f} req/s while sampled)",
        "",
        "| own % | function (file:first line) | | total % | function |",
        "|---|---|---|---|---|",
    ]
    rows_own = summary.top_own[:top]
    rows_total = summary.top_total[:top]
    for i in range(max(len(rows_own), len(rows_total))):
        a = rows_own[i] if i < len(rows_own) else None
        b = rows_total[i] if i < len(rows_total) else None
        lines.append(
            f"| {a.pct if a else ''} | {_short_frame(a.frame) if a else ''} | | "
            f"{b.pct if b else ''} | {_short_frame(b.frame) if b else ''} |"
        )
    lines += [
        "",
        "Own time by file: " + ", ".join(f"{r.frame} {r.pct}%" for r in summary.own_by_file[:10]),
        f"Raw stacks: {prof.raw}; flame graph: {prof.svg}",
    ]
    return lines
