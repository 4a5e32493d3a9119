"""Throwaway local servers for tests and benchmarks: PostgreSQL, Redis and HAProxy,
started by the project.

Each server lives in a fresh temporary directory, listens on a free loopback port only,
and is stopped (and its directory removed) by its owner. scripts/services-setup.sh
installs the binaries; nothing here uses systemd or a system-wide cluster.

PostgreSQL refuses to run as root, so as root its commands run through ``runuser`` as
the unprivileged user the setup script creates (``$SALTGATE_PG_USER``, default
saltgate-pg); as any other user they run as that user. Clients authenticate with a
random password (scram-sha-256), handed to them in a 0600 file, as a deployment would.
Redis (the cluster bus) likewise requires a random password from a 0600 file and keeps
nothing on disk; HAProxy balances HTTP over a list of loopback servers.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

import psycopg
from psycopg import sql

from saltgate.routing.cluster import ClusterSettings
from saltgate.store.settings import StoreSettings
from saltgate_devkit.procs import free_port

SETUP_HINT = "run scripts/services-setup.sh (make test does)"
PG_MAJOR = 15
PG_USER_ENV = "SALTGATE_PG_USER"
PG_BINDIR_ENV = "SALTGATE_PG_BINDIR"
DEFAULT_PG_USER = "saltgate-pg"
SUPERUSER = "saltgate"
_TIMEOUT_S = 60


class ServiceError(Exception):
    """A server could not be found, started or stopped; the message says what is missing."""


def start_on_a_port(port: int, launch: Callable[[int], None]) -> int:
    """``launch(port)``, and the port it started on. A server not yet given one starts on
    a free port, and on another up to twice more if it fails: a free port can be taken
    by another process between its choice and the server's bind."""
    attempts = 1 if port else 3
    for attempt in range(attempts):
        if not port or attempt:
            port = free_port()
        try:
            launch(port)
            return port
        except ServiceError:
            if attempt + 1 == attempts:
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def postgres_bindir() -> Path:
    """Where initdb, pg_ctl and postgres are (Debian keeps them off PATH)."""
    candidates = []
    if os.environ.get(PG_BINDIR_ENV):
        candidates.append(Path(os.environ[PG_BINDIR_ENV]))
    candidates.append(Path(f"/usr/lib/postgresql/{PG_MAJOR}/bin"))
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    for bindir in candidates:
        if all(os.access(bindir / tool, os.X_OK) for tool in ("initdb", "pg_ctl", "postgres")):
            return bindir
    raise ServiceError(
        f"PostgreSQL {PG_MAJOR} is not installed (no initdb, pg_ctl and postgres in "
        f"{', '.join(str(c) for c in candidates)}): {SETUP_HINT}"
    )


