"""What a replay measured, per policy: the numbers of docs/benchmarks.md, computed purely.

Cross-tenant cache hits: a replica can only legitimately serve a request from cache the
prefix that the SAME tenant had sent before. For each request the legitimate bound is the
longest block prefix it shares with another request of its tenant sent before its first
token arrived (its cache lookup happened before that, and a request sent later cannot
have filled the cache earlier). Sending counts, not finishing, so the bound errs towards
"legitimate": a reported hit is certain. Cached tokens beyond the bound came from another
tenant's blocks, so the request counts as a cross-tenant hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from saltgate_bench.trace_schedule import ReplayRequest


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it; times are seconds on the load generator's clock."""

    sent_at: float
    first_token_at: float | None = None
    done_at: float | None = None
    ok: bool = False
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    completion_tokens: int = 0
    error: str | None = None
    request_id: str | None = None  # the gateway's x-request-id: its usage record's id

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at


def legitimate_cached_tokens(
    schedule: Sequence[ReplayRequest], outcomes: Sequence[Outcome | None], block_size: int
) -> list[int | None]:
    """Per request, the cached tokens its own tenant's earlier requests can explain.

    None for requests that never got a first token (nothing to check). Hash ids are
    chained, so a shared id means the whole prefix up to it is shared: per tenant, each
    id keeps the two earliest sends through it, which is enough to find the earliest
    OTHER request through it.
    """
    earliest: dict[tuple[int, int], list[tuple[float, int]]] = {}
    for req, out in zip(schedule, outcomes, strict=True):
        if out is None:
            continue
        for h in req.hash_ids:
            entry = earliest.setdefault((req.tenant, h), [])
            entry.append((out.sent_at, req.index))
            if len(entry) > 2:
                entry.sort()
                del entry[2:]
    bounds: list[int | None] = []
    for req, out in zip(schedule, outcomes, strict=True):
        if out is None or out.first_token_at is None:
            bounds.append(None)
            continue
        depth = 0
        for d in range(len(req.hash_ids), 0, -1):
            entries = earliest[(req.tenant, req.hash_ids[d - 1])]
            if any(j != req.index and t < out.first_token_at for t, j in entries):
                depth = d
                break
        bounds.append(depth * block_size)
    return bounds


def cross_tenant_hits(
    schedule: Sequence[ReplayRequest], outcomes: Sequence[Outcome | None], block_size: int
) -> tuple[int, int]:
    """(requests with cached tokens beyond their tenant's own prefix, those extra tokens)."""
    hits = tokens = 0
    bounds = legitimate_cached_tokens(schedule, outcomes, block_size)
    for out, bound in zip(outcomes, bounds, strict=True):
        if out is None or bound is None or out.cached_tokens is None:
            continue
        if out.cached_tokens > bound:
            hits += 1
            tokens += out.cached_tokens - bound
    return hits, tokens


def percentile_ms(values_s: Sequence[float], q: float) -> float | None:
    """The q-th percentile in ms, interpolating linearly between ranks (numpy's default)."""
    if not values_s:
        return None
    ordered = sorted(values_s)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
    return round(value * 1000.0, 2)


def max_mean_load(per_replica: Sequence[int]) -> float | None:
    """Requests on the busiest replica over the mean per replica (1.0 = perfectly even)."""
    if not per_replica or sum(per_replica) == 0:
        return None
    return round(max(per_replica) / (sum(per_replica) / len(per_replica)), 3)


