"""Gateway overhead: saltgate against direct-to-backend, smg and vllm-router, in one run.

Method (docs/benchmarks.md, "Gateway overhead"): a backend and a load generator that are
not the bottleneck (nginx returning a fixed OpenAI-shaped JSON; wrk with one thread) share
one core; each router runs alone on the other core. Every target sees the same backends
and the same load: a ~4.4 KB chat body POSTed with `Authorization: Bearer <key>` (the
peers ignore it), at each concurrency, after a warm-up. A second scenario replaces nginx
with simulated replicas (`saltgate sim`, no simulated compute) and streams the answers.

Reported per point: requests/s, latency p50/p99 from wrk's --latency, the latency each
router adds over going direct (same scenario and concurrency), and saltgate's ratios to
the peers. With --profile DIR, saltgate is sampled with py-spy at the highest concurrency
and the top functions by own time are summarised.

    python -m saltgate.bench.overhead [--targets direct,saltgate,smg,vllm-router]
        [--scenarios nginx,sim-stream] [--concurrency 1,32] [--duration 5] [--json OUT]

The external tools come from scripts/bench-setup.sh: nginx, wrk and taskset on PATH, and
smg, vllm-router and py-spy in the bench venv (.bench/venv, or --tools-venv).
Everything listens on 127.0.0.1 only, and every child process and wrk run is time-bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import platform
import re
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from saltgate.sim.run import sim_command

MODEL = "sim-model"
CHAT_PATH = "/v1/chat/completions"
TARGETS = ("direct", "saltgate", "smg", "vllm-router")
PEERS = ("smg", "vllm-router")
SCENARIOS = ("nginx", "sim-stream")
SCENARIO_TITLES = {
    "nginx": "nginx backend: fixed chat-completion JSON, non-streaming",
    "sim-stream": "simulated replicas (saltgate sim, zero compute), streaming chat (SSE)",
}
BODY_BYTES = 4400
BACKEND_BOUND = 0.85
LOAD_CPU_SATURATED = 90.0
SETUP_HINT = "run scripts/bench-setup.sh"
WRK_SLACK_S = 30.0
_TIME_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


class BenchError(Exception):
    """A problem that stops a target or the run; the message says what and where."""


# -- wrk output ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests: int
    duration_s: float
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    non_2xx: int = 0
    socket_errors: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return self.non_2xx + sum(self.socket_errors.values())


def parse_time_ms(text: str) -> float:
    """wrk's time format ('12.34us', '1.20ms', '2.00s', '1.50m') in milliseconds."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s|m|h)\s*", text)
    if match is None:
        raise ValueError(f"not a wrk time: {text!r}")
    return float(match.group(1)) * _TIME_UNITS_MS[match.group(2)]


def parse_wrk_output(text: str) -> WrkResult:
    """Parse `wrk --latency` output; raise ValueError naming what is missing."""
    percentiles: dict[int, float] = {}
    for match in re.finditer(r"^\s*(50|75|90|99)(?:\.0+)?%\s+(\S+)\s*$", text, re.MULTILINE):
        percentiles[int(match.group(1))] = parse_time_ms(match.group(2))
    missing = [p for p in (50, 75, 90, 99) if p not in percentiles]
    if missing:
        raise ValueError(f"wrk output has no latency distribution for {missing} (need --latency)")
    total = re.search(r"^\s*(\d+) requests in ([0-9.]+)(us|ms|s|m|h)", text, re.MULTILINE)
    rps = re.search(r"^Requests/sec:\s+([0-9.]+)", text, re.MULTILINE)
    if total is None or rps is None:
        raise ValueError("wrk output has no request count or Requests/sec line")
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    socket_errors = {}
    if sock is not None:
        socket_errors = {
            k: int(v)
            for k, v in zip(("connect", "read", "write", "timeout"), sock.groups(), strict=True)
        }
    return WrkResult(
        requests=int(total.group(1)),
        duration_s=parse_time_ms(total.group(2) + total.group(3)) / 1000.0,
        rps=float(rps.group(1)),
        p50_ms=percentiles[50],
        p75_ms=percentiles[75],
        p90_ms=percentiles[90],
        p99_ms=percentiles[99],
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        socket_errors=socket_errors,
    )


# -- the load: request body, wrk script, backend answer -------------------------------------


