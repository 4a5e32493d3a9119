"""Which saltgate the tests import, and whether it is the source in this checkout.

The compiled build is installed as a wheel (`make install-compiled`), so it is a copy of
src/: edit a .py file afterwards and the tests would run the old code. tests/conftest.py
refuses to start then, instead of testing something other than the source.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import saltgate

SOURCE_PACKAGE = Path(__file__).resolve().parents[2] / "src" / "saltgate"
INSTALLED_PACKAGE = Path(saltgate.__file__).resolve().parent


def python_sources_digest(package: Path) -> str:
    """SHA-256 over a package's .py files, paths and contents, in a stable order."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def stale_install() -> str | None:
    """Why the installed saltgate is not this checkout's source, or None if it is."""
    if INSTALLED_PACKAGE == SOURCE_PACKAGE:  # editable: the source itself
        return None
    if python_sources_digest(INSTALLED_PACKAGE) == python_sources_digest(SOURCE_PACKAGE):
        return None
    return (
        f"the saltgate installed in {INSTALLED_PACKAGE.parent} was built from other sources "
        "than src/ holds now (edited since `make install-compiled`?): run `make "
        "install-compiled` again, or `make install` for the editable pure-Python build"
    )
