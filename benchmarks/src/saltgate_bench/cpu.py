"""CPU accounting over a measured interval, from /proc: is the router saturated, and who
else used its core or the load core? On a shared machine this is how to tell noise from
signal (docs/benchmarks.md, "CPU accounting per point")."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def cpu_ticks() -> dict[int, list[int]]:
    """Per-CPU jiffies from /proc/stat: user nice system idle iowait irq softirq steal."""
    out: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                out[int(name[3:])] = [int(f) for f in fields[:8]]
    return out


def proc_ticks(pid: int) -> dict[str, int]:
    """utime+stime per thread ('tid:comm') of a process, in jiffies; {} if it is gone."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                comm = (task / "comm").read_text().strip()
                out[f"{task.name}:{comm}"] = int(fields[11]) + int(fields[12])
    return out


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (a gateway's worker processes), from /proc."""
    parents: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    parents.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [pid], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        tree += children
        todo += children
    return tree


def tree_ticks(pid: int) -> dict[str, int]:
    """`proc_ticks` of a process and its descendants (thread ids are unique machine-wide)."""
    out: dict[str, int] = {}
    for member in process_tree(pid):
        out.update(proc_ticks(member))
    return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True, slots=True)
class CpuUse:
    """Percentages of one core over a window; None where it was not measured (a core that
    is not pinned, a target without a process of its own)."""

    load_cpu_busy_pct: float | None = None
    load_cpu_steal_pct: float | None = None
    router_cpu_busy_pct: float | None = None
    router_cpu_steal_pct: float | None = None
    wrk_cpu_pct: float = 0.0
    backend_cpu_pct: float = 0.0
    other_on_load_cpu_pct: float | None = None
    router_proc_cpu_pct: float | None = None  # all of its processes (workers too)
    router_threads_cpu_pct: dict[str, float] | None = None
    other_on_router_cpu_pct: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(slots=True)
class CpuWindow:
    """CPU use over one measured interval: the router process (with its worker processes),
    its core, the load core."""

    pid: int | None
    cpus: tuple[int | None, int | None]  # (load core, router core: None if not one core)
    backend_pids: tuple[int, ...] = ()
    started: float = 0.0
    cpu_before: dict[int, list[int]] = field(default_factory=dict)
    proc_before: dict[str, int] = field(default_factory=dict)
    backend_before: int = 0
    children_before: float = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.cpu_before = cpu_ticks()
        self.proc_before = tree_ticks(self.pid) if self.pid else {}
        self.backend_before = self._backend_ticks()
        self.children_before = _children_cpu_s()

    def _backend_ticks(self) -> int:
        return sum(sum(proc_ticks(pid).values()) for pid in self.backend_pids)

    def _core(self, cpu: int | None, after: dict[int, list[int]]) -> tuple[float, float] | None:
        """(busy %, steal %) of a core over the window."""
        if cpu is None or cpu not in after or cpu not in self.cpu_before:
            return None
        delta = [a - b for a, b in zip(after[cpu], self.cpu_before[cpu], strict=True)]
        total = max(sum(delta), 1)
        idle = delta[3] + delta[4]
        busy = round(100.0 * (total - idle - delta[7]) / total, 1)
        return busy, round(100.0 * delta[7] / total, 1)

    def finish(self) -> CpuUse:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        hz = os.sysconf("SC_CLK_TCK")
        after = cpu_ticks()
        load = self._core(self.cpus[0], after)
        router = self._core(self.cpus[1], after)
        # wrk is the only child reaped in the window, so the children's rusage is its CPU.
        wrk_pct = 100.0 * (_children_cpu_s() - self.children_before) / elapsed
        backend_pct = 100.0 * (self._backend_ticks() - self.backend_before) / hz / elapsed
        use: dict[str, Any] = {
            "wrk_cpu_pct": round(wrk_pct, 1),
            "backend_cpu_pct": round(backend_pct, 1),
        }
        if load is not None:
            use["load_cpu_busy_pct"], use["load_cpu_steal_pct"] = load
            use["other_on_load_cpu_pct"] = round(max(0.0, load[0] - wrk_pct - backend_pct), 1)
        if router is not None:
            use["router_cpu_busy_pct"], use["router_cpu_steal_pct"] = router
        if self.pid:
            threads = {
                name: round(100.0 * (t - self.proc_before.get(name, 0)) / hz / elapsed, 1)
                for name, t in tree_ticks(self.pid).items()
            }
            use["router_proc_cpu_pct"] = round(sum(threads.values()), 1)
            use["router_threads_cpu_pct"] = {k: v for k, v in threads.items() if v >= 0.5}
            if router is not None:
                use["other_on_router_cpu_pct"] = round(
                    max(0.0, router[0] - use["router_proc_cpu_pct"]), 1
                )
        return CpuUse(**use)
