"""The simulated engine's Prometheus metrics, named, bucketed and labelled as vLLM 0.32's.

Pure: the engine reports what happened to each request (:meth:`SimMetrics.finished`) and
each output token (:meth:`SimMetrics.token`); :func:`render` writes the exposition text,
HELP and TYPE lines included, as vLLM's prometheus_client writes them (a counter's family
is named with its `_total`, and each counter and histogram has a `_created` gauge).
Metrics vLLM exports that the simulator has no model for (speculative decoding, multimodal
caches, estimated FLOPs, HTTP middleware histograms) are left out; docs/conformance.md
lists the differences.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

__all__ = ["FINISHED_REASONS", "Histogram", "RequestTimes", "SimMetrics", "render"]

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")

_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_WAITING_BY_REASON_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
    "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
    "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting."
)
_CACHED_BY_SOURCE_HELP = (
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
    "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
    "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
    "vllm:external_prefix_cache_hits."
)
_CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
_TOKEN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0)
# vLLM's buckets of tokens per engine step (powers of two up to 16384)
_STEP_BUCKETS = tuple(float(2**i) for i in (0, *range(3, 15)))


@dataclass(slots=True)
class Histogram:
    """A cumulative-on-render histogram: one count per bucket, plus +Inf, sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One finished request's timeline (monotonic seconds) and token counts."""

    arrived: float
    admitted: float
    first_token: float | None
    finished: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finished_reason: str


# name, HELP text, buckets: the histograms vLLM exports that the simulator can fill
_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_BUCKETS),
    ("request_generation_tokens", "Number of generation tokens processed.", _TOKEN_BUCKETS),
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step.", _STEP_BUCKETS),
    (
        "time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        _TTFT_BUCKETS,
    ),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
    (
        "e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        _LATENCY_BUCKETS,
    ),
    (
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        _LATENCY_BUCKETS,
    ),
    (
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        _LATENCY_BUCKETS,
    ),
    (
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        _LATENCY_BUCKETS,
    ),
    (
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        _LATENCY_BUCKETS,
    ),
    (
        "request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        _TOKEN_BUCKETS,
    ),
)


class SimMetrics:
    """The counters and histograms of one simulated engine."""

    def __init__(self) -> None:
        self.created = time.time()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self.histograms = {name: Histogram(bounds) for name, _, bounds in _HISTOGRAMS}
        self._itl = self.histograms["inter_token_latency_seconds"]

    def token(self, since_previous: float | None) -> None:
        """One output token; ``since_previous`` is None for a request's first."""
        self.generation_tokens += 1
        if since_previous is not None:
            self._itl.observe(since_previous)

    def step(self, tokens: int) -> None:
        """One engine step that computed ``tokens`` prompt tokens."""
        self.histograms["iteration_tokens_total"].observe(tokens)

    def finished(self, t: RequestTimes) -> None:
        h = self.histograms
        self.prompt_tokens += t.prompt_tokens
        self.cached_tokens += t.cached_tokens
        self.success[t.finished_reason] += 1
        h["request_prompt_tokens"].observe(t.prompt_tokens)
        h["request_prefill_kv_computed_tokens"].observe(t.prompt_tokens - t.cached_tokens)
        h["request_generation_tokens"].observe(t.completion_tokens)
        h["e2e_request_latency_seconds"].observe(t.finished - t.arrived)
        h["request_queue_time_seconds"].observe(t.admitted - t.arrived)
        h["request_inference_time_seconds"].observe(t.finished - t.admitted)
        if t.first_token is not None:
            h["time_to_first_token_seconds"].observe(t.first_token - t.arrived)
            h["request_prefill_time_seconds"].observe(t.first_token - t.admitted)
            h["request_decode_time_seconds"].observe(t.finished - t.first_token)


def _labels(model: str, extra: str = "") -> str:
    """A label set as prometheus_client writes vLLM's: names sorted."""
    pairs = sorted(p for p in ('engine="0"', extra, f'model_name="{model}"') if p)
    return "{" + ",".join(pairs) + "}"


def _family(lines: list[str], name: str, help_text: str, kind: str) -> None:
    lines.append(f"# HELP vllm:{name} {help_text}")
    lines.append(f"# TYPE vllm:{name} {kind}")


