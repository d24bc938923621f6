"""TEST DOUBLE helpers for the SGLang double: exists only to test hostd's orchestration."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/doubles: double_http
import double_http  # noqa: E402

SOCKET_TEMPLATE = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"
READY_TEMPLATE = "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"


def template(name: str, default: str) -> str:
    value = os.environ.get(name, default)
    if "{device_uuid}" not in value:
        sys.exit(f"ValueError: {name}={value!r} must contain {{device_uuid}}")
    return value


def paths_for(uuid: str) -> tuple[Path, Path]:
    sock = template(SOCKET_TEMPLATE, "/tmp/sglang_weight_cache_{device_uuid}.sock")
    ready = template(READY_TEMPLATE, "/tmp/sglang_weight_cache_{device_uuid}.ready")
    return Path(sock.format(device_uuid=uuid)), Path(ready.format(device_uuid=uuid))


def layout(parser: argparse.ArgumentParser) -> None:
    """The ServerArgs hostd passes to both the daemon and the server."""
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--quantization")


__all__ = ["double_http", "layout", "paths_for"]
