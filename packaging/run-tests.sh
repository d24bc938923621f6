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
if [ "$#" -gt 0 ] || [ "${HOSTD_TEST_LANES:-2}" = 1 ]; then
    exec .venv/bin/python -m pytest tests --durations=25 "$@"
fi
# Three lanes at once (issue 54). Much of the suite waits (a container's
# boot, systemd, an engine's start in another process), and the rest is
# CPU-bound on one core at a time, so three pytest runs share the two
# cores: real vLLM under systemd with the fresh-container quickstart and
# Ansible's two hosts (the longest system modules); the integration, unit
# and upstream tiers (hostd's processes on this machine); and the rest of
# the system tier. Each lane is a whole pytest run of its own: its own
# containers, ports (tests/system/ports.py holds them per process),
# temporary directories and summary; no module is in two lanes, and none
# writes what another lane reads (the upstream environments and the real
# model's cache are built before, or by the integration lane alone). The
# system modules import tests/system/conftest.py by name, so a lane's
# system modules come last on its command line (pytest imports the
# conftest.py of each argument at its start, the last one wins the name).
# HOSTD_TEST_LANES=1 runs the one pytest of before.
lanes=(
    "tests/system/test_real_vllm.py tests/system/test_quickstart.py tests/system/test_ansible.py"
    "tests/integration tests/unit tests/upstream"
)
ignores=()
for lane in "${lanes[@]}"; do
    for path in $lane; do ignores+=("--ignore=$path"); done
done
pids=() logs=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for lane in "${lanes[@]}"; do
    log=$(mktemp)
    # shellcheck disable=SC2086  # a lane is a list of paths
    .venv/bin/python -m pytest $lane --durations=10 > "$log" 2>&1 &
    pids+=("$!") logs+=("$log")
done
statuses=()
status=0
.venv/bin/python -m pytest tests "${ignores[@]}" --durations=25 || status=$?
statuses+=("the rest of the system tier $status")
for i in "${!lanes[@]}"; do
    lane_status=0
    wait "${pids[$i]}" || lane_status=$?
    echo "=================== lane: ${lanes[$i]} (exit status $lane_status) ==================="
    cat "${logs[$i]}"
    rm -f "${logs[$i]}"
    statuses+=("${lanes[$i]%% *}... $lane_status")
    [ "$lane_status" -eq 0 ] || status=$lane_status
done
trap - EXIT
echo "run-tests: exit status by lane: $(IFS=';'; echo "${statuses[*]}"); $(( $(date +%s) - HOSTD_RUN_STARTED )) s since the run started"
exit "$status"
