#!/usr/bin/env bash
# The README's test command; .ci/run runs exactly this. Installs what the tests
# need (packaging/setup.sh), then runs every tier: unit, integration, system
# (a real systemd in systemd-nspawn containers) and gpu (skips without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/setup.sh
exec .venv/bin/python -m pytest tests "$@"
