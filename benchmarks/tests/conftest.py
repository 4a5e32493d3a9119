"""The PostgreSQL fixtures the benchmarks' tests share with the product's (tests/support):
a fixture is seen only below the conftest.py that names it, and this folder is not below
tests/. The session's hooks are both folders' (tests/support/session.py), so that
`pytest benchmarks/tests` alone runs with them too."""

from tests.support.postgres import postgres_server, store_settings

pytest_plugins = ("tests.support.session",)

__all__ = ["postgres_server", "store_settings"]
