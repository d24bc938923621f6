"""The model configs tests/gpu/test_cuda_weights.py writes, importable
without CUDA: tests/unit/test_gpu_configs.py runs each through the checks an
engine would make at start (BuiltinBackend.start_refusals), on the CPU
machine, so that a GPU test's config cannot be wrong without CI failing.

Each builder returns harness.local.ModelTree.write_config's keyword arguments
(device, fixed keys, engine keys) for a checkpoint of GPU_SHAPE.
"""

from __future__ import annotations

from hostd.checkpoints import random_model

# Qwen2.5-0.5B's layer shapes with 48 layers instead of 24 and the vocabulary
# of the checkpoint's own small tokenizer (~450 tokens) instead of 151936
# entries: ~1.4 GiB in bf16, large enough that a copy would stand out of NVML's
# noise and of the engine's own CUDA context (~0.8 GiB), and every greedy token
# decodes to text. With the real 0.5b vocabulary nearly every random argmax is
# an id the test tokenizer cannot decode: the text was empty on every start
# (seen on the H200), so comparing it across restarts proved nothing.
GPU_SHAPE = {**random_model.SIZES["0.5b"], "num_hidden_layers": 48, "vocab_size": None}
#: What each builder's engine may hold of KV cache (a second engine's budget
#: beside the first): small against the 1.4 GiB of weights, so that a copy of
#: the weights would show in NVML. 128 MiB holds 5376 tokens of this shape
#: (24 KiB each): max_model_len must stay under that (32768 positions would
#: be refused at start, as the H200 run of 2026-12-01 found).
KV_CACHE_MIB = 128
MAX_MODEL_LEN = 4096


def restarts() -> dict:
    """test_cuda_ipc_restarts_...: the one-request engine (no KV cache of its own)."""
    return {"device": "cuda", "batching": "none"}


def overlap(port: int) -> dict:
    """test_overlap_reload_on_cuda_...: two batched engines on one allocation."""
    return {"device": "cuda", "fixed": {"listen": f"127.0.0.1:{port}"},
            "kv_cache_mib": KV_CACHE_MIB, "max_model_len": MAX_MODEL_LEN}


#: The idle standby's KV budget (reload.standby_kv_mib) in that test: below
#: KV_CACHE_MIB, so that its grow to the full budget is seen; two 256-token
#: blocks of this shape (6 MiB each).
STANDBY_KV_MIB = 16


def standby(port: int) -> dict:
    """test_standby_reload_and_failover_on_cuda_...: main and a warm standby."""
    return {"device": "cuda", "fixed": {"listen": f"127.0.0.1:{port}", "standby": True,
                                        "reload": {"standby_kv_mib": STANDBY_KV_MIB}},
            "kv_cache_mib": KV_CACHE_MIB, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4}


#: Every builder, with an example port: what the unit test checks.
ALL = {"restarts": restarts, "overlap": overlap, "standby": standby}
