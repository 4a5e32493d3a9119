"""Persistent state: tenants and hashed API keys, the usage ledger, and usage reports.

Two backends behind one set of operations (docs/store.md): one SQLite file
(``state_dir/saltgate.db``, WAL: the embedded default, shared by the CLI and a gateway
across processes without a server), or PostgreSQL, shared by a fleet of gateways.

A docstring only: importing the package loads nothing, so the configuration parser can
read `store.settings` (pure) without the database libraries the other modules load
(`backends` opens a store; psycopg is imported only when PostgreSQL is configured).
"""