def chat_body(*, stream: bool, size: int = BODY_BYTES) -> bytes:
    """A chat request of about `size` bytes: a long system prompt, a short user turn."""
    doc: dict[str, Any] = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": ""},
            {
                "role": "user",
                "content": "Summarise the refund policy for annual plans in three bullets.",
            },
        ],
        "max_tokens": 16,
        "temperature": 0,
    }
    if stream:
        doc["stream"] = True
        doc["stream_options"] = {"include_usage": True}
    base = len(json.dumps(doc, separators=(",", ":")))
    sentence = (
        "You are the support assistant of a software company; answer briefly, cite the "
        "policy section you rely on, and never invent prices or dates. "
    )
    doc["messages"][0]["content"] = (sentence * (size // len(sentence) + 1))[: max(0, size - base)]
    return json.dumps(doc, separators=(",", ":")).encode()


def wrk_script(body: bytes, api_key: str) -> str:
    """A wrk Lua script POSTing `body` to the chat route with a bearer key."""
    text = body.decode()
    if "]==]" in text or "]==]" in api_key:
        raise ValueError("body or key contains the Lua long-bracket terminator")
    return (
        'wrk.method = "POST"\n'
        f"wrk.path = {_lua_string(CHAT_PATH)}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = {_lua_string("Bearer " + api_key)}\n'
        f"wrk.body = {_lua_string(text)}\n"
    )


def _lua_string(text: str) -> str:
    return f"[==[{text}]==]"


def fixed_completion() -> bytes:
    """The nginx backend's answer: an OpenAI chat completion with cached-token usage."""
    doc = {
        "id": "chatcmpl-bench0000000000000000",
        "object": "chat.completion",
        "created": 1764400000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Annual plans are refundable pro rata within 30 days (section 4.2).",
                },
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 1100,
            "completion_tokens": 16,
            "total_tokens": 1116,
            "prompt_tokens_details": {"cached_tokens": 1024},
        },
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def nginx_conf(workdir: Path, ports: Sequence[int]) -> str:
    """One worker, keep-alive, both upstream ports answering every route from memory."""
    models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]},
        separators=(",", ":"),
    )
    health = _nginx_string(json.dumps({"status": "ok"}, separators=(",", ":")))
    listens = "".join(f"        listen 127.0.0.1:{p};\n" for p in ports)
    temps = "".join(
        f"    {kind}_temp_path {workdir / (kind + '_temp')};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        "worker_processes 1;\n"
        "master_process off;\n"  # one process: its CPU time is measured per point
        "daemon off;\n"
        f"pid {workdir / 'nginx.pid'};\n"
        f"error_log {workdir / 'nginx-error.log'} warn;\n"
        "events { worker_connections 4096; }\n"
        "http {\n"
        "    access_log off;\n"
        "    default_type application/json;\n"
        "    keepalive_timeout 300s;\n"
        "    keepalive_requests 100000000;\n"
        "    client_body_buffer_size 64k;\n"
        "    client_max_body_size 8m;\n"
        f"{temps}"
        "    server {\n"
        f"{listens}"
        f"        location = /health {{ return 200 {health}; }}\n"
        f"        location = /v1/models {{ return 200 {_nginx_string(models)}; }}\n"
        f"        location / {{ return 200 {_nginx_string(fixed_completion().decode())}; }}\n"
        "    }\n"
        "}\n"
    )


