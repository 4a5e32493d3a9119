"""`saltgate audit timing`: measure, from outside, whether one identity's prompts speed up
another's (the prompt-cache timing side channel), against any OpenAI-compatible base URL.

The procedure (docs/audit.md): per round, a shuffled schedule of trials (plan.py); each
batch of trials first lets the victim prime its prompts (concurrently: they are not
timed), then sends the probes ONE AT A TIME, so no probe ever queues behind another
request of the audit and both arms see the same conditions. TTFT is the time from sending
a streamed request to the first content chunk, on the monotonic perf_counter clock.
After each round stats.py decides; undecided configurations get another round until
`max_samples`. The positive control is probed at a quarter of the attack's rate (it stays
interleaved in time and costs little); a round that ends with the control not yet
detected gives it a full share in the next.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import orjson
from tqdm import tqdm  # type: ignore[import-untyped]

from saltgate.audit.plan import (
    ARMS,
    ROLES,
    ROUTE_PATHS,
    Identity,
    ProbeError,
    Role,
    StreamReader,
    TimingAuditConfig,
    Trial,
    error_message,
    render_prompt,
    request_body,
    schedule,
    trial_prompts,
)
from saltgate.audit.stats import (
    ArmComparison,
    Criteria,
    Verdict,
    compare_arms,
    configuration_verdict,
    control_detected,
    looks_needed,
    overall_verdict,
)
from saltgate.config import parse_authority
from saltgate.http import UpstreamError, UpstreamPool

__all__ = [
    "ConfigurationResult",
    "TimingAuditConfig",
    "TimingReport",
    "audit_criteria",
    "run_timing_audit",
]

TOKEN_IDS = range(16, 1000)  # inside any real vocabulary, clear of low special ids
LETTER_UNITS = range(26)
WARMUP_REQUESTS = 3
CONTROL_FRACTION = 0.25
CONTROL_MIN_SAMPLES = 20


def audit_criteria(config: TimingAuditConfig) -> Criteria:
    """The verdict thresholds, Bonferroni-corrected for this run's configurations and looks."""
    looks = looks_needed(config.samples, config.max_samples)
    return Criteria(
        alpha=config.alpha,
        auc_bound=config.auc_bound,
        control_alpha=config.control_alpha,
        family_size=Criteria.family(len(config.prefix_tokens), looks),
    )


def _cells() -> dict[Role, dict[str, list[float]]]:
    return {role: {arm: [] for arm in ARMS} for role in ROLES}


@dataclass(slots=True)
class ConfigurationResult:
    """One prefix length: every measured TTFT, the comparisons and the verdict so far."""

    prefix_tokens: int
    ttft_ms: dict[Role, dict[str, list[float]]] = field(default_factory=_cells)
    cached_tokens: dict[Role, dict[str, list[float]]] = field(default_factory=_cells)
    attack: ArmComparison | None = None
    control: ArmComparison | None = None
    verdict: Verdict = Verdict.INCONCLUSIVE

    def samples(self, role: Role) -> int:
        return min(len(v) for v in self.ttft_ms[role].values())

    def evaluate(self, criteria: Criteria, rng: np.random.Generator, *, at_cap: bool) -> None:
        self.attack = compare_arms(
            self.ttft_ms["attack"]["hit"], self.ttft_ms["attack"]["miss"], rng
        )
        self.control = compare_arms(
            self.ttft_ms["control"]["hit"], self.ttft_ms["control"]["miss"], rng
        )
        self.verdict = configuration_verdict(self.attack, self.control, criteria, at_cap=at_cap)