def summarize(
    policy: str,
    schedule: Sequence[ReplayRequest],
    outcomes: Sequence[Outcome | None],
    *,
    block_size: int,
    replica_requests: Sequence[int],
) -> dict[str, Any]:
    """The per-policy result object of the JSON report (fields documented in replay.py)."""
    done = [o for o in outcomes if o is not None and o.ok]
    failed = sum(1 for o in outcomes if o is None or not o.ok)
    prompt = sum(o.prompt_tokens for o in done)
    cached = sum(o.cached_tokens or 0 for o in done)
    ttfts = [t for o in done if (t := o.ttft_s) is not None]
    sent = [o.sent_at for o in outcomes if o is not None]
    ends = [o.done_at for o in done if o.done_at is not None]
    wall = (max(ends) - min(sent)) if ends and sent else 0.0
    hits, hit_tokens = cross_tenant_hits(schedule, outcomes, block_size)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o is not None and not o.ok:
            key = o.error or "unknown"
            errors[key] = errors.get(key, 0) + 1
    unsent = sum(1 for o in outcomes if o is None)
    if unsent:
        errors["not sent"] = unsent
    return {
        "policy": policy,
        "requests": len(schedule),
        "completed": len(done),
        "failed": failed,
        "cached_token_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "ttft_p50_ms": percentile_ms(ttfts, 50),
        "ttft_p90_ms": percentile_ms(ttfts, 90),
        "ttft_p99_ms": percentile_ms(ttfts, 99),
        "ttft_mean_ms": round(1000.0 * sum(ttfts) / len(ttfts), 2) if ttfts else None,
        "throughput_rps": round(len(done) / wall, 3) if wall > 0 else 0.0,
        "output_tokens_per_s": (
            round(sum(o.completion_tokens for o in done) / wall, 1) if wall > 0 else 0.0
        ),
        "wall_s": round(wall, 3),
        "replica_requests": list(replica_requests),
        "max_mean_load": max_mean_load(replica_requests),
        "cross_tenant_hits": hits,
        "cross_tenant_tokens": hit_tokens,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:10]),
    }


def check_targets(results: Sequence[dict[str, Any]], policy: str = "saltgate") -> list[str]:
    """The issue's targets, each a line starting PASS, MISS or N/A."""
    mine = next((r for r in results if r["policy"] == policy and "error" not in r), None)
    if mine is None:
        return [f"N/A: no result for {policy}"]
    ran = [r for r in results if "error" not in r]
    lines = []
    isolating = [r for r in ran if r["cross_tenant_hits"] == 0]
    best = max(isolating, key=lambda r: r["cached_token_ratio"], default=None)
    if mine["cross_tenant_hits"]:
        lines.append(f"MISS: {policy} had {mine['cross_tenant_hits']} cross-tenant cache hits")
    elif best is not None:
        verdict = "PASS" if mine["cached_token_ratio"] >= best["cached_token_ratio"] else "MISS"
        lines.append(
            f"{verdict}: highest cached-token ratio of the isolating policies "
            f"({policy} {mine['cached_token_ratio']:.3f}; best {best['policy']} "
            f"{best['cached_token_ratio']:.3f}; isolating: "
            f"{', '.join(r['policy'] for r in isolating)})"
        )
    with_p99 = [r for r in ran if r["ttft_p99_ms"] is not None]
    lowest = min(with_p99, key=lambda r: r["ttft_p99_ms"], default=None)
    if lowest is not None and mine["ttft_p99_ms"] is not None:
        verdict = "PASS" if mine["ttft_p99_ms"] <= lowest["ttft_p99_ms"] else "MISS"
        lines.append(
            f"{verdict}: lowest TTFT p99 of all ({policy} {mine['ttft_p99_ms']:.0f} ms; "
            f"lowest {lowest['policy']} {lowest['ttft_p99_ms']:.0f} ms)"
        )
    load = mine["max_mean_load"]
    if load is not None:
        verdict = "PASS" if load <= 1.5 else "MISS"
        lines.append(f"{verdict}: no replica above 1.5x the mean load ({policy} max/mean {load})")
    if mine["failed"]:
        lines.append(f"NOTE: {policy} had {mine['failed']} failed requests")
    return lines


FLEET_RATIO_TARGET = 0.97  # cached-token ratio of N shared gateways over one gateway's
FLEET_P99_TARGET = 1.1  # TTFT p99 of N shared gateways over one gateway's