def _counter(
    lines: list[str],
    *,
    model: str,
    created: float,
    name: str,
    help_text: str,
    samples: list[tuple[str, float]],
) -> None:
    _family(lines, f"{name}_total", help_text, "counter")
    lines.extend(f"vllm:{name}_total{_labels(model, extra)} {float(v)}" for extra, v in samples)
    _family(lines, f"{name}_created", help_text, "gauge")
    lines.extend(f"vllm:{name}_created{_labels(model, extra)} {created}" for extra, _ in samples)


def render(
    metrics: SimMetrics,
    *,
    model: str,
    running: int,
    waiting: int,
    kv_usage: float,
    queries_tokens: int,
    hits_tokens: int,
    cache_info: dict[str, str],
    mm_queries: int = 0,
    mm_hits: int = 0,
    connector_source: str | None = None,
) -> bytes:
    """The exposition text of one engine (engine="0"), in vLLM's names and label order.

    With `connector_source` (a KV connector, saltgate.sim.unsafe) every cached token is
    counted as the connector's too: as an external hit, and under that cache source."""
    base = _labels(model)
    created = metrics.created
    lines: list[str] = []
    _family(
        lines, "num_requests_running", "Number of requests in model execution batches.", "gauge"
    )
    lines.append(f"vllm:num_requests_running{base} {float(running)}")
    _family(lines, "num_requests_waiting", "Number of requests waiting to be processed.", "gauge")
    lines.append(f"vllm:num_requests_waiting{base} {float(waiting)}")
    _family(lines, "num_requests_waiting_by_reason", _WAITING_BY_REASON_HELP, "gauge")
    for reason, n in (("capacity", waiting), ("deferred", 0)):
        labels = _labels(model, f'reason="{reason}"')
        lines.append(f"vllm:num_requests_waiting_by_reason{labels} {float(n)}")
    _family(lines, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "gauge")
    lines.append(f"vllm:kv_cache_usage_perc{base} {float(kv_usage)}")
    cached = metrics.cached_tokens
    external = cached if connector_source is not None else 0
    counters: tuple[tuple[str, str, list[tuple[str, float]]], ...] = (
        (
            "prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            [("", queries_tokens)],
        ),
        (
            "prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            [("", hits_tokens)],
        ),
        (
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.",
            [("", external)],
        ),
        (
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.",
            [("", external)],
        ),
        (
            "mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items.",
            [("", mm_queries)],
        ),
        (
            "mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items.",
            [("", mm_hits)],
        ),
        ("num_preemptions", "Cumulative number of preemption from the engine.", [("", 0)]),
        ("prompt_tokens", "Number of prefill tokens processed.", [("", metrics.prompt_tokens)]),
        (
            "prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            [
                ('source="local_compute"', metrics.prompt_tokens - cached),
                ('source="local_cache_hit"', cached),
                ('source="external_kv_transfer"', 0),
            ],
        ),
        (
            "prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            [("", cached)],
        ),
        (
            "prompt_tokens_cached_by_source",
            _CACHED_BY_SOURCE_HELP,
            [
                (f'source="{s}"', cached if s == "device" else external * (s == connector_source))
                for s in _CACHE_TIERS
            ],
        ),
        (
            "generation_tokens",
            "Number of generation tokens processed.",
            [("", metrics.generation_tokens)],
        ),
        (
            "request_success",
            "Count of successfully processed requests.",
            [(f'finished_reason="{r}"', n) for r, n in metrics.success.items()],
        ),
    )
    for name, help_text, samples in counters:
        _counter(
            lines, model=model, created=created, name=name, help_text=help_text, samples=samples
        )
    for name, help_text, _ in _HISTOGRAMS:
        hist = metrics.histograms[name]
        _family(lines, name, help_text, "histogram")
        cumulative = 0
        les = [repr(float(b)) for b in hist.bounds] + ["+Inf"]
        for le, count in zip(les, hist.counts, strict=True):
            cumulative += count
            bucket = _labels(model, f'le="{le}"')
            lines.append(f"vllm:{name}_bucket{bucket} {float(cumulative)}")
        lines.append(f"vllm:{name}_count{base} {float(hist.n)}")
        lines.append(f"vllm:{name}_sum{base} {hist.total}")
        _family(lines, f"{name}_created", help_text, "gauge")
        lines.append(f"vllm:{name}_created{base} {created}")
    info = ",".join(f'{k}="{v}"' for k, v in sorted({**cache_info, "engine": "0"}.items()))
    _family(lines, "cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
    lines.append(f"vllm:cache_config_info{{{info}}} 1.0")
    return ("\n".join(lines) + "\n").encode()
