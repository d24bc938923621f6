"""Fixtures for integration tests: real hostd processes, run by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# processes.py is importable whatever pytest's --import-mode is.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostd.checkpoints.random_model import write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint (tied embeddings, real BPE tokenizer with a
    chat template), written once per session; copy it before changing it."""
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")
