"""TEST DOUBLE helpers for the SGLang double: exists only to test hostd's orchestration."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/doubles: double_http
import double_flags  # noqa: E402
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


VERSION = "0.5.23"


def build_parser(prog: str, which: str) -> argparse.ArgumentParser:
    """SGLang's own flag set (tests/upstream/flags/sglang-VERSION.json) for
    WHICH ('launch_server' or 'weight_cache.daemon'): the double rejects what
    SGLang rejects."""
    parser = argparse.ArgumentParser(prog=prog)
    double_flags.add_flags(parser, double_flags.fixture("sglang", VERSION)["flags"][which])
    return parser


def first(value):
    """An option declared with nargs='+' parses to a list: its first item."""
    return value[0] if isinstance(value, list) else value


__all__ = ["VERSION", "build_parser", "double_http", "first", "paths_for"]