def check_fleet_targets(results: Sequence[dict[str, Any]]) -> list[str]:
    """The fleet benchmark's targets, per policy, each line PASS, MISS or N/A: N gateways
    sharing state against one gateway (cached-token ratio >= 0.97x, TTFT p99 <= 1.1x),
    and in every variant 0 failed requests (a killed gateway excepted), 0 cross-tenant
    hits, and one ledger record per response delivered with a 200."""
    lines = []
    ran = [r for r in results if "error" not in r]
    for policy in dict.fromkeys(r["policy"] for r in ran):
        mine = [r for r in ran if r["policy"] == policy]
        one = next((r for r in mine if r["gateways"] == 1), None)
        for r in mine:
            name = f"{policy} x{r['gateways']} {'shared' if r['shared_state'] else 'alone'}"
            if one is not None and r is not one and r["shared_state"]:
                ratio = (
                    r["cached_token_ratio"] / one["cached_token_ratio"]
                    if one["cached_token_ratio"]
                    else 0.0
                )
                verdict = "PASS" if ratio >= FLEET_RATIO_TARGET else "MISS"
                lines.append(
                    f"{verdict}: {name} cached-token ratio {r['cached_token_ratio']:.3f} = "
                    f"{ratio:.3f}x of one gateway's {one['cached_token_ratio']:.3f} "
                    f"(target >= {FLEET_RATIO_TARGET}x)"
                )
                if r["ttft_p99_ms"] is not None and one["ttft_p99_ms"]:
                    p99 = r["ttft_p99_ms"] / one["ttft_p99_ms"]
                    verdict = "PASS" if p99 <= FLEET_P99_TARGET else "MISS"
                    lines.append(
                        f"{verdict}: {name} TTFT p99 {r['ttft_p99_ms']:.0f} ms = {p99:.2f}x of "
                        f"one gateway's {one['ttft_p99_ms']:.0f} ms (target <= {FLEET_P99_TARGET}x)"
                    )
            killed = "gateway_fault" in r
            if r["failed"] and not killed:
                lines.append(f"MISS: {name} had {r['failed']} failed requests")
            if r["cross_tenant_hits"]:
                lines.append(f"MISS: {name} had {r['cross_tenant_hits']} cross-tenant hits")
            ledger = r.get("ledger")
            if ledger is not None:
                whole = ledger["with_one_record"] == ledger["delivered_200"]
                lines.append(
                    f"{'PASS' if whole else 'MISS'}: {name} ledger: "
                    f"{ledger['with_one_record']} of {ledger['delivered_200']} responses "
                    f"delivered with a 200 have exactly one usage record"
                )
            if killed:
                fault = r["gateway_fault"]
                lines.append(
                    f"NOTE: {name} gateway {fault['gateway']} killed at "
                    f"{fault.get('killed_at_s')} s: {r['failed']} failed, "
                    f"{fault.get('failed_otherwise', '?')} of them not in flight at the kill"
                )
    return lines


def _label(r: dict[str, Any]) -> str:
    if r.get("gateways", 1) == 1 and not r.get("shared_state") and "ledger" not in r:
        return str(r["policy"])
    return f"{r['policy']} x{r['gateways']} {'shared' if r['shared_state'] else 'alone'}"


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(results: Sequence[dict[str, Any]]) -> str:
    head = (
        "| policy | cached-token ratio | TTFT p50 ms | TTFT p99 ms | req/s | out tok/s "
        "| max/mean load | failed | cross-tenant hits |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {_label(r)} | error: {r['error']} | | | | | | | |")
            continue
        rows.append(
            f"| {_label(r)} | {r['cached_token_ratio']:.3f} | {fmt(r['ttft_p50_ms'], '.0f')} "
            f"| {fmt(r['ttft_p99_ms'], '.0f')} | {r['throughput_rps']:.2f} "
            f"| {r['output_tokens_per_s']:.0f} | {fmt(r['max_mean_load'], '.2f')} "
            f"| {r['failed']} | {r['cross_tenant_hits']} |"
        )
    return head + "\n".join(rows) + "\n"
