"""`saltgate serve --workers N`: one parent holding the port, N worker processes serving it.

The parent binds the listening socket and every worker accepts from it (inherited, not
SO_REUSEPORT): one accept queue, so connections queued when a worker dies wait for the
others instead of being reset with its socket, and no other process of the same user
can bind the port and take a share of the traffic. The workers share connections by
"least connections" through a board in shared memory (serving/balance.py).
docs/workers.md measures both choices.

The parent serves no request. It starts each worker as a fresh interpreter
(serving/worker.py), hands it its configuration over a control channel
(serving/control.py), restarts a worker that dies (with a backoff if it dies young),
holds the one count of the tenants' limits every worker admits through when there is no
[cluster] (governance/arbiter.py, over a socket pair per worker: gateway/host_limits.py),
serves the one admin port (metrics merged from every worker), runs the KV-event relay
if configured, and turns signals into orders: SIGHUP has every worker reopen its access
log file (log rotation) and re-reads [[replicas]] (and the edge's TLS files) for every
worker, SIGTERM or SIGINT drains every worker and then exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import sys
import time
from collections import deque
from pathlib import Path
from typing import Final

from saltgate.admin.api import AdminApi
from saltgate.admin.store import AdminStore
from saltgate.config import ConfigError, GatewayConfig, load_master_key
from saltgate.console.app import Console
from saltgate.derivations.derive import derive_subkeys
from saltgate.gateway.access_log import AccessLog
from saltgate.gateway.metrics import Counter, Gauge, Snapshot, merge_workers, render
from saltgate.governance.arbiter import MAX_LINE_BYTES, Arbiter, ArbiterError
from saltgate.http import HttpServer
from saltgate.kvevents.relay import KvRelay
from saltgate.runtime import StartError, listen_error, run_service, until_stopped
from saltgate.serving import control, event_log
from saltgate.serving.admin_listener import AdminListener, admin_tls, start_admin_listener
from saltgate.serving.balance import ConnectionBoard
from saltgate.serving.run import (
    INFERENCE_OPTIONS,
    announce,
    edge_scheme,
    ehbp_keyring,
    kv_upstreams,
    reread_config,
    start_kv_relay,
)
from saltgate.store.errors import StoreError
from saltgate.store.usage_rollups import open_usage_reader

# A worker that dies sooner than this after it started is restarted after a backoff
# (0.5 s, doubling up to BACKOFF_MAX_S), so a worker that cannot run does not spin.
RESTART_QUICK_S: Final = 10.0
RESTART_PAUSE_S: Final = 0.1
BACKOFF_MAX_S: Final = 30.0
METRICS_TIMEOUT_S: Final = 2.0  # a worker that does not answer counts with its last snapshot
RELOAD_TIMEOUT_S: Final = 10.0
# SIGTERM: workers drain (drain_grace_s for responses in flight, then the cut answers'
# last events, then the store closes); one still running this long after is killed.
STOP_MARGIN_S: Final = 15.0
LISTEN_BACKLOG: Final = 1024

log = logging.getLogger(__name__)


class WorkerProcess:
    """A running worker as the parent sees it: its process and its control channel."""

    def __init__(
        self,
        index: int,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.index = index
        self.proc = proc
        self.started = time.monotonic()
        self.last = Snapshot()  # its metrics when it last answered
        self._reader = reader
        self._writer = writer
        self._answers: deque[asyncio.Future[bytes | None]] = deque()
        self._reading = asyncio.get_running_loop().create_task(self._read_answers())

    async def ask(self, order: control.Order, timeout: float) -> bytes | None:
        """The worker's answer to `order`, or None if it gave none in time."""
        future = asyncio.get_running_loop().create_future()
        self._answers.append(future)
        try:
            self._writer.write(control.order_frame(order))
            await self._writer.drain()
            return await asyncio.wait_for(asyncio.shield(future), timeout)
        except (TimeoutError, ConnectionError):
            return None

    async def _read_answers(self) -> None:
        """Pair answers with orders by position; a late answer still goes to its order."""
        while (body := await control.read_frame(self._reader)) is not None:
            if self._answers:
                future = self._answers.popleft()
                if not future.done():
                    future.set_result(body)
        for future in self._answers:
            if not future.done():
                future.set_result(None)
        self._answers.clear()

    def close(self) -> None:
        self._reading.cancel()
        self._writer.close()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"


