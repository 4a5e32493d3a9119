#!/usr/bin/env bash
# Install what `saltgate-bench overhead` (and `replay`) needs, idempotently:
#   - nginx, wrk, taskset (util-linux) from Debian/Ubuntu packages;
#   - the peer routers and py-spy into a separate venv outside git (.bench/venv),
#     so they never mix with the project's own locked dependencies in .venv.
# Usage: scripts/bench-setup.sh            (from the repository root or anywhere)
#        BENCH_VENV=/path/to/venv scripts/bench-setup.sh
# Versions are pinned to what docs/benchmarks.md reports; override with the variables below.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BENCH_VENV="${BENCH_VENV:-$ROOT/.bench/venv}"
PYTHON="${PYTHON:-python3}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
PY_SPY_VERSION="${PY_SPY_VERSION:-0.4.3}"

need_apt=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need_apt+=(nginx)
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
command -v taskset >/dev/null 2>&1 || need_apt+=(util-linux)
if [ "${#need_apt[@]}" -gt 0 ]; then
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "bench-setup: missing ${need_apt[*]} and no apt-get; install them by hand" >&2
        exit 1
    fi
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "bench-setup: need root or sudo for apt-get" >&2; exit 1; }
        SUDO="sudo"
    fi
    echo "bench-setup: apt-get install ${need_apt[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
else
    echo "bench-setup: nginx, wrk, taskset already installed"
fi
# The packaged nginx may have started a system service on port 80; the benchmark does not
# use it (it runs its own nginx with a generated config on loopback ports).

if [ ! -x "$BENCH_VENV/bin/python" ]; then
    echo "bench-setup: creating $BENCH_VENV"
    "$PYTHON" -m venv "$BENCH_VENV"
fi
want=(
    "sglang-router==$SGLANG_ROUTER_VERSION"
    "vllm-router==$VLLM_ROUTER_VERSION"
    "py-spy==$PY_SPY_VERSION"
)
if "$BENCH_VENV/bin/python" - "${want[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, _, pinned = spec.partition("==")
    try:
        if version(name) != pinned:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
    echo "bench-setup: ${want[*]} already in $BENCH_VENV"
else
    echo "bench-setup: pip install ${want[*]} into $BENCH_VENV"
    "$BENCH_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${want[@]}"
fi

missing=0
for tool in smg vllm-router py-spy; do
    if [ ! -x "$BENCH_VENV/bin/$tool" ]; then
        echo "bench-setup: $tool not found in $BENCH_VENV/bin after install" >&2
        missing=1
    fi
done
[ "$missing" -eq 0 ] || exit 1
echo "bench-setup: ready; run: .venv/bin/saltgate-bench overhead --help"
