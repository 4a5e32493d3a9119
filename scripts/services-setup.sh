#!/usr/bin/env bash
# Install the servers the store and fleet tests start for themselves, idempotently:
#   - PostgreSQL 15 (initdb, pg_ctl, postgres in /usr/lib/postgresql/15/bin), Redis 7 and
#     HAProxy from Debian/Ubuntu packages; no system service of theirs is started;
#   - systemd-analyze (package systemd), which checks packaging/saltgate.service in
#     tests/dist; the package is installed, no systemd is started;
#   - promtool (package prometheus), which checks the shipped alert rules
#     (packaging/prometheus/) in tests/gateway/test_observability.py; no Prometheus is started;
#   - Chromium (package chromium, /usr/bin/chromium), which the console's browser tests
#     (tests/console) drive through the playwright package; playwright downloads no browser;
#   - when run as root, the unprivileged system user PostgreSQL runs as in the tests
#     (PostgreSQL refuses to run as root): $SALTGATE_PG_USER, default saltgate-pg.
# The tests start their own servers in temporary directories on free loopback ports and
# stop them (devkit/src/saltgate_devkit/services.py); nothing here listens on a port.
# Usage: scripts/services-setup.sh          (`make test` runs it)
set -euo pipefail

PG_MAJOR="${PG_MAJOR:-15}"
PG_BINDIR="/usr/lib/postgresql/$PG_MAJOR/bin"
PG_USER="${SALTGATE_PG_USER:-saltgate-pg}"
REDIS_MIN_MAJOR=7

have_postgres() { [ -x "$PG_BINDIR/initdb" ] && [ -x "$PG_BINDIR/pg_ctl" ] && [ -x "$PG_BINDIR/postgres" ]; }
redis_major() { redis-server --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\..*/\1/p'; }
have_redis() { command -v redis-server >/dev/null 2>&1 && [ "$(redis_major)" -ge "$REDIS_MIN_MAJOR" ] 2>/dev/null; }
have_haproxy() { command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; }
have_systemd_analyze() { command -v systemd-analyze >/dev/null 2>&1; }
have_promtool() { command -v promtool >/dev/null 2>&1; }
have_chromium() { [ -x /usr/bin/chromium ]; }
# kubectl renders packaging/kubernetes/base (tests/dist/test_kubernetes.py): any kubectl
# with `kustomize`, else Debian's kubernetes-client.
have_kubectl() { command -v kubectl >/dev/null 2>&1; }

need_apt=()
have_postgres || need_apt+=("postgresql-$PG_MAJOR")
have_redis || need_apt+=(redis-server)
have_haproxy || need_apt+=(haproxy)
have_systemd_analyze || need_apt+=(systemd)
have_promtool || need_apt+=(prometheus)
have_chromium || need_apt+=(chromium)
have_kubectl || need_apt+=(kubernetes-client)

if [ "${#need_apt[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "services-setup: missing ${need_apt[*]} and no apt-get; install them by hand" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "services-setup: need root or sudo for apt-get install ${need_apt[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    # The packages would start system services (PostgreSQL on 5432, Redis on 6379, HAProxy,
    # Prometheus on 9090):
    # the tests do not use them, so a policy-rc.d that refuses service starts stays in place
    # for the install (unless the machine already has one, as containers often do).
    policy=/usr/sbin/policy-rc.d
    added_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$policy" >/dev/null
        $SUDO chmod 755 "$policy"
        added_policy=1
    fi
    cleanup() { if [ "$added_policy" -eq 1 ]; then $SUDO rm -f "$policy"; fi; }
    trap cleanup EXIT
    echo "services-setup: apt-get install ${need_apt[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
    cleanup
    trap - EXIT
else
    echo "services-setup: PostgreSQL $PG_MAJOR, Redis $REDIS_MIN_MAJOR+, HAProxy, systemd-analyze, promtool and Chromium already installed"
fi

if [ "$(id -u)" -eq 0 ] && ! id -u "$PG_USER" >/dev/null 2>&1; then
    echo "services-setup: creating system user $PG_USER (PostgreSQL refuses to run as root)"
    useradd --system --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin "$PG_USER"
fi

missing=()
have_postgres || missing+=("PostgreSQL $PG_MAJOR ($PG_BINDIR/initdb, pg_ctl, postgres)")
have_redis || missing+=("Redis >= $REDIS_MIN_MAJOR (redis-server)")
have_haproxy || missing+=("HAProxy (haproxy)")
have_systemd_analyze || missing+=("systemd-analyze (package systemd)")
have_promtool || missing+=("promtool (package prometheus)")
have_chromium || missing+=("Chromium (package chromium, /usr/bin/chromium)")
if [ "$(id -u)" -eq 0 ]; then
    id -u "$PG_USER" >/dev/null 2>&1 || missing+=("the system user $PG_USER")
    command -v runuser >/dev/null 2>&1 || missing+=("runuser (util-linux)")
fi
if [ "${#missing[@]}" -gt 0 ]; then
    printf 'services-setup: still missing after install: %s\n' "${missing[@]}" >&2
    exit 1
fi
echo "services-setup: ready: $("$PG_BINDIR/postgres" --version), $(redis-server --version | cut -d' ' -f1-3), $(haproxy -v 2>/dev/null | head -1 | cut -d' ' -f1-3)"
