"""What ships beside the code (packaging/, the pyproject files, the locks), checked without
installing anything: the systemd unit by the real systemd-analyze, the Dockerfile by
reading it (no Docker on the test machines: docs/install.md), and the distributions'
metadata against each other and against the commands' install hints.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from saltgate import __version__, cli
from saltgate.cli import TOOL_EXTRAS, install_hint, main

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CLIENT = tomllib.loads((ROOT / "packaging/client/pyproject.toml").read_text())["project"]
DEV_PROJECTS = [
    tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
    for folder in ("devkit", "benchmarks")
]
UNIT = ROOT / "packaging/saltgate.service"
DOCKERFILE = ROOT / "packaging/Dockerfile"
INSTALLED_AT = "/opt/saltgate/bin/saltgate"  # where the unit's header installs it


def names(requirements: list[str]) -> set[str]:
    """The distributions' names, without extras, versions or comments."""
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0] for r in requirements}


def pinned(lock: str) -> set[str]:
    return set(versions(lock))


def versions(lock: str) -> dict[str, str]:
    """The lock's pins: name to version."""
    text = (ROOT / lock).read_text()
    return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.MULTILINE))


@pytest.mark.unit
def test_the_client_is_saltgate_with_fewer_dependencies() -> None:
    assert CLIENT["version"] == PYPROJECT["version"] == __version__
    assert set(CLIENT["dependencies"]) < set(PYPROJECT["dependencies"])  # same specifiers
    assert CLIENT["optional-dependencies"]["openai"] == PYPROJECT["optional-dependencies"]["openai"]
    assert CLIENT["scripts"] == PYPROJECT["scripts"]
    assert names(CLIENT["dependencies"]).isdisjoint({"pyzmq", "psycopg", "redis", "cbor2"})


@pytest.mark.unit
def test_each_tool_names_the_libraries_its_extra_brings() -> None:
    """cli.TOOL_EXTRAS (checked before a tool runs) against pyproject.toml's extras, and
    the runtime free of them: most import under their distributions' names, these not."""
    imported_as = {
        "pyyaml": "yaml",
        "grpcio": "grpc",
        "grpcio-health-checking": "grpc_health",
        "xds-protos": "xds",
    }
    extras = PYPROJECT["optional-dependencies"]
    for command, modules in TOOL_EXTRAS.items():
        assert set(modules) == {imported_as.get(n, n) for n in names(extras[command])}, command
        assert install_hint(command) == f"pip install 'saltgate[{command}]'"
        assert names(PYPROJECT["dependencies"]).isdisjoint(modules)
    assert install_hint("serve") == "pip install 'saltgate'"
    # dev brings every other extra, so the tests can run every tool.
    [itself] = [d for d in extras["dev"] if d.startswith("saltgate[")]
    assert set(itself.removeprefix("saltgate[").removesuffix("]").split(",")) == set(extras) - {
        "dev"
    }


@pytest.mark.unit
def test_a_tool_without_its_extra_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process, with scipy hidden (tests/dist/test_dist.py: in a real install)."""
    monkeypatch.setitem(sys.modules, "scipy", None)
    assert main(["audit", "timing", "--base-url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert err == "saltgate audit: needs scipy, not installed: pip install 'saltgate[audit]'\n"


@pytest.mark.unit
def test_a_command_whose_parser_needs_the_server_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As in saltgate-client, where `saltgate sim`'s arguments cannot be read (no cbor2):
    listed, and any use of it, --help too, names the install. A missing saltgate module
    is a bug, and is not hidden."""

    def missing(name: str) -> None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(cli, "_add_sim", lambda _: missing("cbor2"))
    for argv in (["sim", "--help"], ["sim", "--port", "5"], ["sim"]):
        assert main(argv) == 2
        assert (
            capsys.readouterr().err
            == "saltgate sim: needs cbor2, not installed: pip install 'saltgate'\n"
        )
    with pytest.raises(SystemExit):
        main(["--help"])
    listing = capsys.readouterr().out  # its column's width follows the longest command
    assert re.search(r"^ +sim +\(not installed: pip install 'saltgate'\)$", listing, re.M)
    with pytest.raises(SystemExit):
        main(["up", "--bogus"])  # other commands still refuse what they do not know
    monkeypatch.setattr(cli, "_add_sim", lambda _: missing("saltgate.sim.server"))
    with pytest.raises(ModuleNotFoundError):
        main(["sim"])


@pytest.mark.unit
def test_the_locks_pin_what_their_installs_need() -> None:
    runtime, client, dev = (
        pinned(lock)
        for lock in ("requirements-runtime.lock", "requirements-client.lock", "requirements.lock")
    )
    assert client < runtime < dev
    assert names(PYPROJECT["dependencies"]) | {"psycopg-binary", "psycopg-pool"} <= runtime
    assert names(CLIENT["dependencies"]) <= client
    assert runtime.isdisjoint({"numpy", "scipy", "matplotlib", "tqdm", "pytest", "mypy", "ruff"})
    assert {"numpy", "scipy", "matplotlib", "tqdm", "pytest", "mypy", "ruff", "build"} <= dev


