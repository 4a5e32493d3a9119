#!/bin/sh
# Once, on node A, as root, after PostgreSQL and Redis are up (docs/deployment.md).
set -eu
cd /etc/saltgate
(umask 077; python3 -c "import secrets; print(secrets.token_hex(32))" > master.key)
chown saltgate master.key
saltgate serve --check --config /etc/saltgate/gateway.toml
saltgate tenants create acme --config /etc/saltgate/gateway.toml
saltgate keys create acme --config /etc/saltgate/gateway.toml