def listen(host: str, port: int) -> socket.socket:
    """The listening socket every worker inherits (the first address `host` resolves to)."""
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return socket.create_server(address[:2], family=family, backlog=LISTEN_BACKLOG)


async def arbitrate(arbiter: Arbiter, channel: int, sock: socket.socket, who: str) -> None:
    """Answer one worker's questions about limits until its channel closes; then settle
    what it left at its reservations (its leases come back). `who` names it in the log."""
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_LINE_BYTES)
    clock = time.monotonic
    try:
        while line := await reader.readline():
            try:
                answer = arbiter.answer(channel, line, clock())
            except ArbiterError as exc:
                log.warning("%s: an unreadable limits message (%s)", who, exc)
                continue
            if answer is not None:
                writer.write(answer + b"\n")
    except (ConnectionError, ValueError) as exc:  # ValueError: a line over the limit
        log.warning("%s: limits channel closed (%s)", who, exc)
    finally:
        left = arbiter.forget(channel, clock())
        if left:
            log.info("%s left %d admissions; their leases are freed", who, left)
        writer.close()


class Supervisor:
    """The parent of N workers serving the gateway's HTTP port; `saltgate epp --workers
    N` runs the same parent around EPP workers (saltgate/epp/supervisor.py), changing
    what the hooks below say: the workers' program, their listening socket, their
    configuration and the parent's own listener."""

    module = "saltgate.serving.worker"  # what `python -m` runs as a worker

    def __init__(self, config: GatewayConfig, workers: int) -> None:
        if workers < 1:
            raise ValueError("--workers must be at least 1")
        self.config = config
        self.workers = workers
        self.alive: dict[int, WorkerProcess] = {}
        self.restarts = [0] * workers
        self.port = 0
        self.admin_port: int | None = None
        self.relay: KvRelay | None = None
        self._sock: socket.socket | None = None
        self._board: ConnectionBoard | None = None
        self._admin: HttpServer | None = None
        self._usage = open_usage_reader(config.store_settings)
        self._admin_api = AdminApi(
            AdminStore(config.store_settings), usage=self._usage, prices=config.prices
        )
        # The admin listener's lines; the workers write the gateway's to the same target.
        self._access_log = AccessLog.open(config.access_log, config.log_format)
        self._ehbp_private_keys: tuple[bytes, ...] = ()
        self.ehbp_fingerprint: str | None = None
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._keepers: list[asyncio.Task[None]] = []
        self._stopping = False
        self._retired = Snapshot()  # what workers that died had counted
        self._retired_requests = [0.0] * workers
        self._tasks: set[asyncio.Task[None]] = set()
        # Without [cluster], the one count of the host's limits (with it, Redis counts).
        self.arbiter = (
            Arbiter(share=config.limits_share, lease_ttl_s=config.limits_lease_ttl_s)
            if config.cluster is None
            else None
        )
        self._channels = 0
        self._arbitrating: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"{edge_scheme(self.config)}://{self.config.host}:{self.port}"

    # -- what a kind of worker changes ---------------------------------------------------
    def worker_config(self) -> GatewayConfig:
        """What a worker runs: the parent keeps the admin port and the relay."""
        return dataclasses.replace(self.config, admin_port=None, kv_relay=None)

    def bind(self) -> socket.socket:
        """The port every worker serves, held by the parent: here the listening socket
        the workers inherit (with the board sharing its connections)."""
        config = self.config
        try:
            sock = listen(config.host, config.port)
        except OSError as exc:
            raise listen_error(INFERENCE_OPTIONS, config.host, config.port, exc) from None
        self._board = ConnectionBoard.create(self.workers)
        return sock

    def listener_argv(self) -> list[tuple[str, int]]:
        """The file descriptors a worker is given to serve the port, as (option, fd)."""
        assert self._sock is not None and self._board is not None
        return [("--listen-fd", self._sock.fileno()), ("--board-fd", self._board.fd)]

    async def start_front(self) -> None:
        """The parent's own parts once every worker runs: the admin port (with the
        console; its /metrics is every worker's) and the KV-event relay."""
        config = self.config
        if config.admin_port is not None:
            console = Console(
                self._admin_api.service,
                self.metrics,
                config,
                tls=config.admin_tls_cert_file is not None,
            )
            front = AdminListener(config, self._admin_api, console, self._render, self._access_log)
            self._admin, self.admin_port = await start_admin_listener(
                front, config, admin_tls(config)
            )
        if config.kv_relay is not None:
            k_kv = derive_subkeys(load_master_key(config.master_key_file)).kv_events
            self.relay = start_kv_relay(config, k_kv)

    def check_front(self) -> None:
        """Refuse a front that cannot start (ConfigError) before anything is bound."""
        if self.config.admin_port is not None:
            admin_tls(self.config)

    # -- start and stop ------------------------------------------------------------------
    async def start(self) -> None:
        """Bind, start every worker and wait until each accepts; ConfigError or OSError
        (with the worker's own message) if one cannot start."""
        config = self.config
        self.check_front()
        if config.ehbp:
            keyring = ehbp_keyring(config)
            keys = (keyring.current, *keyring.retired)
            self._ehbp_private_keys = tuple(key.private_bytes() for key in keys)
            self.ehbp_fingerprint = keyring.current.config.fingerprint
        self._sock = self.bind()
        self.port = int(self._sock.getsockname()[1])
        try:
            started = await asyncio.gather(
                *(self._spawn(i) for i in range(self.workers)), return_exceptions=True
            )
            failed = [r for r in started if isinstance(r, BaseException)]
            for result in started:
                if isinstance(result, WorkerProcess):
                    self._adopt(result)
            if failed:
                raise failed[0]
            await self.start_front()
        except BaseException:
            await self.stop()
            raise

    async def _spawn(self, index: int) -> WorkerProcess:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        given = [*self.listener_argv(), ("--control-fd", child_end.fileno())]
        limits_end = limits_child = None
        if self.arbiter is not None:
            limits_end, limits_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            given.append(("--limits-fd", limits_child.fileno()))
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.module,
                "--index",
                str(index),
                "--workers",
                str(self.workers),
                *(str(part) for option, fd in given for part in (option, fd)),
                stdin=asyncio.subprocess.DEVNULL,
                pass_fds=[fd for _, fd in given],
            )
        except BaseException:
            parent_end.close()
            if limits_end is not None:
                limits_end.close()
            raise
        finally:
            child_end.close()
            if limits_child is not None:
                limits_child.close()
        self._procs[index] = proc
        if limits_end is not None:
            task = asyncio.get_running_loop().create_task(self._arbitrate(index, limits_end))
            self._arbitrating.add(task)
            task.add_done_callback(self._arbitrating.discard)
        reader, writer = await asyncio.open_unix_connection(sock=parent_end)
        start = control.Start(self.worker_config(), self._ehbp_private_keys)
        writer.write(control.order_frame(start))
        await writer.drain()
        first = await control.read_frame(reader)
        if first != control.READY:
            writer.close()
            returncode = await proc.wait()
            if first is not None and first[:1] == control.USAGE_FAILED:
                raise ConfigError(first[1:].decode(errors="replace"))
            if first is not None and first[:1] == control.FAILED:
                reason = first[1:].decode(errors="replace")
                raise StartError(f"worker {index} could not start: {reason}")
            raise StartError(f"worker {index} {describe_exit(returncode)} before it was ready")
        worker = WorkerProcess(index, proc, reader, writer)
        if start.config.replicas != self.config.replicas:  # a reload came while it started
            await worker.ask(control.Reload(self.config.replicas), RELOAD_TIMEOUT_S)
        return worker

    def _adopt(self, worker: WorkerProcess) -> None:
        self.alive[worker.index] = worker
        self._keepers.append(asyncio.get_running_loop().create_task(self._keep(worker)))

    async def _keep(self, worker: WorkerProcess) -> None:
        """Wait for the worker to exit; unless the parent is stopping, log it, count it
        and start another in its slot (after a backoff if it died young)."""
        index = worker.index
        quick_deaths = 0
        while True:
            returncode = await worker.proc.wait()
            self._retire(worker)
            # A SIGTERM sent to the whole process group (systemd, a supervisor's killpg)
            # reaches the workers and the parent together: give the parent's own handler
            # time to run, so a worker that drained on it is not restarted.
            await asyncio.sleep(RESTART_PAUSE_S)
            if self._stopping:
                return
            self.restarts[index] += 1
            lived = time.monotonic() - worker.started
            quick_deaths = quick_deaths + 1 if lived < RESTART_QUICK_S else 0
            log.warning(
                "worker %d (pid %d) %s after %.1f s; restarting it (restart %d)",
                index,
                worker.proc.pid,
                describe_exit(returncode),
                lived,
                self.restarts[index],
            )
            while True:
                if quick_deaths:
                    await asyncio.sleep(min(BACKOFF_MAX_S, 0.5 * 2 ** (quick_deaths - 1)))
                if self._stopping:
                    return
                try:
                    worker = await self._spawn(index)
                except (ConfigError, OSError) as exc:
                    # A StartError names the worker itself.
                    said = exc.strerror if isinstance(exc, StartError) else None
                    log.error("%s", said or f"worker {index} could not start: {exc}")
                    quick_deaths += 1
                    continue
                break
            self.alive[index] = worker

    async def _arbitrate(self, index: int, sock: socket.socket) -> None:
        assert self.arbiter is not None
        self._channels += 1
        await arbitrate(self.arbiter, self._channels, sock, f"worker {index}")

    def _retire(self, worker: WorkerProcess) -> None:
        """A worker is gone: keep what it had counted, take it out of the share."""
        if self.alive.get(worker.index) is worker:
            del self.alive[worker.index]
        if self._board is not None:
            self._board.mark_down(worker.index)
        self._retired.add_counts(worker.last)
        self._retired_requests[worker.index] += worker.last.total("saltgate_requests_total")
        worker.last = Snapshot()
        worker.close()

    async def stop(self) -> None:
        """Drain every worker (SIGTERM: requests in flight finish), then let go of the
        port, the admin port and the relay."""
        self._stopping = True
        if self._sock is not None:  # with the workers' copies closed, new connections are refused
            self._sock.close()
            self._sock = None
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
        waits = [asyncio.ensure_future(p.wait()) for p in self._procs.values()]
        if waits:
            timeout = self.config.drain_grace_s + STOP_MARGIN_S
            _, late = await asyncio.wait(waits, timeout=timeout)
            for proc in self._procs.values():
                if proc.returncode is None:
                    log.warning("worker pid %d did not stop; killing it", proc.pid)
                    proc.kill()
            await asyncio.gather(*late)
        for task in [*self._keepers, *self._arbitrating]:
            task.cancel()
        await asyncio.gather(*self._keepers, *self._arbitrating, return_exceptions=True)
        for worker in list(self.alive.values()):
            self._retire(worker)
        if self._admin is not None:
            await self._admin.close()
        self._access_log.close()
        await self._admin_api.store.aclose()
        await self._usage.aclose()
        if self.relay is not None:
            await asyncio.to_thread(self.relay.close)
        if self._board is not None:
            self._board.close()
            self._board = None

    # -- orders --------------------------------------------------------------------------
    def request_reload(self, path: Path) -> None:
        task = asyncio.get_running_loop().create_task(self.reload(path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reload(self, path: Path) -> None:
        """SIGHUP: every worker reopens its access log, whatever the file now says; then
        the file's [[replicas]] for every worker (and the ones started later)."""
        answers = await asyncio.gather(
            *(w.ask(control.ReopenLog(), RELOAD_TIMEOUT_S) for w in list(self.alive.values()))
        )
        reopened = sum(a == control.LOG_REOPENED + b"1" for a in answers)
        try:
            self._access_log.reopen()  # the admin listener's lines
        except OSError as exc:
            log.error("cannot reopen the access log: %s", exc.strerror)
        if reopened:
            log.info(
                "reopened the access log %s in %d of %d workers",
                self.config.access_log,
                reopened,
                self.workers,
            )
        config = reread_config(path)
        if config is None:
            return
        order = control.Reload(config.replicas, config.tls_cert_file, config.tls_key_file)
        self.config = dataclasses.replace(self.config, replicas=config.replicas)
        if self.config.tls_cert_file is not None and config.tls_cert_file is not None:
            # Workers started from now on load the renewed files (turning TLS on or off
            # takes a restart: the workers say so).
            self.config = dataclasses.replace(
                self.config, tls_cert_file=config.tls_cert_file, tls_key_file=config.tls_key_file
            )
        if self.relay is not None:
            self.relay.set_upstreams(kv_upstreams(config))
        answers = await asyncio.gather(
            *(w.ask(order, RELOAD_TIMEOUT_S) for w in list(self.alive.values()))
        )
        done = sum(a == control.RELOADED for a in answers)
        log.info(
            "reloaded %s: %d replicas in %d of %d workers",
            path,
            len(config.replicas),
            done,
            self.workers,
        )

    async def metrics(self) -> Snapshot:
        """Every worker's metrics merged, with the workers' own."""
        workers = list(self.alive.values())
        answers = await asyncio.gather(
            *(w.ask(control.SendMetrics(), METRICS_TIMEOUT_S) for w in workers)
        )
        for worker, answer in zip(workers, answers, strict=True):
            if answer is not None and answer[:1] == control.METRICS:
                try:
                    worker.last = Snapshot.from_json(answer[1:])
                except ValueError as exc:
                    log.warning("worker %d: unreadable metrics: %s", worker.index, exc)
        live = {str(i): w.last for i, w in self.alive.items()}
        merged = merge_workers(live, self._retired)
        slots = range(self.workers)
        merged.gauges["saltgate_workers_alive"] = Gauge(
            f"Worker processes running (of {self.workers}).", [((), float(len(self.alive)))]
        )
        if self._board is not None:
            merged.gauges["saltgate_worker_connections"] = Gauge(
                "Client connections open, per worker.",
                [
                    ((("worker", str(i)),), float(n))
                    for i in slots
                    if (n := self._board.connections(i)) is not None
                ],
            )
        merged.counters["saltgate_worker_restarts_total"] = Counter(
            "counter",
            "Workers that died and were restarted, per worker slot.",
            {(("worker", str(i)),): float(self.restarts[i]) for i in slots},
        )
        merged.counters["saltgate_worker_requests_total"] = Counter(
            "counter",
            "Requests answered, per worker slot (a restarted worker continues its slot).",
            {(("worker", str(i)),): self._slot_requests(i) for i in slots},
        )
        return merged

    def _slot_requests(self, index: int) -> float:
        worker = self.alive.get(index)
        now = worker.last.total("saltgate_requests_total") if worker is not None else 0.0
        return self._retired_requests[index] + now

    async def _render(self) -> bytes:
        return render(await self.metrics())


def serve_workers(config: GatewayConfig, workers: int) -> int:
    """`saltgate serve --workers N`; the exit status, as `saltgate.serving.run.serve`."""
    return run_service(
        lambda: _serve_workers(config, workers),
        "saltgate",
        cannot_run=f"cannot serve on {config.host}:{config.port}",
        usage_errors=(ConfigError, StoreError),
    )


async def _serve_workers(config: GatewayConfig, workers: int) -> None:
    """Run until SIGTERM or SIGINT, then drain every worker."""
    event_log.configure(config.log_format, supervisor=True)
    supervisor = Supervisor(config, workers)
    await supervisor.start()
    announce(
        config,
        supervisor.url,
        admin_port=supervisor.admin_port,
        ehbp_fingerprint=supervisor.ehbp_fingerprint,
        parts=(
            supervisor.relay.describe() if supervisor.relay else None,
            f"cluster bus {config.cluster.url}, every worker a peer on it"
            if config.cluster
            else None,
        ),
        workers=workers,
    )
    await supervise(supervisor, config)


async def supervise(supervisor: Supervisor, config: GatewayConfig) -> None:
    """The started parent's life, the gateway's and the EPP's (epp/supervisor.py): SIGHUP
    reloads the config file's [[replicas]] in every worker, SIGTERM or SIGINT drains them
    all."""
    if config.config_file is not None:
        asyncio.get_running_loop().add_signal_handler(
            signal.SIGHUP, supervisor.request_reload, config.config_file
        )
    try:
        await until_stopped()
        log.info("stopping: draining %d workers", len(supervisor.alive))
    finally:
        await supervisor.stop()
    log.info("stopped")
