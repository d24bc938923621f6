"""Fixtures for the real-upstream tier (see upstream_envs.py): the vLLM and
SGLang environments packaging/setup-upstream.sh installs; missing ones skip
outside CI and fail in CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from upstream_envs import SGLANG_ENV, VLLM_ENV, require  # noqa: E402


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    return require(VLLM_ENV)


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    return require(SGLANG_ENV)
