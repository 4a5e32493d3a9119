"""Prometheus metrics for the admin port: counters, gauges and histograms.

Hand-rolled because the hot path pays for every increment: a dict update is a tenth of
what a locked client-library counter costs. Label values come from a closed set chosen
by the gateway (route, status, replica URL, token kind, worker index, tenant id, a model
the gateway knows), never a name a client chose: no tenant secret, API key or salt can
reach a label, and no client can grow the number of series by inventing model names.
docs/observability.md lists every metric.

With worker processes (docs/workers.md) each worker keeps its own `Metrics`, sends the
parent a `Snapshot` (plain data, JSON on the wire) and the parent renders the merge:
counters and histograms summed over workers, gauges kept per worker.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

# Request durations end at the upstream timeout (`duration_buckets`): past it a request
# has failed, so a bucket beyond it would never fill. (Not `Final`: the compiled build
# leaves a Final tuple unset when another compiled module imports it.)
DURATION_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)  # fmt: skip
# Time to first token of an LLM: tens of milliseconds on an idle replica with the prefix
# cached, seconds to a minute for a long prompt prefilled behind a queue.
TTFT_BUCKETS = (
    0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0
)  # fmt: skip

Labels = tuple[tuple[str, str], ...]


def duration_buckets(timeout_s: float) -> tuple[float, ...]:
    """DURATION_BUCKETS up to the upstream timeout, which is the last bound."""
    return (*(b for b in DURATION_BUCKETS if b < timeout_s), float(timeout_s))


def _escape(value: str) -> str:
    """A label value as the exposition format quotes it (a model id may hold anything)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


@dataclass(slots=True)
class Counter:
    kind: str
    help: str
    values: dict[Labels, float] = field(default_factory=dict)


@dataclass(slots=True)
class Gauge:
    help: str
    values: list[tuple[Labels, float]] = field(default_factory=list)


@dataclass(slots=True)
class Histogram:
    """Per label set: a count per bucket (the last one +Inf, not cumulative) and the sum."""

    help: str
    buckets: tuple[float, ...]
    values: dict[Labels, tuple[list[int], float]] = field(default_factory=dict)


@dataclass(slots=True)
class Snapshot:
    """Every metric's value at one moment, as plain data: what `render` formats and what
    a worker sends its parent."""

    counters: dict[str, Counter] = field(default_factory=dict)
    gauges: dict[str, Gauge] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def add_counts(self, other: Snapshot) -> None:
        """Add `other`'s counters and histograms into these (gauges are not additive)."""
        for name, counter in other.counters.items():
            mine = self.counters.setdefault(name, Counter(counter.kind, counter.help))
            for labels, value in counter.values.items():
                mine.values[labels] = mine.values.get(labels, 0.0) + value
        for name, hist in other.histograms.items():
            have = self.histograms.setdefault(name, Histogram(hist.help, hist.buckets))
            if have.buckets != hist.buckets:
                raise ValueError(f"{name}: histogram buckets do not match")
            for labels, (counts, total) in hist.values.items():
                old = have.values.get(labels)
                if old is None:
                    have.values[labels] = (list(counts), total)
                else:
                    summed = [a + b for a, b in zip(old[0], counts, strict=True)]
                    have.values[labels] = (summed, old[1] + total)

    def total(self, name: str) -> float:
        """A counter summed over its labels (0 if absent)."""
        counter = self.counters.get(name)
        return sum(counter.values.values()) if counter is not None else 0.0

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "counters": {
                    n: [c.kind, c.help, [[list(k), v] for k, v in c.values.items()]]
                    for n, c in self.counters.items()
                },
                "gauges": {
                    n: [g.help, [[list(k), v] for k, v in g.values]] for n, g in self.gauges.items()
                },
                "histograms": {
                    n: [h.help, h.buckets, [[list(k), c, s] for k, (c, s) in h.values.items()]]
                    for n, h in self.histograms.items()
                },
            }
        )

    @classmethod
    def from_json(cls, data: bytes) -> Snapshot:
        """The inverse of `to_json`; ValueError if `data` is not one."""
        try:
            doc = orjson.loads(data)
            snap = cls()
            for name, (kind, text, values) in doc["counters"].items():
                snap.counters[str(name)] = Counter(
                    str(kind), str(text), {_labels(k): float(v) for k, v in values}
                )
            for name, (text, values) in doc["gauges"].items():
                snap.gauges[str(name)] = Gauge(
                    str(text), [(_labels(k), float(v)) for k, v in values]
                )
            for name, (text, buckets, values) in doc["histograms"].items():
                hist = snap.histograms[str(name)] = Histogram(
                    str(text), tuple(float(b) for b in buckets)
                )
                for labels, counts, total in values:
                    if len(counts) != len(hist.buckets) + 1:
                        raise ValueError("histogram buckets do not match")
                    hist.values[_labels(labels)] = ([int(c) for c in counts], float(total))
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"not a metrics snapshot: {exc}") from None
        return snap


