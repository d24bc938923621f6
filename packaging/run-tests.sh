#!/usr/bin/env bash
# The README's test command; .ci/run runs exactly this. Installs what the tests
# need (packaging/setup.sh, and the real vLLM and SGLang of the upstream tier:
# packaging/setup-upstream.sh, reused once built), then runs every tier: unit,
# integration, upstream (real vLLM/SGLang parsers), system (a real systemd in
# systemd-nspawn containers, real vLLM included), gpu and gpu_system (both skip
# without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite's time guard (tests/conftest.py) counts the whole run, setup included.
export HOSTD_RUN_STARTED=${HOSTD_RUN_STARTED:-$(date +%s)}
# The upstream environments (minutes of downloads on a fresh machine) build
# beside setup.sh's apt and pip, where this python3 can make a venv without
# the apt package setup.sh would add for it; their output comes after.
python=${PYTHON:-python3}
if "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    upstream_log=$(mktemp)
    bash packaging/setup-upstream.sh > "$upstream_log" 2>&1 &
    upstream=$!
    trap 'kill "$upstream" 2>/dev/null || true' EXIT
    bash packaging/setup.sh
    status=0
    wait "$upstream" || status=$?
    trap - EXIT
    cat "$upstream_log"
    rm -f "$upstream_log"
    [ "$status" -eq 0 ] || { echo "run-tests: packaging/setup-upstream.sh failed (exit status $status)" >&2; exit "$status"; }
else
    bash packaging/setup.sh
    bash packaging/setup-upstream.sh
fi
# In CI the system modules run last-first, so that none leans on what an
# earlier one left (tests/system/conftest.py); by hand, in file order.
if [ "${CI:-}" = "true" ]; then
    export HOSTD_SYSTEM_ORDER=${HOSTD_SYSTEM_ORDER:-reversed}
fi
# --durations: the slowest tests of the run, in its report (issue 54: where the time goes).
exec .venv/bin/python -m pytest tests --durations=25 "$@"
