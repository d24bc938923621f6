"""Where the real-upstream tier finds vLLM and SGLang: vLLM and SGLang as released, installed
by packaging/setup-upstream.sh into virtual environments outside the checkout
($HOSTD_UPSTREAM_ROOT, default /var/cache/hostd-tests).

Missing environments skip the tier outside CI and fail it in CI (CI=true),
where the README's test command installs them first.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.upstream_envs import ROOT, SGLANG_ENV, SGLANG_VERSION, VLLM_ENV, VLLM_VERSION  # noqa: F401

HERE = Path(__file__).resolve().parent


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(env: Path) -> Path:
    """ENV's directory when it is completely installed; else skip (fail in CI)."""
    if (env / ".complete").exists():
        return env
    problem = f"{env} is not installed: run `bash packaging/setup-upstream.sh`"
    if in_ci():
        pytest.fail(f"CI=true, so the real-upstream tier must run, but {problem}", pytrace=False)
    pytest.skip(problem)


def run_parser(python: Path, script: str, requests: list) -> list[dict]:
    """Give REQUESTS to upstream's own parser (tests/upstream/SCRIPT run by
    the upstream environment's PYTHON); one answer per request."""
    result = subprocess.run(
        [str(python), str(HERE / script)], input=json.dumps(requests), capture_output=True, text=True,
        timeout=900, cwd="/", env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads(result.stdout)
    assert len(answers) == len(requests)
    return answers


def flags_fixture(name: str) -> dict:
    return json.loads((HERE / "flags" / f"{name}.json").read_text())
