#!/bin/sh
# Once, on node A, as root, after PostgreSQL and Redis are up (docs/deployment.md).
set -eu
cd /etc/saltgate
(umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > master.key)
# The EHBP key, made here: /etc/saltgate is read-only to the running gateway, and every
# node serves the same key (clients pin it).
(umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > hpke.key)
chown saltgate master.key hpke.key
saltgate serve --check --config /etc/saltgate/gateway.toml
saltgate tenants create acme --config /etc/saltgate/gateway.toml
saltgate keys create acme --config /etc/saltgate/gateway.toml
