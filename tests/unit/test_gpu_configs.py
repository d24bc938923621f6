"""Every model config the GPU tiers write (tests/gpu's cuda_configs and
tests/gpu_system's tier_configs, imported, not copied) passes the checks an
engine makes at start from the config alone (BuiltinBackend.start_refusals,
hostd/engine/rules.py), against the checkpoint shape each tier uses: its
config.json only, no weights. A GPU test's config cannot be wrong without CI
failing (issue 31: two of tests/gpu's three failed on the H200 with a KV
budget of 128 MiB under 32768 positions, which nothing on CPU noticed).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from hostd import backends, config, host_check
from hostd.checkpoints import random_model
from tests.gpu import cuda_configs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu_system"))
import tier_configs  # noqa: E402


def config_json(directory: Path, shape: dict) -> Path:
    """A checkpoint directory with only the config.json of SHAPE (a random_model.SIZES entry)."""
    directory.mkdir(parents=True, exist_ok=True)
    fields = {k: v for k, v in shape.items() if k != "vocab_size"}
    (directory / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": "bfloat16",
         "vocab_size": shape["vocab_size"] or 512, **fields}))
    return directory


def start_refusals(root: Path, name: str) -> list[str]:
    cfg = config.load_model(name, root).config
    return backends.for_config(cfg).start_refusals(cfg)


@pytest.mark.parametrize("builder", sorted(cuda_configs.ALL))
def test_each_tests_gpu_config_passes_the_engines_start_checks(tmp_path: Path, builder: str):
    checkpoint = config_json(tmp_path / "ckpt", cuda_configs.GPU_SHAPE)
    kwargs = cuda_configs.ALL[builder](**({} if builder == "restarts" else {"port": 8123}))
    fixed = kwargs.pop("fixed", {})
    data = {"backend": "builtin", "model": str(checkpoint), "device": kwargs.pop("device"), **fixed}
    if kwargs:
        data["engine"] = kwargs
    root = tmp_path / "etc"
    (root / "models").mkdir(parents=True)
    (root / "models" / "gpu.yaml").write_text(yaml.safe_dump(data))
    assert start_refusals(root, "gpu") == []


def test_the_gpu_system_tiers_files_pass_the_engines_start_checks(tmp_path: Path):
    checkpoint = config_json(tmp_path / "qwen", random_model.SIZES[tier_configs.SIZE["cuda"]])
    root = tmp_path / "etc"
    for relative, text in tier_configs.files(str(checkpoint), "cuda", 8124).items():
        path = root / "models" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert host_check.check(root, ["qwen"]) == []
    assert start_refusals(root, "qwen") == []


def test_the_check_refuses_what_the_h200_refused_a_small_kv_budget_under_all_positions(tmp_path: Path):
    """The configs of 58e553e: kv_cache_mib 128 with max_model_len left at the
    checkpoint's 32768 positions; the engine's own words, numbers included."""
    checkpoint = config_json(tmp_path / "ckpt", cuda_configs.GPU_SHAPE)
    root = tmp_path / "etc"
    (root / "models").mkdir(parents=True)
    (root / "models" / "gpu.yaml").write_text(yaml.safe_dump(
        {"backend": "builtin", "model": str(checkpoint), "device": "cuda", "engine": {"kv_cache_mib": 128}}))
    [problem] = start_refusals(root, "gpu")
    assert problem.startswith("engine.kv_cache_mib: the KV budget of 134217728 bytes holds 5376 tokens "
                              "(24576 bytes each), fewer than one request of max_model_len=32768"), problem


def test_the_two_gpu_tiers_files_pass_the_engines_start_checks(tmp_path: Path):
    """tests/gpu_system/test_two_gpus.py's models (issue 39; not yet run on hardware)."""
    checkpoint = config_json(tmp_path / "qwen", random_model.SIZES[tier_configs.SIZE["cuda"]])
    root = tmp_path / "etc"
    ports = {name: 8130 + i for i, name in enumerate(tier_configs.TWO_GPU_MODELS)}
    for relative, text in tier_configs.two_gpu_files(str(checkpoint), ports).items():
        path = root / "models" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    names = sorted(tier_configs.TWO_GPU_MODELS)
    assert host_check.check(root, names) == []
    for name in names:
        assert start_refusals(root, name) == []
        assert list(config.load_model(name, root).config.gpus) == list(tier_configs.TWO_GPU_MODELS[name])