@dataclass(slots=True)
class TimingReport:
    verdict: Verdict
    configurations: list[ConfigurationResult]
    criteria: Criteria
    rounds: int
    elapsed_s: float
    target: dict[str, Any]

    @property
    def samples_per_arm(self) -> int:
        return max(c.samples("attack") for c in self.configurations)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON: `verdict` on top, the statistics beside it (no secrets)."""
        decided = [c for c in self.configurations if c.attack is not None]
        return {
            "verdict": self.verdict.value,
            "samples_per_arm": self.samples_per_arm,
            "rounds": self.rounds,
            "elapsed_s": round(self.elapsed_s, 3),
            "max_auc_high": max((c.attack.auc_high for c in decided if c.attack), default=None),
            "min_p_adjusted": min(
                (self.criteria.adjusted_p(c.attack) for c in decided if c.attack), default=None
            ),
            "criteria": {
                "alpha": self.criteria.alpha,
                "auc_bound": self.criteria.auc_bound,
                "control_alpha": self.criteria.control_alpha,
                "bonferroni_family_size": self.criteria.family_size,
            },
            "target": self.target,
            "configurations": [self._configuration(c) for c in self.configurations],
        }

    def _configuration(self, c: ConfigurationResult) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prefix_tokens": c.prefix_tokens,
            "verdict": c.verdict.value,
            "samples_per_arm": c.samples("attack"),
            "control_samples_per_arm": c.samples("control"),
        }
        pairs: tuple[tuple[Role, ArmComparison | None], ...] = (
            ("attack", c.attack),
            ("control", c.control),
        )
        for role, comparison in pairs:
            if comparison is None:
                continue
            stats: dict[str, Any] = {
                "hit_median_ms": comparison.hit_median_ms,
                "miss_median_ms": comparison.miss_median_ms,
                "ks_p": comparison.ks_p,
                "mwu_p": comparison.mwu_p,
                "p_adjusted": self.criteria.adjusted_p(comparison),
                "auc": comparison.auc,
                "auc_ci95": [comparison.auc_low, comparison.auc_high],
                "mean_cached_tokens": {
                    arm: (float(np.mean(v)) if v else None)
                    for arm, v in c.cached_tokens[role].items()
                },
            }
            if role == "control":
                stats["detected"] = control_detected(comparison, self.criteria)
            out[role] = stats
        out["ttft_ms"] = c.ttft_ms
        return out


class _Transport:
    """Plain http:// goes through the project's lean pooled client (a fifth of httpx's
    per-request CPU, so less of the audit's own jitter lands in the TTFT); https:// through
    httpx. Both keep connections alive, so no probe pays a handshake."""

    def __init__(self, base_url: str, timeout: float, max_connections: int) -> None:
        self.root = server_root(base_url)
        self.pool: UpstreamPool | None = None
        self.client: httpx.AsyncClient | None = None
        if urlsplit(self.root).scheme == "http":
            host, port, self.prefix = parse_authority(self.root)
            self.pool = UpstreamPool(host, port, response_timeout=timeout, read_timeout=timeout)
        else:
            self.prefix = ""
            self.client = httpx.AsyncClient(
                base_url=self.root,
                timeout=timeout,
                limits=httpx.Limits(max_connections=max_connections),
            )

    @asynccontextmanager
    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes = b""
    ) -> AsyncIterator[tuple[int, AsyncIterator[bytes]]]:
        """(status, body chunks); raises ProbeError when the exchange fails."""
        try:
            if self.pool is not None:
                pairs = [(k.encode(), v.encode()) for k, v in headers.items()]
                upstream = await self.pool.request(
                    method.encode(), (self.prefix + path).encode(), pairs, body
                )
                try:
                    yield upstream.status, upstream.chunks()
                finally:
                    upstream.release()
            else:
                assert self.client is not None
                request = self.client.build_request(method, path, headers=headers, content=body)
                response = await self.client.send(request, stream=True)
                try:
                    yield response.status_code, response.aiter_raw()
                finally:
                    await response.aclose()
        except (UpstreamError, httpx.HTTPError) as exc:
            raise ProbeError(f"{method} {path} failed: {_describe(exc)}") from None

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.client is not None:
            await self.client.aclose()


async def _read_all(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


class _Prober:
    """The imperative shell: sends requests and times them."""

    def __init__(self, config: TimingAuditConfig, transport: _Transport) -> None:
        self.config = config
        self.transport = transport
        self.path = ROUTE_PATHS[config.route]
        self.model = config.model or ""

    async def discover_model(self) -> str:
        async with self.transport.request("GET", "/v1/models", self.config.victim.headers()) as (
            status,
            chunks,
        ):
            raw = await _read_all(chunks)
        if status != 200:
            raise ProbeError(
                f"GET /v1/models answered {status}: {error_message(raw)} "
                "(pass --model to skip this)"
            )
        try:
            return str(orjson.loads(raw)["data"][0]["id"])
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise ProbeError("GET /v1/models did not list a model; pass --model") from None

    async def send(self, identity: Identity, units: list[int]) -> tuple[float, int | None]:
        """One streamed request; (TTFT in ms, cached prompt tokens if reported)."""
        cfg = self.config
        body = request_body(
            cfg.route, self.model, render_prompt(units, cfg.prompt_format), identity, cfg.max_tokens
        )
        headers = {"content-type": "application/json", **identity.headers()}
        reader = StreamReader()
        first: float | None = None
        started = time.perf_counter()
        async with self.transport.request("POST", self.path, headers, body) as (status, chunks):
            if status != 200:
                raw = await _read_all(chunks)
                raise ProbeError(f"POST {self.path} answered {status}: {error_message(raw)}")
            async for chunk in chunks:
                if reader.feed_bytes(chunk) and first is None:
                    first = time.perf_counter()
        if first is None:
            raise ProbeError(f"POST {self.path}: the stream ended without a token")
        return (first - started) * 1000.0, reader.cached_tokens

    async def prime(self, units: list[int]) -> None:
        for _ in range(self.config.victim_requests):
            await self.send(self.config.victim, units)


def server_root(base_url: str) -> str:
    """Accept a base URL with or without the OpenAI clients' trailing /v1."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def _describe(exc: Exception) -> str:
    """A transport error without its request (whose headers could hold a key)."""
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _batches(trials: Sequence[Trial], size: int) -> Iterator[Sequence[Trial]]:
    for i in range(0, len(trials), size):
        yield trials[i : i + size]


