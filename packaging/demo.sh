#!/usr/bin/env bash
# The README's main job: install hostd, serve a tiny model under systemd, query
# it with the openai client, reload it with new limits while the weights stay
# resident, show systemctl status and the journal. Where
# systemd is not PID 1 (containers, CI), a throwaway systemd-nspawn container
# stands in for the host (packaging/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/setup.sh
exec .venv/bin/python packaging/demo.py "$@"
