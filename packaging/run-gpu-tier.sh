#!/usr/bin/env bash
# The GPU system tier (tests/gpu_system) on the GPU machine, in two commands,
# one part each (each within 480 s on the H200; tests/gpu_system/README.md):
#
#   bash packaging/run-gpu-tier.sh 1 [pytest arguments]
#   bash packaging/run-gpu-tier.sh 2 [pytest arguments]
#
# `all` runs both parts in one pytest (past the 600 s a device-tool call may
# run); no part at all is the same as `all`, for pytest arguments that pick
# the tests themselves (-k).
# On that machine (no systemd, no network; the image's python3 with torch):
# installs the carried wheels (.gpu/wheels, from packaging/fetch-gpu-tier.sh)
# and hostd itself from this checkout into that python3, writes the random
# Qwen2.5-7B-shaped checkpoint (`hostd make-checkpoint --size 7b`; one an
# earlier command on the same machine finished is reused) while the
# container boots, prepares what systemd-nspawn needs of the host, and runs
# the tier, which unpacks .gpu/debs, boots Debian 12's systemd 252 and drives
# hostd there. Results (results.json, journal.txt, pytest.log) go to
# $OUT (the device tool's folder) or /var/tmp/hostd-gpu-tier/results.
set -uo pipefail
cd "$(dirname "$0")/.."
part=all
case "${1:-}" in
    1|2) part=$1; shift ;;
    all) shift ;;
esac
py=${PYTHON:-python3}
out=${OUT:-/var/tmp/hostd-gpu-tier/results}
checkpoints=/var/tmp/hostd-gpu-tier/checkpoints
mkdir -p "$out" "$checkpoints"
start=$SECONDS
say() { echo "[run-gpu-tier +$((SECONDS - start))s] $*"; }

[ -d .gpu/debs ] && [ -d .gpu/wheels ] || { echo ".gpu/ is missing: run packaging/fetch-gpu-tier.sh on the CPU machine and carry .gpu" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'

# hostd from this checkout, as a package (not editable: the units then run
# nothing from the checkout, wherever the device tool put it). A bare machine,
# given back after the run: installing into the image's python3 is harmless.
$py -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check .gpu/wheels/*.whl . \
    > "$out/pip.log" 2>&1 || { tail -20 "$out/pip.log"; exit 2; }
# The project's own specifiers, met by what is installed now (one line per
# problem, before anything boots: not a TypeError in the engine's journal).
$py packaging/check-requirements.py --extra builtin --extra test || exit 2
$py -c 'import hostd.main, msgspec, dbus_fast, sdnotify, openai, pynvml, torch; print("python:", torch.__version__, "cuda", torch.cuda.is_available())' || exit 2
say "installed hostd and the wheels"

# The checkpoints beside the boot (the tier waits for NAME.done): qwen, and
# qwen-v2 (another seed) for the checkpoint swap's test; one a previous
# command on this machine finished (NAME.done) is used as it is.
: > "$out/checkpoint.log"
for name_seed in qwen:0 qwen-v2:2; do
    name=${name_seed%:*} seed=${name_seed#*:}
    if [ -e "$checkpoints/$name.done" ]; then
        echo "checkpoint reused: $checkpoints/$name" >> "$out/checkpoint.log"
    else
        ( t=$SECONDS; $py -m hostd.main make-checkpoint --size 7b --seed "$seed" "$checkpoints/$name" >> "$out/checkpoint.log" 2>&1 \
            && touch "$checkpoints/$name.done" && echo "checkpoint $name written in $((SECONDS - t)) s" >> "$out/checkpoint.log" ) &
    fi
done

# What systemd-nspawn needs of a host without systemd (issue 23's probe).
[ -s /etc/machine-id ] || tr -d - < /proc/sys/kernel/random/uuid > /etc/machine-id
mkdir -p /run/systemd/nspawn
mountpoint -q /run/systemd/nspawn || mount -t tmpfs tmpfs /run/systemd/nspawn

say "running tests/gpu_system, part $part"
# Within the device tool's 10 minutes a command: at the limit pytest gets
# SIGINT, so its fixtures still stop the container and write the journal.
# 560 + the 30 s kill grace stays under the 600 s a call may run; each part
# is meant to end by 480 s (the README's measured times), so the limit is
# only a safety net.
limit=${HOSTD_GPU_TIER_LIMIT:-$((560 - (SECONDS - start)))}
[ "$part" = all ] && tier_part= || tier_part=$part
HOSTD_GPU_TIER_PART=$tier_part HOSTD_GPU_TIER_RESULTS=$out HOSTD_GPU_TIER_CHECKPOINTS=$checkpoints PYTHONUNBUFFERED=1 \
    timeout -s INT -k 30 "$limit" $py -m pytest tests/gpu_system -v -rA -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
wait
cat "$out/checkpoint.log" | tail -4
say "done, pytest exit status $rc"
exit "$rc"
