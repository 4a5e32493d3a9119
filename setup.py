"""The build: pure Python by default; SALTGATE_BUILD=compiled compiles the request path.

pyproject.toml holds the metadata. With SALTGATE_BUILD=compiled (`make install-compiled`)
the modules listed in src/saltgate/buildinfo.py are compiled with mypyc into C
extensions; every .py file still ships, so the wheel runs the same source either way.
When compiling fails (no C compiler, no Python headers, mypyc missing) the wheel is built
pure Python instead, the build log says why, and so does `saltgate --version` (the reason
is kept in saltgate/_build.json).

Only a wheel can be compiled: an editable install would put the extensions in src/, where
they would shadow every later edit of the .py files they came from. It is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.dist import Distribution
from setuptools.extension import Extension

ROOT = Path(__file__).resolve().parent
PACKAGE = ROOT / "src" / "saltgate"
WANTED = os.environ.get("SALTGATE_BUILD", "pure")
if WANTED not in ("pure", "compiled"):
    sys.exit(f"SALTGATE_BUILD must be 'pure' or 'compiled', not {WANTED!r}")
COMPILE = WANTED == "compiled"


def compiled_modules() -> list[str]:
    """COMPILED_MODULES from buildinfo.py, read without importing the package."""
    namespace: dict[str, object] = {"__name__": "saltgate_buildinfo"}
    exec((PACKAGE / "buildinfo.py").read_text(), namespace)  # noqa: S102 - our own file
    modules = namespace["COMPILED_MODULES"]
    assert isinstance(modules, tuple)
    return [str(m) for m in modules]


def check_compiler() -> None:
    """Compile a file that includes Python.h, so a missing compiler or missing headers
    fail in a second, before mypyc spends most of a minute translating."""
    from distutils.ccompiler import new_compiler  # noqa: PLC0415 - setuptools' copy
    from distutils.sysconfig import customize_compiler, get_python_inc  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="saltgate-cc-") as scratch:
        probe = Path(scratch, "probe.c")
        probe.write_text("#include <Python.h>\nint saltgate_probe(void) { return 0; }\n")
        compiler = new_compiler()
        customize_compiler(compiler)
        compiler.compile([str(probe)], output_dir=scratch, include_dirs=[get_python_inc()])


def mypyc_extensions() -> list[Extension]:
    """Type-check and translate the modules to C (build/mypyc); the C compiler runs later."""
    from mypyc.build import mypycify  # noqa: PLC0415 - only a compiled build needs mypyc

    paths = [str(Path("src", *m.split(".")).with_suffix(".py")) for m in compiled_modules()]
    return mypycify(paths, opt_level="3", target_dir="build/mypyc")


class Build(Distribution):
    def has_ext_modules(self) -> bool:
        """A compiled build is platform-specific even before its extensions exist."""
        return COMPILE or super().has_ext_modules()


class CleanBuild(build):
    """Start from an empty build/lib: setuptools never removes what an earlier build left
    there (a module since deleted, the extension of one no longer compiled), and the
    wheel takes all of it."""

    def run(self) -> None:
        shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()


class BuildCompiled(build_ext):
    """Compile with mypyc; on failure leave the pure modules and record why."""

    fallback_reason: str | None = None

    def finalize_options(self) -> None:
        """mypyc runs here, not when setup.py is read: only a build that builds extensions
        pays for it (reading the metadata runs setup.py too)."""
        if COMPILE:
            if self.inplace or self.editable_mode:
                sys.exit(
                    "saltgate: SALTGATE_BUILD=compiled builds a wheel only (make "
                    "install-compiled): compiled modules in src/ would shadow later edits"
                )
            try:
                check_compiler()
                self.distribution.ext_modules = mypyc_extensions()
            except (Exception, SystemExit) as exc:  # mypyc exits on type errors
                self._fall_back(exc)
        super().finalize_options()

    def run(self) -> None:
        if not COMPILE:
            super().run()
            return
        if self.fallback_reason is None:
            try:
                super().run()
            except (Exception, SystemExit) as exc:  # no compiler, no headers
                self._fall_back(exc)
                self._remove_partial_output()
        record = {"requested": "compiled", "built": "compiled"}
        if self.fallback_reason is not None:
            record["built"] = "pure Python"
            record["fallback_reason"] = self.fallback_reason
        (Path(self.build_lib) / "saltgate" / "_build.json").write_text(json.dumps(record) + "\n")

    def _fall_back(self, exc: BaseException) -> None:
        lines = f"{exc.__class__.__name__}: {exc}".strip().splitlines()
        self.fallback_reason = lines[0][:300]
        print(f"\nsaltgate: WARNING: compiling failed, building pure Python: {lines[0]}\n")
        self.distribution.ext_modules = []

    def _remove_partial_output(self) -> None:
        """Extensions a failed build left behind would make a mixed, broken install."""
        for path in Path(self.build_lib).rglob("*"):
            if path.suffix in (".so", ".pyd") and path.is_file():
                path.unlink()
        shutil.rmtree(self.build_temp, ignore_errors=True)


setup(distclass=Build, cmdclass={"build": CleanBuild, "build_ext": BuildCompiled})