@pytest.mark.unit
def test_the_build_lock_pins_the_dev_extras_build_tools_at_the_dev_locks_versions() -> None:
    """`make dist` builds in an environment of requirements-runtime.lock and
    requirements-build.lock alone (tests/dist/test_dist.py checks it): the build lock's
    input asks for the dev extra's own specifiers, and every pin is the dev lock's, so
    mypyc is the mypy `make typecheck` runs and the two locks agree where they overlap."""
    wanted = [
        line.split("#")[0].strip()
        for line in (ROOT / "packaging/requirements-build.in").read_text().splitlines()
    ]
    wanted = [w for w in wanted if w]
    assert set(wanted) <= set(PYPROJECT["optional-dependencies"]["dev"])
    assert names(wanted) == {"setuptools", "build", "mypy"}
    build, runtime, dev = (
        versions(lock)
        for lock in ("requirements-build.lock", "requirements-runtime.lock", "requirements.lock")
    )
    assert names(wanted) <= set(build)
    assert build.items() <= dev.items()
    assert runtime.items() <= dev.items()
    assert build.keys().isdisjoint({"numpy", "scipy", "pytest", "ruff", "playwright", "openai"})


@pytest.mark.unit
def test_the_dev_lock_pins_what_the_devkit_and_the_benchmarks_need() -> None:
    """`make install` installs devkit/ and benchmarks/ without their dependencies, so
    requirements.lock must pin them; they use saltgate's own specifiers (the runtime's, or
    the audit's for the plotting libraries), so one resolution serves both."""
    dev = pinned("requirements.lock")
    shared = set(PYPROJECT["dependencies"]) | set(PYPROJECT["optional-dependencies"]["audit"])
    for project in DEV_PROJECTS:
        libraries = {d for d in project["dependencies"] if not d.startswith("saltgate")}
        assert libraries <= shared, project["name"]
        assert names(list(libraries)) <= dev, project["name"]
        assert project["version"] == __version__


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing: run scripts/services-setup.sh (make services)"
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=60, check=False)


def runnable_unit(tmp_path: Path, text: str) -> Path:
    """The unit with ExecStart pointing at this environment's saltgate: verify checks the
    program exists, and /opt/saltgate is not installed here."""
    assert text.count(INSTALLED_AT) == 2  # the check before the start, the start
    unit = tmp_path / "saltgate.service"
    unit.write_text(text.replace(INSTALLED_AT, str(Path(sys.executable).parent / "saltgate")))
    return unit


@pytest.mark.parametrize("broken", [False, True], ids=["as-shipped", "misspelt-control"])
def test_the_systemd_unit_verifies_clean(tmp_path: Path, broken: bool) -> None:
    """No error and no warning; the control shows a misspelt key is a warning it catches."""
    text = UNIT.read_text()
    if broken:
        text = text.replace("NoNewPrivileges=yes", "NoNewPrivilege=yes")
    done = analyze("verify", str(runnable_unit(tmp_path, text)))
    assert done.returncode == 0, done.stderr
    assert (done.stderr.strip() != "") == broken, done.stderr


def test_the_systemd_unit_is_hardened(tmp_path: Path) -> None:
    text = UNIT.read_text()
    for line in (
        "User=saltgate",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "StateDirectory=saltgate",
        "ExecReload=/bin/kill -HUP $MAINPID",
        # A configuration error is said once, not restarted every 2 s forever (exit 2).
        f"ExecStartPre={INSTALLED_AT} serve --check --config /etc/saltgate/gateway.toml",
        "RestartPreventExitStatus=2",
    ):
        assert re.search(rf"^{re.escape(line)}$", text, re.MULTILINE), line
    done = analyze("security", "--offline=yes", str(runnable_unit(tmp_path, text)))
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", done.stdout)
    assert found, done.stdout[-2000:]
    assert float(found.group(1)) <= 2.0, done.stdout  # systemd calls up to 3.9 "OK"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuations joined."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in joined.splitlines()]
    return [
        (parts[0].upper(), parts[1] if len(parts) > 1 else "")
        for parts in (line.split(None, 1) for line in lines if line and not line.startswith("#"))
    ]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for instruction in instructions(path):
        if instruction[0] == "FROM":
            found.append([])
        if found:
            found[-1].append(instruction)
    return found


@pytest.mark.unit
def test_the_dockerfile_builds_with_make_dist_and_runs_the_wheel_unprivileged() -> None:
    builder, runtime = stages(DOCKERFILE)
    ignored = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and line[0] != "#"
    ]
    for kind, args in builder:
        if kind == "COPY":
            *sources, _ = args.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source.split("/")[0] not in ignored, f"COPY {source}: in .dockerignore"
    assert ("RUN", "make dist") in builder
    assert re.search(r"^dist:", (ROOT / "Makefile").read_text(), re.MULTILINE)
    run = " ".join(args for kind, args in runtime if kind == "RUN")
    assert (
        "pip install --no-cache-dir --require-hashes -r /tmp/saltgate/requirements-runtime.lock"
        in run
    )
    assert "pip install --no-cache-dir --no-deps /tmp/saltgate/saltgate-*.whl" in run
    [copied] = [args for kind, args in runtime if kind == "COPY"]
    assert copied.startswith("--from=builder /src/requirements-runtime.lock /src/dist/saltgate-")
    [user] = [args for kind, args in runtime if kind == "USER"]
    assert user == "10001:10001"  # numeric and fixed: runAsNonRoot, files chowned ahead
    assert "groupadd --system --gid 10001 saltgate" in run
    assert "useradd --system --uid 10001 --gid saltgate" in run
    [health] = [args for kind, args in runtime if kind == "HEALTHCHECK"]
    assert "SALTGATE_HEALTH_URL" in health
    assert any(kind == "ENV" and "/health" in args for kind, args in runtime)
    assert ("VOLUME", '["/var/lib/saltgate"]') in runtime
    assert ("ENTRYPOINT", '["saltgate"]') in runtime
