"""Prometheus metrics for the admin port: a few counters, gauges and one histogram.

Hand-rolled because the hot path pays for every increment: a dict update is a tenth of
what a locked client-library counter costs. Label values come from a closed set chosen
by the gateway (route, status class, replica index, token kind), never from a request:
no tenant secret, API key or salt can reach a label.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels, extra: str = "") -> str:
    parts = [f'{k}="{v}"' for k, v in labels]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


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

    def render(self) -> bytes:
        lines: list[str] = []
        for name, series in sorted(self.counters.items()):
            kind, text = self.help.get(name, ("counter", name))
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{_fmt_labels(k)} {v}" for k, v in sorted(series.items())]
        for name, (text, read) in sorted(self._gauges.items()):
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
            lines += [f"{name}{_fmt_labels(k)} {v}" for k, v in read()]
        if self._hist_counts:
            name = "saltgate_request_duration_seconds"
            lines += [
                f"# HELP {name} Time from request to the end of the response.",
                f"# TYPE {name} histogram",
            ]
            for labels, counts in sorted(self._hist_counts.items()):
                running = 0
                for bound, count in zip((*LATENCY_BUCKETS, "+Inf"), counts, strict=True):
                    running += count
                    bucket = _fmt_labels(labels, 'le="' + str(bound) + '"')
                    lines.append(f"{name}_bucket{bucket} {running}")
                lines.append(f"{name}_sum{_fmt_labels(labels)} {self._hist_sum[labels]}")
                lines.append(f"{name}_count{_fmt_labels(labels)} {running}")
        return ("\n".join(lines) + "\n").encode()
