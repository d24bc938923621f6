#!/usr/bin/env bash
# The README's test command; .ci/run runs exactly this. Installs what the tests
# need (packaging/setup.sh, and the real vLLM and SGLang of the upstream tier:
# packaging/setup-upstream.sh, reused once built), then runs every tier: unit,
# integration, upstream (real vLLM/SGLang parsers), system (a real systemd in
# systemd-nspawn containers, real vLLM included), gpu and gpu_system (both skip
# without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash packaging/setup.sh
bash packaging/setup-upstream.sh
# In CI the system modules run last-first, so that none leans on what an
# earlier one left (tests/system/conftest.py); by hand, in file order.
if [ "${CI:-}" = "true" ]; then
    export HOSTD_SYSTEM_ORDER=${HOSTD_SYSTEM_ORDER:-reversed}
fi
exec .venv/bin/python -m pytest tests "$@"