def _nginx_string(text: str) -> str:
    if "$" in text:
        raise ValueError("nginx would expand '$' in a fixed answer")
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# -- tools and processes --------------------------------------------------------------------


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
    return Path(__file__).resolve().parents[3] / ".bench" / "venv"


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Proc:
    """A child in its own process group, its output in a log file; `stop()` ends it."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("wb")
        self.popen = subprocess.Popen(  # noqa: S603 - argv built here, no shell
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout)
        self._log.close()

    def tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def pinned(tools: Tools, cpu: int | None, argv: Sequence[str]) -> list[str]:
    if cpu is None:
        return list(argv)
    return [tools.need("taskset"), "-c", str(cpu), *argv]


def http_request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type") or "", resp.read()
    finally:
        conn.close()


def check_answer(stream: bool, status: int, content_type: str, body: bytes) -> str | None:
    """None if the answer looks like what the backend sent; else what is wrong."""
    if status != 200:
        return f"HTTP {status}: {body[:300]!r}"
    if stream:
        return _check_stream(content_type, body)
    try:
        doc = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    if not isinstance(doc, dict) or "choices" not in doc:
        return f"no choices in the answer: {body[:200]!r}"
    return None


def _check_stream(content_type: str, body: bytes) -> str | None:
    if "text/event-stream" not in content_type:
        return f"not an event stream (content-type {content_type!r}): {body[:200]!r}"
    if b"data: [DONE]" not in body or b'"choices"' not in body:
        return f"stream without chunks or [DONE]: {body[:300]!r}"
    return None


# -- CPU accounting: is the router saturated, and who else used its core? -----------------


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


@dataclass(slots=True)
class CpuWindow:
    """CPU use over one measured interval: the router process, its core, the load core."""

    pid: int | None
    cpus: tuple[int | None, int | None]
    backend_pids: tuple[int, ...] = ()
    started: float = 0.0
    cpu_before: dict[int, list[int]] = field(default_factory=dict)
    proc_before: dict[str, int] = field(default_factory=dict)
    backend_before: int = 0
    children_before: float = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        self.cpu_before = cpu_ticks()
        self.proc_before = proc_ticks(self.pid) if self.pid else {}
        self.backend_before = self._backend_ticks()
        self.children_before = _children_cpu_s()

    def _backend_ticks(self) -> int:
        return sum(sum(proc_ticks(pid).values()) for pid in self.backend_pids)

    def finish(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        hz = os.sysconf("SC_CLK_TCK")
        after = cpu_ticks()
        out: dict[str, Any] = {}
        for role, cpu in zip(("load_cpu", "router_cpu"), self.cpus, strict=True):
            if cpu is None or cpu not in after or cpu not in self.cpu_before:
                continue
            delta = [a - b for a, b in zip(after[cpu], self.cpu_before[cpu], strict=True)]
            total = max(sum(delta), 1)
            idle = delta[3] + delta[4]
            out[f"{role}_busy_pct"] = round(100.0 * (total - idle - delta[7]) / total, 1)
            out[f"{role}_steal_pct"] = round(100.0 * delta[7] / total, 1)
        # wrk is the only child reaped in the window, so the children's rusage is its CPU.
        wrk_pct = 100.0 * (_children_cpu_s() - self.children_before) / elapsed
        backend_pct = 100.0 * (self._backend_ticks() - self.backend_before) / hz / elapsed
        out["wrk_cpu_pct"] = round(wrk_pct, 1)
        out["backend_cpu_pct"] = round(backend_pct, 1)
        if "load_cpu_busy_pct" in out:
            out["other_on_load_cpu_pct"] = round(
                max(0.0, out["load_cpu_busy_pct"] - wrk_pct - backend_pct), 1
            )
        if self.pid:
            proc_after = proc_ticks(self.pid)
            threads = {
                name: round(100.0 * (t - self.proc_before.get(name, 0)) / hz / elapsed, 1)
                for name, t in proc_after.items()
            }
            out["router_proc_cpu_pct"] = round(sum(threads.values()), 1)
            out["router_threads_cpu_pct"] = {k: v for k, v in threads.items() if v >= 0.5}
            if "router_cpu_busy_pct" in out:
                out["other_on_router_cpu_pct"] = round(
                    max(0.0, out["router_cpu_busy_pct"] - out["router_proc_cpu_pct"]), 1
                )
        return out


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- targets ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Backends:
    ports: list[int]
    procs: list[Proc]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]


@dataclass(slots=True)
class Running:
    target: str
    port: int
    proc: Proc | None


@dataclass(frozen=True, slots=True)
class Options:
    targets: tuple[str, ...]
    scenarios: tuple[str, ...]
    concurrency: tuple[int, ...]
    duration_s: int
    warmup_s: int
    rounds: int
    load_cpu: int | None
    router_cpu: int | None
    startup_timeout_s: float
    profile_dir: Path | None
    json_out: Path | None
    keep_tmp: bool


class Bench:
    def __init__(self, options: Options, tools: Tools, workdir: Path) -> None:
        self.o = options
        self.tools = tools
        self.workdir = workdir
        self.api_key = "sk-bench-unset"
        self.samples: list[dict[str, Any]] = []
        self.support: dict[str, dict[str, str]] = {t: {} for t in options.targets}
        self.profiles: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._procs: list[Proc] = []
        self._backend_pids: tuple[int, ...] = ()

    def log(self, message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    def spawn(self, name: str, argv: Sequence[str]) -> Proc:
        proc = Proc(name, argv, self.workdir / f"{name}.log")
        self._procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        with contextlib.suppress(ValueError):
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            with contextlib.suppress(Exception):
                proc.stop()
        self._procs.clear()

    # backends
    def start_nginx(self) -> Backends:
        nginx = self.tools.need("nginx")
        ports = [free_port(), free_port()]
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_conf(self.workdir, ports))
        argv = [nginx, "-p", str(self.workdir), "-e", str(self.workdir / "nginx-error.log")]
        proc = self.spawn("nginx", pinned(self.tools, self.o.load_cpu, [*argv, "-c", str(conf)]))
        backends = Backends(ports, [proc])
        self._wait_backends(backends)
        return backends

    def start_sims(self) -> Backends:
        ports = [free_port(), free_port()]
        procs = []
        for i, port in enumerate(ports):
            argv = sim_command(
                port, prefill_ms_per_1k_tokens=0, decode_ms_per_token=0, max_concurrency=256
            )
            procs.append(self.spawn(f"sim{i}", pinned(self.tools, self.o.load_cpu, argv)))
        backends = Backends(ports, procs)
        self._wait_backends(backends)
        return backends

    def _wait_backends(self, backends: Backends) -> None:
        deadline = time.monotonic() + self.o.startup_timeout_s
        for port in backends.ports:
            last = ""
            while True:
                for proc in backends.procs:
                    if not proc.alive():
                        raise BenchError(
                            f"backend {proc.name} exited ({proc.popen.returncode}); "
                            f"log {proc.log_path}:\n{proc.tail()}"
                        )
                try:
                    status, _, body = http_request(port, "GET", "/health", timeout=2.0)
                    if status == 200:
                        break
                    last = f"HTTP {status} {body[:100]!r}"
                except OSError as exc:
                    last = str(exc)
                if time.monotonic() > deadline:
                    raise BenchError(f"backend on port {port} not ready: {last}")
                time.sleep(0.1)

    # routers
    def prepare_saltgate(self) -> None:
        """A state dir with a master key, a tenant and an API key; the key goes in the load."""
        state = self.workdir / "saltgate-state"
        state.mkdir(mode=0o700)
        key_file = state / "master.key"
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        cli = [sys.executable, "-m", "saltgate.cli"]
        for argv in (
            [*cli, "tenants", "create", "bench", "--state-dir", str(state)],
            [*cli, "keys", "create", "bench", "--state-dir", str(state)],
        ):
            done = subprocess.run(  # noqa: S603 - fixed argv
                argv, capture_output=True, text=True, timeout=60, check=False
            )
            if done.returncode != 0:
                raise BenchError(
                    f"`saltgate {' '.join(argv[3:5])}` failed ({done.returncode}): "
                    f"{(done.stderr or done.stdout).strip()[-500:]}"
                )
        key = done.stdout.strip().splitlines()[-1].strip() if done.stdout.strip() else ""
        if not key:
            raise BenchError("`saltgate keys create` printed no key on stdout")
        self.api_key = key

    def saltgate_config(self, backends: Backends, port: int) -> Path:
        """A config file for `saltgate serve` on ``port`` in front of ``backends``."""
        state = self.workdir / "saltgate-state"
        replicas = "".join(f'\n[[replicas]]\nurl = "{u}"\n' for u in backends.urls)
        text = (
            "[gateway]\n"
            'host = "127.0.0.1"\n'
            f"port = {port}\n"
            'admin_host = "127.0.0.1"\n'
            f"admin_port = {free_port()}\n"
            f'state_dir = "{state}"\n'
            f'master_key_file = "{state / "master.key"}"\n'
            f"{replicas}"
        )
        path = self.workdir / f"saltgate-{port}.toml"
        path.write_text(text)
        return path

    def router_argv(self, target: str, backends: Backends, port: int) -> list[str]:
        if target == "saltgate":
            config = self.saltgate_config(backends, port)
            return [sys.executable, "-m", "saltgate.cli", "serve", "--config", str(config)]
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *backends.urls,
            "--policy",
            "cache_aware",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
        ]
        if target == "smg":
            return [self.tools.need("smg"), "launch", *common, "--log-level", "warn"]
        if target == "vllm-router":
            return [self.tools.need("vllm-router"), *common, "--log-level", "warning"]
        raise BenchError(f"unknown target {target}")

    def start_target(self, target: str, backends: Backends, stream: bool) -> Running:
        if target == "direct":
            running = Running(target, backends.ports[0], None)
        else:
            port = free_port()
            argv = pinned(self.tools, self.o.router_cpu, self.router_argv(target, backends, port))
            running = Running(target, port, self.spawn(target, argv))
        self._wait_ready(running, stream)
        return running

    def _wait_ready(self, running: Running, stream: bool) -> None:
        """Ready means a real chat request comes back right (workers registered, key valid)."""
        body = chat_body(stream=stream)
        headers = {"content-type": "application/json", "authorization": f"Bearer {self.api_key}"}
        deadline = time.monotonic() + self.o.startup_timeout_s
        last = "no answer"
        proc = running.proc
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise BenchError(
                    f"{running.target} exited ({proc.popen.returncode}) before it was ready; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )
            try:
                status, ctype, answer = http_request(
                    running.port, "POST", CHAT_PATH, body, headers=headers, timeout=5.0
                )
                problem = check_answer(stream, status, ctype, answer)
                if problem is None:
                    return
                last = problem
            except OSError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.25)
        tail = f"\nlog {proc.log_path}:\n{proc.tail()}" if proc is not None else ""
        raise BenchError(
            f"{running.target} not ready within {self.o.startup_timeout_s:.0f}s: {last}{tail}"
        )

    # load
    def wrk(self, port: int, script: Path, concurrency: int, duration_s: int) -> WrkResult:
        argv = pinned(
            self.tools,
            self.o.load_cpu,
            [
                self.tools.need("wrk"),
                "-t1",
                f"-c{concurrency}",
                f"-d{duration_s}s",
                "--timeout",
                "10s",
                "--latency",
                "-s",
                str(script),
                f"http://127.0.0.1:{port}{CHAT_PATH}",
            ],
        )
        try:
            done = subprocess.run(  # noqa: S603 - argv built here
                argv, capture_output=True, text=True, timeout=duration_s + WRK_SLACK_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise BenchError(f"wrk did not finish within {duration_s + WRK_SLACK_S:.0f}s") from None
        if done.returncode != 0:
            raise BenchError(f"wrk failed ({done.returncode}): {done.stderr.strip()[-300:]}")
        try:
            return parse_wrk_output(done.stdout)
        except ValueError as exc:
            raise BenchError(f"{exc}; wrk said:\n{done.stdout}\n{done.stderr}") from None

    # the run
    def run(self) -> dict[str, Any]:
        if "saltgate" in self.o.targets:
            try:
                self.prepare_saltgate()
            except (BenchError, subprocess.TimeoutExpired) as exc:
                self.notes.append(f"saltgate setup failed: {exc}")
                for scenario in self.o.scenarios:
                    self.support["saltgate"][scenario] = f"setup failed: {_one_line(exc)}"
        load_before = os.getloadavg()
        started = time.time()
        for scenario in self.o.scenarios:
            self.run_scenario(scenario)
        return self.report(load_before, started)

    def run_scenario(self, scenario: str) -> None:
        stream = scenario == "sim-stream"
        self.log(f"scenario {scenario}: starting backends")
        backends = self.start_nginx() if scenario == "nginx" else self.start_sims()
        self._backend_pids = tuple(p.pid for p in backends.procs)
        script = self.workdir / f"{scenario}.lua"
        script.write_text(wrk_script(chat_body(stream=stream), self.api_key))
        try:
            for round_no in range(self.o.rounds):
                for target in self.o.targets:
                    if self.support[target].get(scenario, "").startswith("setup failed"):
                        continue
                    self.run_target(
                        scenario, target, backends, script=script, stream=stream, round_no=round_no
                    )
        finally:
            for proc in backends.procs:
                self.stop(proc)

    def run_target(
        self,
        scenario: str,
        target: str,
        backends: Backends,
        *,
        script: Path,
        stream: bool,
        round_no: int,
    ) -> None:
        self.log(f"scenario {scenario} round {round_no + 1}: {target}")
        try:
            running = self.start_target(target, backends, stream)
        except BenchError as exc:
            if target == "direct":
                raise
            self.support[target][scenario] = f"failed: {_one_line(exc)}"
            self.log(f"{target} in {scenario}: {exc}")
            return
        self.support[target][scenario] = "ok"
        try:
            if self.o.warmup_s > 0:
                self.wrk(running.port, script, max(self.o.concurrency), self.o.warmup_s)
            for conc in self.o.concurrency:
                window = CpuWindow(
                    running.proc.pid if running.proc else None,
                    (self.o.load_cpu, self.o.router_cpu),
                    tuple(p.pid for p in backends.procs),
                )
                window.start()
                result = self.wrk(running.port, script, conc, self.o.duration_s)
                cpu = window.finish()
                self.log(
                    f"  c={conc}: {result.rps:,.0f} rps p50 {result.p50_ms:.3f} ms "
                    f"p99 {result.p99_ms:.3f} ms errors {result.errors} "
                    f"router cpu {cpu.get('router_proc_cpu_pct', '-')}% "
                    f"other on its core {cpu.get('other_on_router_cpu_pct', '-')}%; load core "
                    f"busy {cpu.get('load_cpu_busy_pct', '-')}% (wrk {cpu['wrk_cpu_pct']}%, "
                    f"backend {cpu['backend_cpu_pct']}%)"
                )
                self.samples.append(
                    {
                        "scenario": scenario,
                        "target": target,
                        "round": round_no,
                        "concurrency": conc,
                        **asdict(result),
                        "cpu": cpu,
                    }
                )
            if (
                target == "saltgate"
                and self.o.profile_dir is not None
                and round_no == self.o.rounds - 1
                and running.proc is not None
            ):
                self.profile(scenario, running, script)
            if running.proc is not None and not running.proc.alive():
                self.notes.append(f"{target} exited during {scenario}: {running.proc.tail(5)}")
        except BenchError as exc:
            self.support[target][scenario] = f"failed under load: {_one_line(exc)}"
            self.log(f"{target} in {scenario} failed under load: {exc}")
        finally:
            if running.proc is not None:
                self.stop(running.proc)

    def profile(self, scenario: str, running: Running, script: Path) -> None:
        """Sample saltgate under the highest concurrency: raw stacks + a flame graph."""
        assert self.o.profile_dir is not None and running.proc is not None
        py_spy = self.tools.need("py-spy")
        self.o.profile_dir.mkdir(parents=True, exist_ok=True)
        conc = max(self.o.concurrency)
        stem = self.o.profile_dir / f"saltgate-{scenario}-c{conc}"
        for fmt, out in (
            ("raw", stem.with_suffix(".txt")),
            ("flamegraph", stem.with_suffix(".svg")),
        ):
            argv = pinned(
                self.tools,
                self.o.load_cpu,
                [
                    py_spy,
                    "record",
                    "--pid",
                    str(running.proc.pid),
                    "--duration",
                    str(self.o.duration_s),
                    "--rate",
                    "250",
                    "--function",
                    "--gil",
                    "--format",
                    fmt,
                    "--output",
                    str(out),
                ],
            )
            self.log(f"  py-spy ({fmt}) on saltgate pid {running.proc.pid}, c={conc}")
            spy = subprocess.Popen(  # noqa: S603 - argv built here
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                time.sleep(0.5)
                window = CpuWindow(
                    running.proc.pid, (self.o.load_cpu, self.o.router_cpu), self._backend_pids
                )
                window.start()
                result = self.wrk(running.port, script, conc, self.o.duration_s)
                cpu = window.finish()
                spy_out, _ = spy.communicate(timeout=self.o.duration_s + WRK_SLACK_S)
            except (BenchError, subprocess.TimeoutExpired) as exc:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(spy.pid, signal.SIGKILL)
                spy.wait()
                raise BenchError(f"profiling failed: {exc}") from None
            if spy.returncode != 0 or not out.exists():
                raise BenchError(
                    f"py-spy failed ({spy.returncode}): {spy_out.decode(errors='replace')[-400:]}"
                )
            if fmt == "raw":
                summary = summarize_profile(out.read_text())
                summary.update(
                    scenario=scenario,
                    concurrency=conc,
                    raw=str(out),
                    svg=str(stem.with_suffix(".svg")),
                    rps_while_profiling=result.rps,
                    cpu_while_profiling=cpu,
                )
                self.profiles.append(summary)

    # report
    def report(self, load_before: tuple[float, float, float], started: float) -> dict[str, Any]:
        points = aggregate(self.samples)
        return {
            "meta": {
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                "elapsed_s": round(time.time() - started, 1),
                "command": " ".join(sys.argv),
                "machine": machine_info(),
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                "pinning": {
                    "load_and_backend_cpu": self.o.load_cpu,
                    "router_cpu": self.o.router_cpu,
                },
                "duration_s": self.o.duration_s,
                "warmup_s": self.o.warmup_s,
                "rounds": self.o.rounds,
                "concurrency": list(self.o.concurrency),
                "body_bytes": {s: len(chat_body(stream=s == "sim-stream")) for s in SCENARIOS},
                "versions": tool_versions(self.tools),
                "saltgate_source": source_state(),
            },
            "support": self.support,
            "points": points,
            "ratios": ratios(points),
            "profiles": self.profiles,
            "notes": self.notes,
            "samples": self.samples,
        }


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# -- aggregation and reporting --------------------------------------------------------------


def aggregate(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over rounds per (scenario, target, concurrency), with latency added over direct."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault((s["scenario"], s["target"], s["concurrency"]), []).append(s)
    points = []
    for (scenario, target, conc), group in groups.items():
        points.append(
            {
                "scenario": scenario,
                "target": target,
                "concurrency": conc,
                "rounds": len(group),
                "rps": statistics.median(g["rps"] for g in group),
                "p50_ms": statistics.median(g["p50_ms"] for g in group),
                "p99_ms": statistics.median(g["p99_ms"] for g in group),
                "errors": sum(g["non_2xx"] + sum(g["socket_errors"].values()) for g in group),
                "requests": sum(g["requests"] for g in group),
                **{
                    key: _median_cpu(group, key)
                    for key in (
                        "router_proc_cpu_pct",
                        "other_on_router_cpu_pct",
                        "router_cpu_steal_pct",
                        "load_cpu_busy_pct",
                        "wrk_cpu_pct",
                        "backend_cpu_pct",
                        "other_on_load_cpu_pct",
                    )
                },
            }
        )
    direct = {(p["scenario"], p["concurrency"]): p for p in points if p["target"] == "direct"}
    for p in points:
        d = direct.get((p["scenario"], p["concurrency"]))
        p["added_p50_ms"] = p["p50_ms"] - d["p50_ms"] if d else None
        p["added_p99_ms"] = p["p99_ms"] - d["p99_ms"] if d else None
        # Within 15% of going direct, or wrk + backend themselves filling the load core: the
        # backend, not the router, set the pace, and "added latency" means little. (Other
        # tenants' load on that core is noise, reported in its own column, not this.)
        ours = (p.get("wrk_cpu_pct") or 0.0) + (p.get("backend_cpu_pct") or 0.0)
        p["backend_bound"] = bool(
            d
            and p is not d
            and (p["rps"] >= BACKEND_BOUND * d["rps"] or ours >= LOAD_CPU_SATURATED)
        )
    return points


def _median_cpu(group: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [g["cpu"][key] for g in group if key in g.get("cpu", {})]
    return round(statistics.median(values), 1) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def ratios(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """saltgate over each peer, per scenario and concurrency (rps: higher is better)."""
    by_key = {(p["scenario"], p["target"], p["concurrency"]): p for p in points}
    out = []
    for (scenario, target, conc), p in sorted(by_key.items()):
        if target != "saltgate":
            continue
        for peer in PEERS:
            q = by_key.get((scenario, peer, conc))
            if q is None:
                continue
            out.append(
                {
                    "scenario": scenario,
                    "concurrency": conc,
                    "peer": peer,
                    "rps_ratio": _ratio(p["rps"], q["rps"]),
                    "added_p50_ratio": _ratio(p["added_p50_ms"], q["added_p50_ms"]),
                    "added_p99_ratio": _ratio(p["added_p99_ms"], q["added_p99_ms"]),
                    "added_p50_ms": p["added_p50_ms"],
                    "peer_added_p50_ms": q["added_p50_ms"],
                }
            )
    return out


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} us" if abs(value) < 1 else f"{value:.2f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        "## Gateway overhead: results",
        "",
        f"{meta['started']}; {meta['machine']['cpu']} ({meta['machine']['cpus']} CPUs); "
        f"load average before {meta['loadavg_before'][0]:.2f}, after "
        f"{meta['loadavg_after'][0]:.2f}; wrk -t1, {meta['duration_s']} s per point after a "
        f"{meta['warmup_s']} s warm-up, median of {meta['rounds']} round(s); pinning: wrk and "
        f"backend on CPU {meta['pinning']['load_and_backend_cpu']}, router on CPU "
        f"{meta['pinning']['router_cpu']}; saltgate source {meta.get('saltgate_source', '?')}.",
        "",
        "Scenario support (a target is run in every scenario; this is how it went):",
        "",
        "| target | " + " | ".join(SCENARIOS) + " |",
        "|---|" + "---|" * len(SCENARIOS),
    ]
    for target, per in result["support"].items():
        lines.append(f"| {target} | " + " | ".join(per.get(s, "not run") for s in SCENARIOS) + " |")
    for scenario in SCENARIOS:
        points = [p for p in result["points"] if p["scenario"] == scenario]
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
        for p in sorted(points, key=lambda p: (p["concurrency"], order.get(p["target"], 9))):
            bound = " (backend-bound)" if p.get("backend_bound") else ""
            lines.append(
                f"| {p['target']} | {p['concurrency']} | {p['rps']:,.0f}{bound} | "
                f"{_ms(p['p50_ms'])} | {_ms(p['p99_ms'])} | {_ms(p['added_p50_ms'])} | "
                f"{_ms(p['added_p99_ms'])} | {p['errors']} | "
                f"{_pct(p.get('router_proc_cpu_pct'))} | "
                f"{_pct(p.get('other_on_router_cpu_pct'))} | "
                f"{_pct(p.get('load_cpu_busy_pct'))} ({_pct(p.get('wrk_cpu_pct'))}/"
                f"{_pct(p.get('backend_cpu_pct'))}/{_pct(p.get('other_on_load_cpu_pct'))}) |"
            )
    if result["ratios"]:
        lines += [
            "",
            "### saltgate relative to the peers (req/s: higher is better; added latency: lower)",
            "",
            "| scenario | conc | peer | req/s ratio | added p50 ratio | added p99 ratio |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["ratios"]:
            lines.append(
                f"| {r['scenario']} | {r['concurrency']} | {r['peer']} | {_x(r['rps_ratio'])} | "
                f"{_x(r['added_p50_ratio'])} | {_x(r['added_p99_ratio'])} |"
            )
        lines += ["", *target_checks(result["ratios"])]
    for prof in result["profiles"]:
        lines += ["", *profile_markdown(prof)]
    if result["notes"]:
        lines += ["", "Notes:", *(f"- {n}" for n in result["notes"])]
    return "\n".join(lines) + "\n"


def target_checks(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets: >= 1.0x smg's req/s at high concurrency; added p50 at c=1 <= smg's."""
    out = []
    for r in rows:
        if r["peer"] != "smg":
            continue
        if r["concurrency"] > 1 and r["rps_ratio"] is not None:
            verdict = "met" if r["rps_ratio"] >= 1.0 else "NOT met"
            out.append(
                f"- target saltgate req/s >= 1.0x smg ({r['scenario']}, c={r['concurrency']}): "
                f"{r['rps_ratio']:.2f}x, {verdict}"
            )
        if r["concurrency"] == 1 and r["added_p50_ms"] is not None and r["peer_added_p50_ms"]:
            verdict = "met" if r["added_p50_ms"] <= r["peer_added_p50_ms"] else "NOT met"
            out.append(
                f"- target added p50 at c=1 <= smg's ({r['scenario']}): "
                f"{_ms(r['added_p50_ms'])} vs {_ms(r['peer_added_p50_ms'])}, {verdict}"
            )
    return out


