"""The fairness benchmark's workload and measures, computed purely (no sockets, no clocks).

Workload (docs/benchmarks.md, "Fairness"): two tenants in three phases of equal length.
The quiet tenant (0) sends short prompts at a steady Poisson rate throughout; the noisy
tenant (1) sends long prompts only in the `noisy` phase, its Poisson rate ramping
linearly from 0 to its peak over the first half of the phase, then holding. Each
tenant's prompts start with a prefix it shares with its own other requests (the quiet
tenant one system prompt, the noisy tenant one of a few documents), then a part of
their own, so routers can keep prefix locality and the cached-token ratio means
something. Share and capacity are prefill tokens per second: the simulator prefills one
prompt at a time per replica (docs/sim.md), so that is what saturates.

Service is the VTC paper's cost, input + 2 x output tokens (Sheng et al., OSDI'24,
arXiv 2401.00588). The service difference of a window follows its artifact
(github.com/Ying1123/VTC-artifact, fair_bench/plot/plot_6.2_work_diff.py): a request's
service is spread evenly over [first token, last token] and counted in a window by
overlap, a tenant's demand is the cost of what it sent in the window, both per second;
the difference is the largest shortfall max_k(s_k) - s_j of a tenant j, capped by what
j asked for beyond what it got (d_j - s_j), so a tenant asking for less than the others
received is not counted as wronged: the gap among backlogged tenants.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from saltgate_bench.replay_client import UNFINISHED
from saltgate_bench.replay_metrics import Outcome, fmt, percentile_ms
from saltgate_bench.trace_schedule import ReplayRequest

PHASES = ("alone", "noisy", "after")
QUIET, NOISY = 0, 1
TENANTS = 2
OUTPUT_WEIGHT = 2  # VTC: an output token costs two input tokens
MAX_BLOCKS = 1 << 16  # prompt blocks per request the hash-id layout leaves room for


def service_cost(input_tokens: int, output_tokens: int) -> int:
    return input_tokens + OUTPUT_WEIGHT * output_tokens


def capacity_tokens_per_s(replicas: int, prefill_ms_per_1k_tokens: float) -> float:
    """Uncached prompt tokens per second the replicas prefill, all of them busy."""
    return replicas * 1_000_000.0 / prefill_ms_per_1k_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    phase_s: float
    quiet_rps: float
    noisy_peak_rps: float
    quiet_blocks: int  # a prompt is blocks x block_tokens one-token words
    noisy_blocks: int
    block_tokens: int
    quiet_max_tokens: int
    noisy_max_tokens: int
    shared_fraction: float  # of each prompt: the prefix shared with the tenant's requests
    documents: int  # the noisy tenant's distinct shared prefixes
    seed: int = 0

    def bounds(self, phase: str) -> tuple[float, float]:
        i = PHASES.index(phase)
        return i * self.phase_s, (i + 1) * self.phase_s

    def blocks(self, tenant: int) -> int:
        return self.quiet_blocks if tenant == QUIET else self.noisy_blocks

    def max_tokens(self, tenant: int) -> int:
        return self.quiet_max_tokens if tenant == QUIET else self.noisy_max_tokens

    def noisy_rate(self, t: float) -> float:
        """The noisy tenant's request rate at time t: a ramp, a plateau, nothing outside."""
        start, end = self.bounds("noisy")
        if not start <= t < end:
            return 0.0
        return self.noisy_peak_rps * min(1.0, (t - start) / (self.phase_s / 2))


def _arrivals(rng: random.Random, peak: float, start: float, end: float) -> list[float]:
    """Poisson arrivals at rate ``peak`` in [start, end)."""
    out: list[float] = []
    if peak <= 0:
        return out
    t = start + rng.expovariate(peak)
    while t < end:
        out.append(t)
        t += rng.expovariate(peak)
    return out


