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
# beside setup.sh's apt and pip and, after it, beside the test lanes that do
# not need them (below); this python3 makes the venv without the apt package
# setup.sh would add for it, or else the build starts once setup.sh is done.
python=${PYTHON:-python3}
upstream_log=$(mktemp)
upstream=
start_upstream() {
    bash packaging/setup-upstream.sh > "$upstream_log" 2>&1 &
    upstream=$!
}
pids=() logs=() rest=
trap 'kill $upstream $rest "${pids[@]}" 2>/dev/null || true' EXIT
if "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    start_upstream
    bash packaging/setup.sh
else
    bash packaging/setup.sh
    start_upstream
fi
# Waits for the upstream environments; a failed build's output is shown at
# once and ends the run, a good one's at the end (not inside a lane's output).
wait_upstream() {
    local status=0
    wait "$upstream" || status=$?
    upstream=  # waited for: the EXIT trap leaves its pid alone
    if [ "$status" -ne 0 ]; then
        cat "$upstream_log"
        echo "run-tests: packaging/setup-upstream.sh failed (exit status $status)" >&2
        exit "$status"
    fi
}
show_upstream_log() {
    cat "$upstream_log"
    rm -f "$upstream_log"
}
# In CI the system modules run last-first, so that none leans on what an
# earlier one left (tests/system/conftest.py); by hand, in file order.
if [ "${CI:-}" = "true" ]; then
    export HOSTD_SYSTEM_ORDER=${HOSTD_SYSTEM_ORDER:-reversed}
fi
# --durations: the slowest tests of the run, in its report (issue 54: where the time goes).
if [ "$#" -gt 0 ] || [ "${HOSTD_TEST_LANES:-2}" = 1 ]; then
    wait_upstream
    show_upstream_log
    trap - EXIT
    exec .venv/bin/python -m pytest tests --durations=25 "$@"
fi
# Lanes at once (issue 54). Much of the suite waits (a container's boot,
# systemd, an engine's start in another process), and the rest is
# CPU-bound on one core at a time, so three pytest runs share the two
# cores: the rest of the system tier (the longest lane, its output shown
# as it runs); the integration and unit tiers (hostd's processes on this
# machine); the fresh-container quickstart and Ansible's two hosts, and
# once those are done and the upstream environments are built, the
# upstream tier and real vLLM under systemd (the only tests that need the
# environments: the first lanes do not wait for their downloads). Each lane
# is a whole pytest run of its own: its own containers, ports
# (tests/system/ports.py holds them per process), temporary directories and
# summary; no module is in two lanes, and none writes what another lane
# reads (the upstream environments and the real model's cache are built
# before, or by the integration lane alone). The system modules import
# tests/system/conftest.py by name, so a lane's system modules come last on
# its command line (pytest imports the conftest.py of each argument at its
# start, the last one wins the name). HOSTD_TEST_LANES=1 runs the one
# pytest of before.
lanes=(
    "tests/integration tests/unit"
    "tests/system/test_quickstart.py tests/system/test_ansible.py"
    "tests/upstream tests/system/test_real_vllm.py"
)
ignores=()
for lane in "${lanes[@]}"; do
    for path in $lane; do ignores+=("--ignore=$path"); done
done
lane_statuses=()
start_lane() {
    local log
    log=$(mktemp)
    # shellcheck disable=SC2086  # a lane is a list of paths
    .venv/bin/python -m pytest $1 --durations=10 > "$log" 2>&1 &
    pids+=("$!") logs+=("$log")
}
wait_lane() {
    local status=0
    wait "${pids[$1]}" || status=$?
    lane_statuses[$1]=$status
}
.venv/bin/python -m pytest tests "${ignores[@]}" --durations=25 &
rest=$!
start_lane "${lanes[0]}"
start_lane "${lanes[1]}"
wait_upstream
wait_lane 1  # the quickstart's lane: the upstream lane runs in its place
start_lane "${lanes[2]}"
statuses=()
status=0
wait "$rest" || status=$?
statuses+=("the rest of the system tier $status")
for i in "${!lanes[@]}"; do
    [ -n "${lane_statuses[$i]:-}" ] || wait_lane "$i"
    lane_status=${lane_statuses[$i]}
    echo "=================== lane: ${lanes[$i]} (exit status $lane_status) ==================="
    cat "${logs[$i]}"
    rm -f "${logs[$i]}"
    statuses+=("${lanes[$i]%% *}... $lane_status")
    [ "$lane_status" -eq 0 ] || status=$lane_status
done
trap - EXIT
show_upstream_log
echo "run-tests: exit status by lane: $(IFS=';'; echo "${statuses[*]}"); $(( $(date +%s) - HOSTD_RUN_STARTED )) s since the run started"
exit "$status"