# -- profile summary ------------------------------------------------------------------------


def summarize_profile(raw: str, top: int = 20) -> dict[str, Any]:
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
        frames = [f for f in stack.split(";") if f]
        if not frames:
            continue
        samples += count
        leaf = frames[-1]
        own[leaf] = own.get(leaf, 0) + count
        files[_frame_file(leaf)] = files.get(_frame_file(leaf), 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count

    def ranked(table: dict[str, int]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: kv[1], reverse=True)[:top]
        return [
            {"frame": k, "samples": v, "pct": round(100.0 * v / samples, 1) if samples else 0.0}
            for k, v in rows
        ]

    return {
        "samples": samples,
        "top_own": ranked(own),
        "top_total": ranked(total),
        "own_by_file": ranked(files),
    }


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


def profile_markdown(prof: dict[str, Any], top: int = 15) -> list[str]:
    lines = [
        f"### py-spy --gil: saltgate, {prof['scenario']}, c={prof['concurrency']} "
        f"({prof['samples']} samples, {prof['rps_while_profiling']:,.0f} req/s while sampled)",
        "",
        "| own % | function (file:first line) | | total % | function |",
        "|---|---|---|---|---|",
    ]
    rows_own = prof["top_own"][:top]
    rows_total = prof["top_total"][:top]
    for i in range(max(len(rows_own), len(rows_total))):
        a = rows_own[i] if i < len(rows_own) else None
        b = rows_total[i] if i < len(rows_total) else None
        lines.append(
            f"| {a['pct'] if a else ''} | {_short_frame(a['frame']) if a else ''} | | "
            f"{b['pct'] if b else ''} | {_short_frame(b['frame']) if b else ''} |"
        )
    lines += [
        "",
        "Own time by file: "
        + ", ".join(f"{r['frame']} {r['pct']}%" for r in prof["own_by_file"][:10]),
        f"Raw stacks: {prof['raw']}; flame graph: {prof['svg']}",
    ]
    return lines


# -- environment ----------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def source_state() -> str:
    """The commit and whether src/ differs from it: the gateway measured may be work in progress."""
    src = Path(__file__).resolve().parents[2]
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


# -- command line ---------------------------------------------------------------------------


def _csv(kinds: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in kinds]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(kinds)}; got {text!r}")
        return items

    return parse


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,32,64; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="saltgate bench overhead",
        description="Per-request overhead of saltgate vs direct, smg and vllm-router.",
    )
    p.add_argument("--targets", type=_csv(TARGETS), default=TARGETS, help="comma-separated")
    p.add_argument("--scenarios", type=_csv(SCENARIOS), default=SCENARIOS, help="comma-separated")
    p.add_argument("--concurrency", type=_ints, default=(1, 32), help="e.g. 1,32,64")
    p.add_argument("--duration", type=int, default=5, help="seconds per measured point")
    p.add_argument("--warmup", type=int, default=2, help="seconds of warm-up per target")
    p.add_argument("--rounds", type=int, default=1, help="repeat all targets; report medians")
    p.add_argument("--load-cpu", type=int, default=0, help="CPU for wrk and the backends")
    p.add_argument("--router-cpu", type=int, default=1, help="CPU for the target under test")
    p.add_argument("--no-pin", action="store_true", help="do not pin with taskset")
    p.add_argument("--startup-timeout", type=float, default=30.0, help="seconds per target")
    p.add_argument("--tools-venv", type=Path, default=None, help="venv holding smg etc.")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR", help="py-spy saltgate")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write results here")
    p.add_argument("--keep-tmp", action="store_true", help="keep configs and logs")
    return p


