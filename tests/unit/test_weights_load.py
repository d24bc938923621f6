"""The weight daemon's one-pass load (hostd/weights/load.py): the bytes it puts
in the shared memfd are the checkpoint's, its digest is the fingerprint's, and
an unchanged checkpoint is not hashed twice."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from hostd.checkpoints.random_model import write_checkpoint
from hostd.weights import checkpoint, fingerprint, load, shared


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("load") / "tiny")


@pytest.fixture
def model_dir(tmp_path: Path, written: Path) -> Path:
    return Path(shutil.copytree(written, tmp_path / "tiny"))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of an odd size far below a tensor's: pieces span chunk edges."""
    monkeypatch.setattr(load, "CHUNK", 4099)


def load_cpu(model_dir: Path, dtype: str, cache_dir=None):
    skeleton = checkpoint.build_skeleton(model_dir, dtype, meta_buffers=False)
    held, digest = load.load(model_dir, skeleton, torch.device("cpu"), label="test", cache_dir=cache_dir)
    block = shared.map_memfd(held.fd, held.storage)
    return {entry.name: shared.tensor_at(block, entry) for entry in held.table}, digest


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_memfd_holds_exactly_what_safetensors_reads(model_dir: Path, dtype: str):
    """bfloat16 is the checkpoint's own dtype (bytes copied as they are);
    float32 converts every tensor on the way."""
    held, _ = load_cpu(model_dir, dtype)
    reference = checkpoint.load_tensors(
        model_dir, checkpoint.build_skeleton(model_dir, dtype, meta_buffers=False), torch.device("cpu")
    )
    assert set(held) == {name for name, *_ in reference}
    for name, _, tensor, _ in reference:
        assert held[name].dtype == tensor.dtype and torch.equal(held[name], tensor), name


def test_digest_is_the_fingerprints_and_a_second_load_hashes_nothing(model_dir: Path, tmp_path: Path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    _, first = load_cpu(model_dir, "bfloat16", cache_dir=state)
    assert first == fingerprint.content_digest(model_dir, cache_dir=None)  # hashed from scratch

    def no_hashing():
        raise AssertionError("hashed a file the digest cache knows")

    monkeypatch.setattr(fingerprint, "new_hasher", no_hashing)
    _, second = load_cpu(model_dir, "bfloat16", cache_dir=state)
    assert second == first
    assert fingerprint.content_digest(model_dir, cache_dir=state) == first  # the engine's side


def test_a_rewritten_checkpoint_is_hashed_again(model_dir: Path, tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir()
    _, before = load_cpu(model_dir, "bfloat16", cache_dir=state)
    write_checkpoint(model_dir, seed=1)  # same names and shapes, other values
    _, after = load_cpu(model_dir, "bfloat16", cache_dir=state)
    assert after != before
    assert after == fingerprint.content_digest(model_dir, cache_dir=None)


def test_a_truncated_shard_is_refused_with_its_name(model_dir: Path):
    shard = model_dir / "model.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* \(truncated\?\)"):
        load_cpu(model_dir, "bfloat16")
