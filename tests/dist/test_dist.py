"""The installs a node and a user make (docs/install.md): `make dist`'s wheels, each in a
fresh virtual environment holding only its lock and the wheel.

Slow, one to three minutes, because it is the install itself: `make dist` (which reuses
the compiled wheel `make install-compiled` built, and compiles it only if the sources
changed since, a minute or more, in its own environment of the runtime and build locks),
then two virtual environments, each installing its
lock's packages by hash. The locks are installed with `--require-hashes` and the wheels
with `--no-deps`, so nothing outside the locks can come in: a dependency missing from
requirements-runtime.lock or requirements-client.lock fails here, not on a node.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from tests.support.http import async_client
from tests.support.up import saltgate_up

from saltgate import __version__
from saltgate.client.secret import ENV_VAR
from saltgate.config import create_master_key
from saltgate.sim.server import SimConfig
from saltgate.store.schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]
MODEL = SimConfig().model
SECRET = "dist-user-" + "5" * 40
# What only the gateway needs (the server's libraries) and what only the tools need.
SERVER_ONLY = ("zmq", "msgpack", "cbor2", "psycopg", "redis")
TOOLS_ONLY = ("numpy", "scipy", "matplotlib", "tqdm")
# Development projects beside the product (benchmarks/, devkit/), in neither wheel.
NOT_SHIPPED = ("saltgate_bench", "saltgate_devkit", "saltgate.bench")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would let a fresh venv see the checkout, or a make
    started by pytest see the make that started pytest."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


def run(args: Sequence[str | Path], *, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=clean_env(),
        cwd=ROOT,
    )


def ok(args: Sequence[str | Path], *, timeout: float = 600) -> str:
    done = run(args, timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def dist() -> Path:
    ok(["make", "--no-print-directory", "dist"], timeout=900)
    return ROOT / "dist"


def one(directory: Path, pattern: str) -> Path:
    [found] = sorted(directory.glob(pattern))
    return found


def fresh_venv(path: Path, lock: str, wheel: Path) -> Path:
    """A virtual environment with the lock's packages and the wheel; its bin directory."""
    ok([sys.executable, "-m", "venv", path])
    pip: list[str | Path] = [path / "bin" / "python", "-m", "pip", "install", "--quiet"]
    ok([*pip, "--require-hashes", "-r", ROOT / lock])
    ok([*pip, "--no-deps", wheel])
    return path / "bin"


def importable(python: Path, modules: Sequence[str]) -> dict[str, bool]:
    code = (
        "import importlib.util, sys\n"
        "for m in sys.argv[1:]: print(m, importlib.util.find_spec(m) is not None)"
    )
    out = ok([python, "-c", code, *modules])
    return {m: found == "True" for m, found in (line.split() for line in out.splitlines())}


def refused(bin_dir: Path, args: Sequence[str], install: str) -> None:
    """The command exits 2 naming the install it needs, in one line, no traceback."""
    done = run([bin_dir / "saltgate", *args], timeout=120)
    assert done.returncode == 2, (args, done.stdout, done.stderr)
    assert f"pip install '{install}'" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def installed(python: Path | str) -> set[str]:
    """The distributions in python's environment, by normalised name (the locks' spelling)."""
    code = "import importlib.metadata as m\nfor d in m.distributions(): print(d.metadata['Name'])"
    return {re.sub(r"[-_.]+", "-", name).lower() for name in ok([python, "-c", code]).split()}


def pinned(*locks: str) -> set[str]:
    text = "".join((ROOT / lock).read_text() for lock in locks)
    return set(re.findall(r"^([a-z0-9-]+)==", text, re.MULTILINE))


@pytest.mark.dist
@pytest.mark.timeout(1200)
def test_the_wheels_are_built_from_the_runtime_and_build_locks_alone(dist: Path) -> None:
    """make dist's environment holds requirements-runtime.lock's and
    requirements-build.lock's packages and pip: none of the dev lock's 80 (it took 3.5
    minutes to install them to build a wheel). The control: the same check on this
    environment, the dev lock's, finds the test tools."""
    allowed = pinned("requirements-runtime.lock", "requirements-build.lock") | {"pip"}
    builder = installed(ROOT / "build/venv/bin/python")
    assert builder - allowed == set(), "make dist's environment has more than its locks"
    assert {"mypy", "setuptools", "build", "httpx", "orjson"} <= builder
    assert {"pytest", "ruff", "scipy"} <= installed(sys.executable) - allowed  # the control