def _preflight(options: Options, tools: Tools) -> None:
    tools.need("wrk")
    if "nginx" in options.scenarios:
        tools.need("nginx")
    if options.load_cpu is not None:
        tools.need("taskset")
        cpus = os.sched_getaffinity(0)
        for cpu in (options.load_cpu, options.router_cpu):
            if cpu not in cpus:
                raise BenchError(f"CPU {cpu} is not available (have {sorted(cpus)}); use --no-pin")
    for target in options.targets:
        if target in PEERS:
            tools.need(target)
    if options.profile_dir is not None and "saltgate" in options.targets:
        tools.need("py-spy")


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="saltgate-bench-"))
    path.chmod(0o755)  # nginx workers (user nobody) must reach their temp paths
    try:
        yield path
    finally:
        if keep:
            print(f"[bench] kept {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.duration < 1 or args.rounds < 1 or args.warmup < 0:
        print("overhead: --duration and --rounds must be >= 1", file=sys.stderr)
        return 2
    options = Options(
        targets=args.targets,
        scenarios=args.scenarios,
        concurrency=args.concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        rounds=args.rounds,
        load_cpu=None if args.no_pin else args.load_cpu,
        router_cpu=None if args.no_pin else args.router_cpu,
        startup_timeout_s=args.startup_timeout,
        profile_dir=args.profile.resolve() if args.profile else None,
        json_out=args.json,
        keep_tmp=args.keep_tmp,
    )
    tools = find_tools(args.tools_venv or default_tools_venv())
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _preflight(options, tools)
        with _workdir(options.keep_tmp) as workdir:
            bench = Bench(options, tools, workdir)
            try:
                result = bench.run()
            finally:
                bench.stop_all()
    except BenchError as exc:
        print(f"overhead: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("overhead: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown(result), end="")
    if options.json_out is not None:
        options.json_out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"[bench] wrote {options.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