def hash_ids(w: Workload, tenant: int, index: int, document: int) -> tuple[int, ...]:
    """Block ids of one prompt: the tenant's shared prefix (per document), then blocks
    of this request alone. Ids differ across tenants, so nothing is shared between them
    even before salting."""
    blocks = w.blocks(tenant)
    shared = round(blocks * w.shared_fraction)
    base = (tenant + 1) << 48
    prefix = [base | (document << 20) | k for k in range(shared)]
    own = [base | (1 << 47) | (index << 16) | k for k in range(blocks - shared)]
    return (*prefix, *own)


def build_schedule(w: Workload) -> list[ReplayRequest]:
    """Both tenants' requests in send order; each tenant has its own seeded generator, so
    the quiet tenant's arrivals do not change with the noisy tenant's settings."""
    if max(w.quiet_blocks, w.noisy_blocks) >= MAX_BLOCKS:
        raise ValueError(f"prompts of {MAX_BLOCKS} blocks or more are not supported")
    quiet_rng = random.Random(f"{w.seed}:quiet")
    noisy_rng = random.Random(f"{w.seed}:noisy")
    timed = [(t, QUIET) for t in _arrivals(quiet_rng, w.quiet_rps, 0.0, 3 * w.phase_s)]
    start, end = w.bounds("noisy")
    for t in _arrivals(noisy_rng, w.noisy_peak_rps, start, end):
        # thinning: a candidate at the peak rate is kept with probability rate(t) / peak
        if noisy_rng.random() * w.noisy_peak_rps < w.noisy_rate(t):
            timed.append((t, NOISY))
    timed.sort()
    out = []
    for i, (t, tenant) in enumerate(timed):
        document = 0 if tenant == QUIET else noisy_rng.randrange(w.documents)
        out.append(
            ReplayRequest(
                index=i,
                trace_index=i,
                at_s=t,
                tenant=tenant,
                session=tenant * w.documents + document,
                hash_ids=hash_ids(w, tenant, i, document),
                max_tokens=w.max_tokens(tenant),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Record:
    """One request as the measures need it; times on the load generator's clock."""

    tenant: int
    sent_at: float
    demand: int  # the service it asked for: its prompt and max_tokens, as sent
    ok: bool = False
    first_token_at: float | None = None
    done_at: float | None = None
    service: int = 0  # the service it got, from its metered usage
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def rejected(self) -> bool:
        """Refused or failed by the router, as opposed to cut off when the run ended."""
        return not self.ok and not (self.error or "").startswith(UNFINISHED)

    @property
    def unfinished(self) -> bool:
        return not self.ok and not self.rejected


def records(
    schedule: Sequence[ReplayRequest], outcomes: Sequence[Outcome | None], block_tokens: int
) -> list[Record]:
    """The schedule joined with what the client saw; requests never sent are left out."""
    out = []
    for req, o in zip(schedule, outcomes, strict=True):
        if o is None:
            continue
        demand = service_cost(len(req.hash_ids) * block_tokens, req.max_tokens)
        out.append(
            Record(
                tenant=req.tenant,
                sent_at=o.sent_at,
                demand=demand,
                ok=o.ok,
                first_token_at=o.first_token_at,
                done_at=o.done_at,
                service=service_cost(o.prompt_tokens, o.completion_tokens) if o.ok else 0,
                prompt_tokens=o.prompt_tokens,
                cached_tokens=o.cached_tokens or 0,
                error=o.error,
            )
        )
    return out


def service_in(r: Record, start: float, end: float) -> float:
    """The part of r's service received in [start, end): spread evenly over its
    [first token, last token], all at once if those coincide."""
    if not r.ok or r.first_token_at is None or r.done_at is None:
        return 0.0
    span = r.done_at - r.first_token_at
    if span <= 0:
        return float(r.service) if start <= r.first_token_at < end else 0.0
    overlap = min(end, r.done_at) - max(start, r.first_token_at)
    return r.service * max(0.0, overlap) / span


def window_difference(rs: Sequence[Record], start: float, end: float) -> float:
    """The service difference of one window, in service per second."""
    width = end - start
    got = [0.0] * TENANTS
    asked = [0.0] * TENANTS
    for r in rs:
        got[r.tenant] += service_in(r, start, end)
        if start <= r.sent_at < end:
            asked[r.tenant] += r.demand
    top = max(got)
    worst = max(min(top - s, d - s) for s, d in zip(got, asked, strict=True))
    return max(0.0, worst) / width


def windows(start: float, end: float, window_s: float) -> list[tuple[float, float]]:
    """Consecutive windows of window_s from start (what is left at the end is dropped);
    one window of the whole span if it is shorter than window_s."""
    width = min(window_s, end - start)
    count = max(1, int((end - start) / width + 1e-9))
    return [(start + i * width, start + (i + 1) * width) for i in range(count)]


def service_difference(rs: Sequence[Record], start: float, end: float, window_s: float) -> float:
    """The largest window difference in [start, end) (the VTC paper's "max diff")."""
    return max(window_difference(rs, a, b) for a, b in windows(start, end, window_s))


def phase_summary(rs: Sequence[Record], w: Workload, phase: str, window_s: float) -> dict[str, Any]:
    """One phase's row. Requests count in the phase they were sent in (TTFT, rejections,
    cached tokens); rates count what finished, or the service received, in the phase.
    Rejected: answered with an error (a 429, a 503, a broken stream); unfinished: still
    waiting when the run stopped (--drain-timeout after the last send), so missing from
    the TTFT percentiles."""
    start, end = w.bounds(phase)
    span = end - start
    sent = [r for r in rs if start <= r.sent_at < end]
    quiet = [r for r in sent if r.tenant == QUIET]
    noisy = [r for r in sent if r.tenant == NOISY]
    ttfts = [t for r in quiet if r.ok and (t := r.ttft_s) is not None]
    finished = [r for r in rs if r.ok and r.done_at is not None and start <= r.done_at < end]
    served = [r for r in sent if r.ok]
    prompt = sum(r.prompt_tokens for r in served)
    errors: dict[str, int] = {}
    for r in sent:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "phase": phase,
        "quiet_requests": len(quiet),
        "quiet_ttft_p50_ms": percentile_ms(ttfts, 50),
        "quiet_ttft_p99_ms": percentile_ms(ttfts, 99),
        "quiet_rejected": sum(1 for r in quiet if r.rejected),
        "quiet_unfinished": sum(1 for r in quiet if r.unfinished),
        "noisy_requests": len(noisy),
        "noisy_rejected": sum(1 for r in noisy if r.rejected),
        "noisy_unfinished": sum(1 for r in noisy if r.unfinished),
        "noisy_rps": round(sum(1 for r in finished if r.tenant == NOISY) / span, 3),
        "total_rps": round(len(finished) / span, 3),
        "service_per_s": round(sum(service_in(r, start, end) for r in rs) / span, 1),
        "cached_token_ratio": round(sum(r.cached_tokens for r in served) / prompt, 4)
        if prompt
        else 0.0,
        "service_difference": round(service_difference(rs, start, end, window_s), 1),
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
    }


# -- targets and table ------------------------------------------------------------------------

QUIET_P99_TARGET = 1.2  # noisy-phase quiet TTFT p99 over the alone phase's
DIFFERENCE_TARGET = 5.0  # service difference at least this many times lower than ungoverned
FLEET_DIFFERENCE_TARGET = 1.1  # N gateways' service difference over one gateway's
CACHE_TARGET = 0.9  # cached-token ratio at least this share of the ungoverned one
# Total service per second at most this share below the ungoverned arm's: the target is
# that fairness wastes no capacity. More is no waste (a short queue per replica can finish
# more in the phase than replicas carrying a backlog), so only a shortfall misses.
THROUGHPUT_TARGET = 0.05


def _row(rows: Sequence[dict[str, Any]], router: str, gateways: int, phase: str) -> Any:
    return next(
        (
            r
            for r in rows
            if (r["router"], r["gateways"], r["phase"]) == (router, gateways, phase)
            and "error" not in r
        ),
        None,
    )


def check_targets(rows: Sequence[dict[str, Any]], governed: str = "saltgate") -> list[str]:
    """The issue's fairness targets for the governed router, each a line PASS or MISS
    (N/A when a run is missing), at every gateway count it ran with."""
    lines = []
    counts = sorted({r["gateways"] for r in rows if r["router"] == governed})
    for n in counts:
        name = f"{governed} x{n}"
        alone, noisy = _row(rows, governed, n, "alone"), _row(rows, governed, n, "noisy")
        if alone is None or noisy is None:
            lines.append(f"N/A: {name} did not run")
            continue
        if alone["quiet_ttft_p99_ms"] and noisy["quiet_ttft_p99_ms"] is not None:
            ratio = noisy["quiet_ttft_p99_ms"] / alone["quiet_ttft_p99_ms"]
            lines.append(
                f"{'PASS' if ratio <= QUIET_P99_TARGET else 'MISS'}: {name} quiet TTFT p99 "
                f"{noisy['quiet_ttft_p99_ms']:.0f} ms beside the noisy tenant = {ratio:.2f}x "
                f"alone (target <= {QUIET_P99_TARGET}x)"
            )
        rejected = sum(
            r["quiet_rejected"] for p in PHASES if (r := _row(rows, governed, n, p)) is not None
        )
        lines.append(f"{'PASS' if rejected == 0 else 'MISS'}: {name} {rejected} quiet rejections")
        base = _row(rows, f"{governed}-ungoverned", n, "noisy")
        if base is None:
            lines.append(f"N/A: no {governed}-ungoverned x{n} to compare with")
        else:
            mine, theirs = noisy["service_difference"], base["service_difference"]
            ok = mine * DIFFERENCE_TARGET <= theirs
            lines.append(
                f"{'PASS' if ok else 'MISS'}: {name} service difference {mine:.0f}/s against "
                f"{theirs:.0f}/s ungoverned (target >= {DIFFERENCE_TARGET:.0f}x lower)"
            )
            ok = noisy["cached_token_ratio"] >= CACHE_TARGET * base["cached_token_ratio"]
            lines.append(
                f"{'PASS' if ok else 'MISS'}: {name} cached-token ratio "
                f"{noisy['cached_token_ratio']:.3f} against {base['cached_token_ratio']:.3f} "
                f"ungoverned (target >= {CACHE_TARGET}x)"
            )
            ours, ref = noisy["service_per_s"], base["service_per_s"]
            ok = ours >= (1 - THROUGHPUT_TARGET) * ref
            lines.append(
                f"{'PASS' if ok else 'MISS'}: {name} throughput {ours:.0f} service/s against "
                f"{ref:.0f}/s ungoverned ({ours / ref - 1 if ref else 0.0:+.0%}; target: "
                f"at most {THROUGHPUT_TARGET:.0%} less)"
            )
        one = _row(rows, governed, 1, "noisy")
        if n > 1 and one is not None:
            ok = noisy["service_difference"] <= FLEET_DIFFERENCE_TARGET * max(
                one["service_difference"], 1.0
            )
            lines.append(
                f"{'PASS' if ok else 'MISS'}: {name} service difference "
                f"{noisy['service_difference']:.0f}/s against {one['service_difference']:.0f}/s "
                f"at one gateway (target <= {FLEET_DIFFERENCE_TARGET}x)"
            )
    return lines


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| router | gateways | phase | quiet TTFT p50 / p99 ms | quiet rejected | noisy req/s "
        "| total req/s | service/s | cached-token ratio | service difference /s |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        where = f"| {r['router']} | {r['gateways']} | {r['phase']} |"
        if "error" in r:
            lines.append(f"{where} error: {r['error']} | | | | | | |")
            continue
        cut = f" (+{r['quiet_unfinished']} unfinished)" if r["quiet_unfinished"] else ""
        lines.append(
            f"{where} {fmt(r['quiet_ttft_p50_ms'], '.0f')} / "
            f"{fmt(r['quiet_ttft_p99_ms'], '.0f')} | {r['quiet_rejected']}{cut} "
            f"| {r['noisy_rps']:.2f} | {r['total_rps']:.2f} | {r['service_per_s']:.0f} "
            f"| {r['cached_token_ratio']:.3f} | {r['service_difference']:.0f} |"
        )
    return head + "\n".join(lines) + "\n"
