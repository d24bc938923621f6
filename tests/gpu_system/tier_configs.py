"""The model YAML and drop-ins the GPU system tier writes
(test_cuda_units.py), importable without CUDA or a container:
tests/unit/test_gpu_configs.py runs them through the checks an engine would
make at start (BuiltinBackend.start_refusals) on the CPU machine, against
the checkpoint shape the tier uses (SIZE), so that the tier's config cannot
be wrong without CI failing.
"""

from __future__ import annotations

#: `hostd make-checkpoint --size SIZE` on a GPU (packaging/run-gpu-tier.sh);
#: the tiny one where the tier debugs its harness on CPU.
SIZE = {"cuda": "7b", "cpu": "tiny"}


def model_yaml(model_dir: str, device: str, port: int, gpus: tuple[int, ...] = (0,)) -> str:
    """/etc/hostd/models/qwen.yaml: the builtin backend on MODEL_DIR. The
    batched engine's default KV budget (unset kv_cache_mib: every one of the
    8 requests at the checkpoint's 32768 positions, capped at a fifth of the
    GPU) leaves room for a second engine beside it (overlap, standby)."""
    gpus_line = f"gpus: {list(gpus)}\n" if device == "cuda" else ""
    return (f"backend: builtin\nmodel: {model_dir}\ndevice: {device}\n{gpus_line}"
            f"listen: 127.0.0.1:{port}\nengine:\n  max_num_seqs: 8\n"
            "timeouts: {start: 900, stop: 120}\n")


#: qwen.d/30-standby.yaml (test_the_warm_standby_...): a warm standby engine
#: beside the main one (a fixed key: applied by a restart of the model).
STANDBY_DROPIN = "standby: true\n"


#: qwen.d/35-spare.yaml (test_the_pre_imported_spare_...): the engine's
#: starts forked from a pre-imported spare (a fixed key).
SPARE_DROPIN = "spare: true\n"


#: The strategy the tier's model runs under unless a test asks for another:
#: overlap, which runs the standby strategy while the standby answers (the
#: default, in-place, has a test of its own: test_an_in_place_reload_...).
TIER_STRATEGY = "overlap"


def strategy_dropin(name: str) -> str:
    """qwen.d/40-strategy.yaml: the reload strategy a test asks for."""
    return f"reload:\n  strategy: {name}\n"


#: Every file the tier writes for model qwen, by its path under models/
#: (tests/unit/test_gpu_configs.py loads them together).
def files(model_dir: str, device: str, port: int) -> dict[str, str]:
    return {"qwen.yaml": model_yaml(model_dir, device, port), "qwen.d/30-standby.yaml": STANDBY_DROPIN,
            "qwen.d/35-spare.yaml": SPARE_DROPIN,
            "qwen.d/40-strategy.yaml": strategy_dropin(TIER_STRATEGY)}


#: test_two_gpus.py (issue 39): two models pinned apart, and one across both
#: GPUs, each on the 7B checkpoint: model name -> its `gpus:`.
TWO_GPU_MODELS = {"left": (0,), "right": (1,), "split": (0, 1)}


def two_gpu_files(model_dir: str, ports: dict[str, int]) -> dict[str, str]:
    """/etc/hostd/models/NAME.yaml of each TWO_GPU_MODELS model, on PORTS[NAME]."""
    return {f"{name}.yaml": model_yaml(model_dir, "cuda", ports[name], gpus)
            for name, gpus in TWO_GPU_MODELS.items()}