def audits_without_the_extra(server: Path, directory: Path) -> None:
    """`audit deployment` runs on the gateway's install (it asked for numpy), against a
    replica that is not there, and every finding in its table has a fix."""
    directory.mkdir(mode=0o700)
    create_master_key(directory / "master.key")
    config = directory / "gateway.toml"
    config.write_text(
        f'[gateway]\nstate_dir = "{directory}"\nmaster_key_file = "{directory}/master.key"\n'
        '[[replicas]]\nurl = "http://127.0.0.1:9"\n'
    )
    done = run([server / "saltgate", "audit", "deployment", "--config", config, "--timeout", "2"])
    assert done.returncode == 0, done.stdout + done.stderr
    header, _rule, *rows = done.stdout.splitlines()
    fix_at = header.index("fix")
    assert len(rows) > 10 and all(row[fix_at:].strip() for row in rows), done.stdout


@pytest.mark.dist
@pytest.mark.timeout(1200)  # a compile and two installs on a loaded machine (see above)
def test_the_wheels_alone_serve_and_proxy_a_request(dist: Path, tmp_path: Path) -> None:
    server = fresh_venv(
        tmp_path / "server", "requirements-runtime.lock", one(dist, "saltgate-*-cp*.whl")
    )
    client = fresh_venv(
        tmp_path / "client", "requirements-client.lock", one(dist, "saltgate_client-*.whl")
    )
    assert ok([server / "saltgate", "--version"]).strip() == (
        f"saltgate {__version__} (compiled; store schema {SCHEMA_VERSION})"
    )
    where = ok([server / "python", "-c", "import saltgate; print(saltgate.__file__)"])
    assert where.startswith(str(tmp_path / "server")), where  # the wheel, not the checkout

    # The gateway's install has the server's libraries, not the tools', nor the benchmarks.
    assert importable(server / "python", SERVER_ONLY + TOOLS_ONLY + NOT_SHIPPED) == {
        **dict.fromkeys(SERVER_ONLY, True),
        **dict.fromkeys(TOOLS_ONLY + NOT_SHIPPED, False),
    }
    refused(server, ["audit", "timing", "--base-url", "http://127.0.0.1:9"], "saltgate[audit]")
    audits_without_the_extra(server, tmp_path / "audit")
    assert "invalid choice: 'bench'" in run([server / "saltgate", "bench", "replay"]).stderr
    assert "--base-url" in ok([server / "saltgate", "audit", "timing", "--help"])

    # The client's install has neither; its SDK imports, its proxy runs, the gateway's
    # commands say what to install.
    assert importable(client / "python", ("saltgate.client", *SERVER_ONLY, *TOOLS_ONLY)) == {
        "saltgate.client": True,
        **dict.fromkeys(SERVER_ONLY + TOOLS_ONLY, False),
    }
    assert importable(client / "python", NOT_SHIPPED) == dict.fromkeys(NOT_SHIPPED, False)
    ok([client / "python", "-c", "import saltgate.client, saltgate.client.proxy"])
    assert "--upstream" in ok([client / "saltgate", "proxy", "--help"])
    refused(client, ["up", "--port", "9"], "saltgate")
    refused(client, ["sim", "--help"], "saltgate")

    async def main() -> None:
        async with saltgate_up(tmp_path / "state", command=[str(server / "saltgate")]) as up:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            async with async_client(timeout=60) as http:
                resp = await http.post(
                    f"{up.url}/v1/chat/completions",
                    json={**body, "max_tokens": 4},
                    headers={"authorization": f"Bearer {up.api_key()}"},
                )
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["message"]["content"]
                await through_the_proxy(client, up.url, up.api_key(), tmp_path, http)

    asyncio.run(main())


async def through_the_proxy(
    client: Path, upstream: str, api_key: str, tmp_path: Path, http: httpx.AsyncClient
) -> None:
    """The client install's `saltgate proxy` carries a chat completion to the gateway."""
    env = clean_env(HOME=str(tmp_path / "home"), SALTGATE_API_KEY=api_key, **{ENV_VAR: SECRET})
    proc = await asyncio.create_subprocess_exec(
        str(client / "saltgate"), "proxy", "--upstream", upstream, "--port", "0",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        banner = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", banner)
        assert found, banner
        resp = await http.post(
            f"http://127.0.0.1:{found.group(1)}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
    assert proc.returncode == 0