def _run_as() -> pwd.struct_passwd | None:
    """The user PostgreSQL runs as: None means "this process's user" (not root)."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get(PG_USER_ENV, DEFAULT_PG_USER)
    try:
        user = pwd.getpwnam(name)
    except KeyError:
        raise ServiceError(
            f"PostgreSQL refuses to run as root and the unprivileged user {name!r} does not "
            f"exist: {SETUP_HINT}"
        ) from None
    if shutil.which("runuser") is None:
        raise ServiceError(f"runuser (util-linux) is needed to run PostgreSQL as {name}")
    return user


class PostgresServer:
    """One PostgreSQL cluster in a temporary directory; `start`, `stop`, `destroy`.

    The port is chosen once, so a server stopped and started again (an outage test) comes
    back where its clients look for it.
    """

    def __init__(
        self, *, fsync: bool = True, max_connections: int = 200, cpu: int | None = None
    ) -> None:
        """`cpu`: pin the server's processes there (taskset), away from what is measured."""
        self.bindir = postgres_bindir()
        self._cpu = cpu
        self._user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix="saltgate-pg-"))
        self.data = self.root / "data"
        self.log = self.root / "postgres.log"
        self.password_file = self.root / "client-password"
        self.port = 0
        self._fsync = fsync
        self._max_connections = max_connections
        self.running = False
        try:
            self._init()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise

    # -- lifecycle ------------------------------------------------------------------------

    def _init(self) -> None:
        password = secrets.token_urlsafe(24)
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        pwfile = self.root / "initdb-password"
        pwfile.write_text(password + "\n")
        pwfile.chmod(0o600)
        if self._user is not None:
            # The cluster's user owns the directory; the client password file stays ours.
            for path in (self.root, pwfile):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
        self._pg(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
            "--no-instructions",
        )
        pwfile.unlink()

    def start(self) -> None:
        """Start (first time: on a free port) and wait until it accepts connections."""
        if self.running:
            return

        def launch(port: int) -> None:
            self.port = port
            self._configure()
            self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "start")

        start_on_a_port(self.port, launch)
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """pg_ctl stop -m `mode` ("fast", or "immediate" for a crash-like stop)."""
        if not self.running:
            return
        self._pg("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")
        self.running = False

    def destroy(self) -> None:
        try:
            with contextlib.suppress(ServiceError):
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    # -- clients --------------------------------------------------------------------------

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def settings(self, database: str, spool_dir: Path) -> StoreSettings:
        """A `[store]` for `database`, with the password from this server's 0600 file."""
        return StoreSettings(
            "postgresql",
            self.url(database),
            password_file=self.password_file,
            spool_dir=spool_dir,
        )

    def connect(self, database: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            self.url(database),
            password=self.password_file.read_text().strip(),
            autocommit=True,
        )

    def create_database(self, name: str) -> None:
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    # -- internals ------------------------------------------------------------------------

    def _configure(self) -> None:
        """Loopback only, our port, the socket in our directory, logs to our file; the log
        names any statement that takes over a second or waits on a lock, with its time."""
        conf = self.data / "postgresql.auto.conf"
        settings = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
            "max_connections": str(self._max_connections),
            "fsync": "on" if self._fsync else "off",
            "logging_collector": "off",
            "log_line_prefix": "'%m [%p] %q%d '",
            "log_min_duration_statement": "1000",
            "log_lock_waits": "on",
        }
        conf.write_text("".join(f"{k} = {v}\n" for k, v in settings.items()))
        if self._user is not None:
            os.chown(conf, self._user.pw_uid, self._user.pw_gid)

    def _pg(self, tool: str, *args: str, cpu: int | None = None) -> None:
        argv = [str(self.bindir / tool), *args]
        if self._user is not None:
            argv = ["runuser", "-u", self._user.pw_name, "--", *argv]
        if cpu is not None:  # the server's processes inherit the affinity
            taskset = shutil.which("taskset")
            if taskset is None:
                raise ServiceError("taskset (util-linux) is needed to pin PostgreSQL")
            argv = [taskset, "-c", str(cpu), *argv]
        try:
            done = subprocess.run(  # noqa: S603 - fixed tools, our own arguments
                argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ServiceError(f"{tool} failed: {exc}") from None
        if done.returncode != 0:
            log = ""
            with contextlib.suppress(OSError):
                log = self.log.read_text()[-2000:]
            raise ServiceError(
                f"{tool} {' '.join(args[-1:])} failed ({done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-2000:]}\n{log}".strip()
            )


# -- Redis and HAProxy: plain children in a temporary directory -------------------------


def _binary(name: str, package: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/sbin")
    if found is None:
        raise ServiceError(f"{package} is not installed (no {name} on PATH): {SETUP_HINT}")
    return found


class _Child:
    """One server process in its own process group, its output in a log file."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = root
        self.log = root / f"{name}.log"
        self._popen: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def spawn(self, argv: Sequence[str]) -> None:
        self._log_file = self.log.open("ab")
        self._popen = subprocess.Popen(  # noqa: S603 - our binary, our arguments
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_port(self, port: int, timeout: float = _TIMEOUT_S) -> None:
        """Until something accepts on 127.0.0.1:port; ServiceError (with the log) if the
        process exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise ServiceError(f"{self.name} exited at start:\n{self.tail()}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                return
            time.sleep(0.05)
        raise ServiceError(f"{self.name} not accepting on port {port} after {timeout} s")

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM (or SIGKILL: a crash) to the process group, and wait."""
        popen = self._popen
        if popen is not None and popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, sig)
            try:
                popen.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGKILL)
                popen.wait(10)
        self._popen = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class RedisServer:
    """One redis-server in a temporary directory: loopback only, a random password (the
    client's copy in a 0600 file), nothing saved to disk. The port is kept across a
    stop and a start, so an outage test's clients find it again."""

    def __init__(self) -> None:
        self.binary = _binary("redis-server", "Redis 7")
        self.root = Path(tempfile.mkdtemp(prefix="saltgate-redis-"))
        self.root.chmod(0o700)
        self.password_file = self.root / "password"
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        self.port = 0
        self._child = _Child("redis", self.root)

    @property
    def running(self) -> bool:
        return self._child.running

    def start(self) -> None:
        if self.running:
            return

        def launch(port: int) -> None:
            self.port = port
            conf = self.root / "redis.conf"
            password = self.password_file.read_text().strip()
            conf.write_text(
                f"bind 127.0.0.1\nport {port}\nprotected-mode yes\n"
                f'dir "{self.root}"\nsave ""\nappendonly no\ndaemonize no\n'
                f"requirepass {password}\n"
            )
            conf.chmod(0o600)
            self._child.spawn([self.binary, str(conf)])
            try:
                self._child.wait_port(port)
            except ServiceError:
                self._child.stop(signal.SIGKILL)
                raise

        start_on_a_port(self.port, launch)

    def stop(self, *, crash: bool = False) -> None:
        """Stop the server (``crash``: SIGKILL, as a lost node would)."""
        self._child.stop(signal.SIGKILL if crash else signal.SIGTERM)

    def destroy(self) -> None:
        try:
            self.stop(crash=True)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def settings(self, gateway_id: str, *, publish_interval_s: float = 0.001) -> ClusterSettings:
        """A `[cluster]` for a gateway named ``gateway_id``, with this server's password."""
        return ClusterSettings(
            self.url(),
            gateway_id,
            password_file=self.password_file,
            publish_interval_s=publish_interval_s,
        )


class HaproxyServer:
    """HAProxy in front of HTTP servers on loopback: round robin per request.

    HAProxy balances every request of a kept-alive client connection on its own (its
    default http-keep-alive mode; `option prefer-last-server` would stick, and is off).
    `option http-server-close` closes the server side after each response, so no request
    is ever written to an idle connection of a server that has just died: one killed
    behind it fails only the requests it was serving, and the next ones meet a refused
    connect, which `retries` + `option redispatch` send to another server. Health checks
    (GET /health every 0.5 s, down after 2 failures) take a dead server out.
    """

    def __init__(self, servers: Sequence[int], *, check_interval_ms: int = 500) -> None:
        self.binary = _binary("haproxy", "HAProxy")
        self.root = Path(tempfile.mkdtemp(prefix="saltgate-haproxy-"))
        self.servers = list(servers)
        self.check_interval_ms = check_interval_ms
        self.port = 0
        self._child = _Child("haproxy", self.root)

    def config(self) -> str:
        lines = [
            "global",
            "    maxconn 4096",
            "defaults",
            "    mode http",
            "    option http-server-close",
            "    option redispatch 1",
            "    retries 3",
            "    timeout connect 1s",
            "    timeout client 600s",
            "    timeout server 600s",
            "    timeout http-keep-alive 60s",
            "frontend gateways",
            f"    bind 127.0.0.1:{self.port}",
            "    default_backend fleet",
            "backend fleet",
            "    balance roundrobin",
            "    option httpchk GET /health",
            "    http-check expect status 200",
        ]
        inter = self.check_interval_ms
        lines += [
            f"    server g{i} 127.0.0.1:{port} check inter {inter}ms fall 2 rise 2"
            for i, port in enumerate(self.servers)
        ]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        attempts = 3
        for attempt in range(attempts):
            self.port = free_port()
            cfg = self.root / "haproxy.cfg"
            cfg.write_text(self.config())
            self._child.spawn([self.binary, "-db", "-f", str(cfg)])
            try:
                self._child.wait_port(self.port)
                return
            except ServiceError:
                self._child.stop(signal.SIGKILL)
                if attempt + 1 == attempts:
                    raise

    def stop(self) -> None:
        self._child.stop()

    def destroy(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def tail(self) -> str:
        return self._child.tail()
