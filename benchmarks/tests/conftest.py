"""The PostgreSQL fixtures the benchmarks' tests share with the product's (tests/support):
a fixture is seen only below the conftest.py that names it, and this folder is not below
tests/.

The session's hooks (the `unit` mark's guard, the check that the installed saltgate is
this checkout's) are tests/conftest.py's: `make test` and `make check` collect both
folders in one session (pyproject.toml's testpaths).
"""

from tests.support.postgres import postgres_server, store_settings

__all__ = ["postgres_server", "store_settings"]
