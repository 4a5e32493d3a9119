"""The two builds of saltgate (saltgate/buildinfo.py, setup.py): the suite runs the one
`make` asked for, a compiled build is really compiled, a build without a compiler falls
back to pure Python and says so, and the compiled modules stay clear of what mypyc
translates wrongly or not at all.

`make pytest-compiled` and `make pytest-pure` set SALTGATE_EXPECT_BUILD; run by hand,
these tests check that the build in .venv is one of the two, whole, and says so.
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from saltgate import __version__
from saltgate.buildinfo import COMPILED, COMPILED_MODULES, PURE, build_kind
from saltgate.derivations.derive import cache_salt
from saltgate.store.schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = {"compiled": COMPILED, "pure": PURE}
EXTENSIONS = tuple(importlib.machinery.EXTENSION_SUFFIXES)


def module_path(module: str) -> Path:
    return ROOT / "src" / Path(*module.split(".")).with_suffix(".py")


def test_the_build_under_test_is_the_one_asked_for() -> None:
    kind = build_kind()
    asked = os.environ.get("SALTGATE_EXPECT_BUILD")
    if asked is None:
        assert kind in (COMPILED, PURE), kind
    else:
        assert asked in EXPECTED, f"SALTGATE_EXPECT_BUILD={asked!r}: expected one of {EXPECTED}"
        assert kind == EXPECTED[asked], f"make asked for the {asked} build; this is {kind}"
    for name in COMPILED_MODULES:
        loaded = importlib.import_module(name).__file__
        assert loaded is not None
        assert loaded.endswith(EXTENSIONS) == (kind == COMPILED), loaded
    # Compiled functions are C functions, not Python ones: the file name is not all.
    assert isinstance(cache_salt, types.FunctionType) == (kind == PURE)
    command = Path(sys.executable).parent / "saltgate"
    done = subprocess.run(
        [str(command), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"saltgate {__version__} ({kind}; store schema {SCHEMA_VERSION})"


def checkout_copy(tmp_path: Path) -> Path:
    """What a wheel is built from, away from this checkout's build/ and src/."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_without_a_compiler_the_wheel_is_pure_python_and_says_why(tmp_path: Path) -> None:
    copy = checkout_copy(tmp_path)
    # What an earlier build left in build/lib must not reach the wheel (setup.py clears it).
    build_lib = copy / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    (build_lib / "saltgate").mkdir(parents=True)
    (build_lib / "saltgate" / "left_over.py").write_text("")
    env = {**os.environ, "SALTGATE_BUILD": "compiled", "CC": str(tmp_path / "no-such-cc")}
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(
        [*build, "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp_path), str(copy)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("saltgate-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        record = json.loads(archive.read("saltgate/_build.json"))
    assert not [n for n in names if n.endswith(EXTENSIONS)]
    assert "saltgate/left_over.py" not in names
    assert {f"saltgate/{m.split('.', 1)[1].replace('.', '/')}.py" for m in COMPILED_MODULES} <= set(
        names
    )
    assert record["requested"] == "compiled" and record["built"] == "pure Python"
    assert "no-such-cc" in record["fallback_reason"]

    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(
        [*install, "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300
    )
    version = subprocess.run(
        [sys.executable, "-m", "saltgate.cli", "--version"],
        env={**os.environ, "PYTHONPATH": str(site)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert version.startswith(f"saltgate {__version__} (pure Python: the compiled build fell back")
    assert "no-such-cc" in version


def test_a_compiled_build_into_the_sources_is_refused(tmp_path: Path) -> None:
    """Extensions in src/ would shadow every later edit of the .py files they came from."""
    copy = checkout_copy(tmp_path)
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=copy,
        env={**os.environ, "SALTGATE_BUILD": "compiled"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode != 0
    assert "builds a wheel only" in done.stderr
    assert not [p for p in (copy / "src").rglob("*") if p.name.endswith(EXTENSIONS)]


# -- what mypyc gets wrong -----------------------------------------------------------------


def mypyc_hazards(source: str) -> list[str]:
    """Constructs that break compiled: async generators (mypyc cannot compile them); one
    name bound by except clauses of different types in a function (mypyc gives the name
    one variable, typed by the first clause, and the second raises TypeError); and a
    coroutine suspending while it handles an exception (buildinfo.py says what leaks)."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        own = list(own_nodes(fn))
        if isinstance(fn, ast.AsyncFunctionDef) and any(
            isinstance(n, ast.Yield | ast.YieldFrom) for n in own
        ):
            found.append(f"{fn.name}: async generator")
        found += [
            f"{fn.name}: suspends while handling an exception (line {line})"
            for line in sorted(set(suspensions_in_handlers(own)))
        ]
        bound: dict[str, set[str]] = {}
        for node in own:
            if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                bound.setdefault(node.name, set()).add(ast.unparse(node.type))
        found += [
            f"{fn.name}: except ... as {name} binds {sorted(kinds)}"
            for name, kinds in bound.items()
            if len(kinds) > 1
        ]
    return found


def suspensions_in_handlers(own: list[ast.AST]) -> Iterator[int]:
    """Lines that await or yield inside an except or finally block (a compiled generator
    leaks the same way), and every `async with` (its exit is awaited while the body's
    exception is being handled)."""
    suspends = ast.Await | ast.AsyncFor | ast.AsyncWith | ast.Yield | ast.YieldFrom
    for node in own:
        if isinstance(node, ast.AsyncWith):
            yield node.lineno
        if isinstance(node, ast.Try | ast.TryStar):
            region = [s for h in node.handlers for s in h.body] + node.finalbody
            for stmt in region:
                if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue  # defined there, run elsewhere (and checked alone)
                for sub in (stmt, *own_nodes(stmt)):
                    if isinstance(sub, suspends):
                        yield sub.lineno


def own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """A function's nodes, without those of functions defined inside it (checked alone)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


@pytest.mark.unit
def test_the_hazard_check_finds_both_hazards() -> None:
    assert mypyc_hazards("async def relay(s):\n    async for c in s:\n        yield c\n") == [
        "relay: async generator"
    ]
    reused = (
        "def f():\n    try:\n        g()\n    except KeyError as exc:\n        h(exc)\n"
        "    except OSError as exc:\n        h(exc)\n"
    )
    assert mypyc_hazards(reused) == ["f: except ... as exc binds ['KeyError', 'OSError']"]
    renamed = reused.replace("OSError as exc:\n        h(exc)", "OSError as e:\n        h(e)")
    assert mypyc_hazards(renamed) == []
    assert mypyc_hazards("async def f():\n    def g():\n        yield 1\n    return g\n") == []


TRY = "async def f():\n    try:\n        await g()\n"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("    except OSError:\n        await log()\n        raise\n", 5),
        ("    finally:\n        await close()\n", 5),
        ("    finally:\n        async for _ in drain():\n            pass\n", 5),
        ("    finally:\n        if left:\n            await close()\n", 6),
    ],
    ids=["except", "finally", "async-for", "nested"],
)
def test_the_hazard_check_finds_a_suspension_in_a_handler(source: str, line: int) -> None:
    found = [f"f: suspends while handling an exception (line {line})"]
    assert mypyc_hazards(TRY + source) == found


@pytest.mark.unit
def test_the_hazard_check_finds_a_generator_yielding_in_a_handler() -> None:
    source = "def f():\n    try:\n        g()\n    except OSError:\n        yield None\n"
    assert mypyc_hazards(source) == ["f: suspends while handling an exception (line 5)"]


@pytest.mark.unit
def test_the_hazard_check_passes_what_does_not_suspend_in_a_handler() -> None:
    assert mypyc_hazards("async def f():\n    async with g():\n        pass\n") == [
        "f: suspends while handling an exception (line 2)"
    ]
    # The way the compiled modules do it: keep the exception, await after the handler.
    kept = (
        TRY + "    except BaseException as exc:\n        failure = exc\n"
        "    await close()\n    raise failure\n"
    )
    assert mypyc_hazards(kept) == []
    # A handler that defines a coroutine does not suspend in it.
    defines = TRY + "    finally:\n        async def later():\n            await close()\n"
    assert mypyc_hazards(defines) == []


@pytest.mark.unit
@pytest.mark.parametrize("module", COMPILED_MODULES)
def test_compiled_modules_avoid_what_mypyc_gets_wrong(module: str) -> None:
    assert mypyc_hazards(module_path(module).read_text()) == []