def _labels(pairs: Iterable[Any]) -> Labels:
    return tuple((str(k), str(v)) for k, v in pairs)


def merge_workers(live: Mapping[str, Snapshot], retired: Snapshot) -> Snapshot:
    """One snapshot for the admin port from each worker's (by worker name) and what
    workers that have since died had counted: counters and histograms summed, so a
    restart never makes a sum go backwards; gauges labelled with their worker, since a
    gauge is one process's view (its in-flight requests, its health checks)."""
    merged = Snapshot()
    merged.add_counts(retired)
    for worker, snap in sorted(live.items()):
        merged.add_counts(snap)
        for name, gauge in snap.gauges.items():
            mine = merged.gauges.setdefault(name, Gauge(gauge.help))
            mine.values += [((*labels, ("worker", worker)), v) for labels, v in gauge.values]
    return merged


def render(snap: Snapshot) -> bytes:
    """The Prometheus text exposition format (0.0.4) of a snapshot."""
    lines: list[str] = []
    for name, counter in sorted(snap.counters.items()):
        lines += [f"# HELP {name} {counter.help}", f"# TYPE {name} {counter.kind}"]
        lines += [f"{name}{_fmt_labels(k)} {v}" for k, v in sorted(counter.values.items())]
    for name, gauge in sorted(snap.gauges.items()):
        lines += [f"# HELP {name} {gauge.help}", f"# TYPE {name} gauge"]
        lines += [f"{name}{_fmt_labels(k)} {v}" for k, v in gauge.values]
    for name, hist in sorted(snap.histograms.items()):
        if not hist.values:
            continue
        lines += [f"# HELP {name} {hist.help}", f"# TYPE {name} histogram"]
        for labels, (counts, total) in sorted(hist.values.items()):
            running = 0
            for bound, count in zip((*hist.buckets, "+Inf"), counts, strict=True):
                running += count
                bucket = _fmt_labels(labels, 'le="' + str(bound) + '"')
                lines.append(f"{name}_bucket{bucket} {running}")
            lines.append(f"{name}_sum{_fmt_labels(labels)} {total}")
            lines.append(f"{name}_count{_fmt_labels(labels)} {running}")
    return ("\n".join(lines) + "\n").encode()


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self.help: dict[str, tuple[str, str]] = {}
        self._gauges: dict[str, tuple[str, Callable[[], list[tuple[Labels, float]]]]] = {}
        self._histograms: dict[str, Histogram] = {}

    def describe(self, name: str, kind: str, text: str) -> None:
        self.help[name] = (kind, text)

    def inc(self, name: str, labels: Labels = (), value: float = 1.0) -> None:
        self.counters[name][labels] += value

    def series(self, name: str) -> dict[Labels, float]:
        """A counter's values by labels, for a hot path that adds to several at once."""
        return self.counters[name]

    def gauge(self, name: str, text: str, read: Callable[[], list[tuple[Labels, float]]]) -> None:
        self._gauges[name] = (text, read)

    def histogram(self, name: str, text: str, buckets: tuple[float, ...]) -> None:
        """Declare a histogram (before its first `observe`); its buckets are fixed."""
        self._histograms[name] = Histogram(text, buckets)

    def observe(self, name: str, labels: Labels, seconds: float) -> None:
        hist = self._histograms[name]
        values = hist.values.get(labels)
        if values is None:
            values = hist.values[labels] = ([0] * (len(hist.buckets) + 1), 0.0)
        values[0][bisect.bisect_left(hist.buckets, seconds)] += 1
        hist.values[labels] = (values[0], values[1] + seconds)

    def snapshot(self) -> Snapshot:
        """The values now (gauges read now), copied: later increments do not change it."""
        snap = Snapshot()
        for name, series in self.counters.items():
            kind, text = self.help.get(name, ("counter", name))
            snap.counters[name] = Counter(kind, text, dict(series))
        for name, (text, read) in self._gauges.items():
            snap.gauges[name] = Gauge(text, read())
        for name, hist in self._histograms.items():
            snap.histograms[name] = Histogram(
                hist.help, hist.buckets, {k: (list(c), t) for k, (c, t) in hist.values.items()}
            )
        return snap

    def render(self) -> bytes:
        return render(self.snapshot())
