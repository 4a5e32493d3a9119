"""Prometheus metrics for the admin port: a few counters, gauges and one histogram.

Hand-rolled because the hot path pays for every increment: a dict update is a tenth of
what a locked client-library counter costs. Label values come from a closed set chosen
by the gateway (route, status class, replica index, token kind, worker index), never
from a request: no tenant secret, API key or salt can reach a label.

With worker processes (docs/workers.md) each worker keeps its own `Metrics`, sends the
parent a `Snapshot` (plain data, JSON on the wire) and the parent renders the merge:
counters and the histogram summed over workers, gauges kept per worker.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DURATION = "saltgate_request_duration_seconds"
DURATION_HELP = "Time from request to the end of the response."

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels]
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
class Snapshot:
    """Every metric's value at one moment, as plain data: what `render` formats and what
    a worker sends its parent."""

    counters: dict[str, Counter] = field(default_factory=dict)
    gauges: dict[str, Gauge] = field(default_factory=dict)
    durations: dict[Labels, tuple[list[int], float]] = field(default_factory=dict)

    def add_counts(self, other: Snapshot) -> None:
        """Add `other`'s counters and histogram into these (gauges are not additive)."""
        for name, counter in other.counters.items():
            mine = self.counters.setdefault(name, Counter(counter.kind, counter.help))
            for labels, value in counter.values.items():
                mine.values[labels] = mine.values.get(labels, 0.0) + value
        for labels, (counts, total) in other.durations.items():
            have = self.durations.get(labels)
            if have is None:
                self.durations[labels] = (list(counts), total)
            else:
                summed = [a + b for a, b in zip(have[0], counts, strict=True)]
                self.durations[labels] = (summed, have[1] + total)

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
                "durations": [[list(k), counts, s] for k, (counts, s) in self.durations.items()],
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
            for labels, counts, total in doc["durations"]:
                if len(counts) != len(LATENCY_BUCKETS) + 1:
                    raise ValueError("histogram buckets do not match")
                snap.durations[_labels(labels)] = ([int(c) for c in counts], float(total))
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"not a metrics snapshot: {exc}") from None
        return snap


def _labels(pairs: Iterable[Any]) -> Labels:
    return tuple((str(k), str(v)) for k, v in pairs)


def merge_workers(live: Mapping[str, Snapshot], retired: Snapshot) -> Snapshot:
    """One snapshot for the admin port from each worker's (by worker name) and what
    workers that have since died had counted: counters and the histogram summed, so a
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
    if snap.durations:
        lines += [f"# HELP {DURATION} {DURATION_HELP}", f"# TYPE {DURATION} histogram"]
        for labels, (counts, total) in sorted(snap.durations.items()):
            running = 0
            for bound, count in zip((*LATENCY_BUCKETS, "+Inf"), counts, strict=True):
                running += count
                bucket = _fmt_labels(labels, 'le="' + str(bound) + '"')
                lines.append(f"{DURATION}_bucket{bucket} {running}")
            lines.append(f"{DURATION}_sum{_fmt_labels(labels)} {total}")
            lines.append(f"{DURATION}_count{_fmt_labels(labels)} {running}")
    return ("\n".join(lines) + "\n").encode()


class Metrics:
    def __init__(self) -> None:
        self.counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self.help: dict[str, tuple[str, str]] = {}
        self._gauges: dict[str, tuple[str, Callable[[], list[tuple[Labels, float]]]]] = {}
        self._hist_counts: dict[Labels, list[int]] = {}
        self._hist_sum: dict[Labels, float] = defaultdict(float)

    def describe(self, name: str, kind: str, text: str) -> None:
        self.help[name] = (kind, text)

    def inc(self, name: str, labels: Labels = (), value: float = 1.0) -> None:
        self.counters[name][labels] += value

    def series(self, name: str) -> dict[Labels, float]:
        """A counter's values by labels, for a hot path that adds to several at once."""
        return self.counters[name]

    def gauge(self, name: str, text: str, read: Callable[[], list[tuple[Labels, float]]]) -> None:
        self._gauges[name] = (text, read)

    def observe_latency(self, labels: Labels, seconds: float) -> None:
        counts = self._hist_counts.get(labels)
        if counts is None:
            counts = self._hist_counts[labels] = [0] * (len(LATENCY_BUCKETS) + 1)
        counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._hist_sum[labels] += seconds

    def snapshot(self) -> Snapshot:
        """The values now (gauges read now), copied: later increments do not change it."""
        snap = Snapshot()
        for name, series in self.counters.items():
            kind, text = self.help.get(name, ("counter", name))
            snap.counters[name] = Counter(kind, text, dict(series))
        for name, (text, read) in self._gauges.items():
            snap.gauges[name] = Gauge(text, read())
        for labels, counts in self._hist_counts.items():
            snap.durations[labels] = (list(counts), self._hist_sum[labels])
        return snap

    def render(self) -> bytes:
        return render(self.snapshot())
