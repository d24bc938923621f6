#!/usr/bin/env bash
# Fetch, on a Debian 12 machine with network (the CPU machine), what the GPU
# system tier needs on a GPU machine that has neither systemd nor network:
#
#   .gpu/debs/    Debian 12's systemd 252, systemd-nspawn and dbus-daemon
#                 (apt-get download: the packages only, nothing is installed)
#   .gpu/wheels/  the Python packages hostd and its tests need that the GPU
#                 machine's image lacks (CPython 3.12, manylinux x86_64)
#
# .gpu/ is ignored by git (.gitignore) and travels with the checkout to the GPU
# machine, where packaging/run-gpu-tier.sh uses it (tests/gpu_system/README.md).
# Idempotent: what is already there is not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.gpu
mkdir -p "$out/debs" "$out/wheels"

# The probe of issue 23: systemd 252 boots from exactly these inside
# systemd-nspawn on the GPU machine (Ubuntu 24.04, no systemd).
debs=(systemd systemd-container libsystemd-shared libip4tc2 libkmod2 libapparmor1
      dbus dbus-bin dbus-daemon dbus-system-bus-common libdbus-1-3)
missing=()
for d in "${debs[@]}"; do
    compgen -G "$out/debs/${d}_*.deb" > /dev/null || missing+=("$d")
done
if ((${#missing[@]})); then
    (cd "$out/debs" && apt-get download "${missing[@]}")
fi

# The GPU image has torch, safetensors, aiohttp, pyyaml, httpx, xxhash,
# prometheus-client, nvidia-ml-py and pytest (.library KINDS.md); not these.
# One version each, the ones the CPU machine's tests run with. Its
# transformers is 5.17, outside pyproject's pin (>=5.24,<5.25: the batched
# engine's internals), so the pinned one travels too
# (tests/unit/test_gpu_tier_carry.py keeps the two in step);
# packaging/check-requirements.py, run there before anything boots, says
# what else would not meet the project's specifiers.
binary=(
    transformers==5.24.0                                                              # the builtin engine
    msgspec==0.23.0 logging-journald==0.6.12 dbus-fast==5.2.0 shtab==1.13.0        # hostd, hostd install
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 pydantic==2.14.4  # the tests' client
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 jiter==0.19.0 sniffio==1.3.1
)
# Published as source only; pure Python, so a wheel built here serves there.
source=(sdnotify==0.3.2 argparse-manpage==4.8)
missing_wheels() {
    local w name
    for w in "$@"; do
        name=${w%%==*}; name=${name//-/_}
        compgen -G "$out/wheels/${name}-*.whl" > /dev/null || echo "$w"
    done
}
mapfile -t todo < <(missing_wheels "${binary[@]}")
if ((${#todo[@]})); then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        -d "$out/wheels" "${todo[@]}"
fi
mapfile -t todo < <(missing_wheels "${source[@]}")
if ((${#todo[@]})); then
    python3 -m pip wheel -q --no-deps -w "$out/wheels" "${todo[@]}"
fi
ls -l "$out/debs" "$out/wheels"
du -sh "$out"