def _round_counts(
    results: Sequence[ConfigurationResult],
    active: Sequence[int],
    config: TimingAuditConfig,
    criteria: Criteria,
) -> list[tuple[int, Role, int]]:
    counts: list[tuple[int, Role, int]] = []
    for i in active:
        r = results[i]
        n = min(config.samples, config.max_samples - r.samples("attack"))
        control_n = max(CONTROL_MIN_SAMPLES, math.ceil(n * CONTROL_FRACTION))
        if r.control is not None and not control_detected(r.control, criteria):
            control_n = n  # not seen yet: give the control a full round
        counts += [(i, "attack", n), (i, "control", min(n, control_n))]
    return counts


async def run_timing_audit(config: TimingAuditConfig) -> TimingReport:
    """Run rounds until every configuration is decided, one leaks, or the cap is reached."""
    transport = _Transport(config.base_url, config.timeout_s, config.prime_batch + 2)
    try:
        return await _run(config, _Prober(config, transport))
    finally:
        await transport.close()


async def _run(config: TimingAuditConfig, prober: _Prober) -> TimingReport:
    started = time.monotonic()
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    criteria = audit_criteria(config)
    if not prober.model:
        prober.model = await prober.discover_model()
    vocab = TOKEN_IDS if config.prompt_format == "tokens" else LETTER_UNITS
    longest = max(config.prefix_tokens) + config.tail_tokens
    for _ in range(WARMUP_REQUESTS):  # connections, server-side first-use costs
        for identity in (config.victim, config.attacker):
            await prober.send(identity, [rng.choice(vocab) for _ in range(longest)])

    results = [ConfigurationResult(p) for p in config.prefix_tokens]
    active = list(range(len(results)))
    rounds = 0
    bar = tqdm(total=0, unit="probe", file=sys.stderr, disable=not config.progress)
    try:
        while active:
            trials = schedule(rng, _round_counts(results, active, config, criteria))
            bar.total += len(trials)
            bar.set_description(f"round {rounds + 1}")
            bar.refresh()
            for batch in _batches(trials, config.prime_batch):
                prompts = [
                    trial_prompts(
                        rng, config.prefix_tokens[t.configuration], config.tail_tokens, t.arm, vocab
                    )
                    for t in batch
                ]
                await asyncio.gather(*(prober.prime(p.victim) for p in prompts))
                for trial, p in zip(batch, prompts, strict=True):
                    identity = config.attacker if trial.role == "attack" else config.victim
                    ttft, cached = await prober.send(identity, p.probe)
                    result = results[trial.configuration]
                    result.ttft_ms[trial.role][trial.arm].append(ttft)
                    if cached is not None:
                        result.cached_tokens[trial.role][trial.arm].append(cached)
                    bar.update()
            rounds += 1
            for i in active:
                r = results[i]
                r.evaluate(criteria, np_rng, at_cap=r.samples("attack") >= config.max_samples)
            if any(r.verdict is Verdict.LEAK for r in results):
                break
            active = [
                i
                for i in active
                if results[i].verdict is Verdict.INCONCLUSIVE
                and results[i].samples("attack") < config.max_samples
            ]
    finally:
        bar.close()
    target = {
        "base_url": config.base_url,
        "route": ROUTE_PATHS[config.route],
        "model": prober.model,
        "preset": config.preset,
        "prompt_format": config.prompt_format,
        "tail_tokens": config.tail_tokens,
        "victim_requests": config.victim_requests,
        "victim": config.victim.describe(),
        "attacker": config.attacker.describe(),
        "seed": seed,
    }
    return TimingReport(
        verdict=overall_verdict([r.verdict for r in results]),
        configurations=results,
        criteria=criteria,
        rounds=rounds,
        elapsed_s=time.monotonic() - started,
        target=target,
    )
