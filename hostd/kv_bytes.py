"""KV bytes per token: the one rule every backend sizes KV memory by.

``2 * layers * KV heads (on one tensor-parallel rank) * head dim * dtype
bytes`` from the checkpoint's config.json (its text_config for a multimodal
one). The builtin engine's budget (engine/budget.py, which the engine and the
manager's preflight share) and the upstream bridge's and standby's
``--max-total-tokens`` (backends/sglang.py) both call bytes_per_token, with
one dtype table and one reading of 'auto' (resolve_dtype, which the dtype
the builtin weights load in also follows: weights/checkpoint.py), so the
numbers that size GPU memory cannot disagree between them. Torch-free.

Trust: config.json is the administrator's checkpoint; its numbers are
checked for being positive integers, its dtype for being one this table
knows, and nothing else is read.
"""

from __future__ import annotations

from typing import Optional

from hostd.checkpoints import config_file

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: 'auto' where config.json names no dtype: what transformers loads such a
#: checkpoint in (torch's default dtype). Also the larger figure, so a budget
#: counted from it never falls short.
AUTO_WITHOUT_CONFIG_DTYPE = "float32"


def text_config(config: dict) -> dict:
    """The part of config.json that describes the language model."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def positive(config: dict, key: str) -> Optional[int]:
    """CONFIG[KEY] when it is a positive integer (not a bool), else None."""
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def resolve_dtype(config: dict, dtype: str, *, source: str = "config.json") -> str:
    """DTYPE, with 'auto' read as the checkpoint's own (config.json's dtype or
    torch_dtype, else AUTO_WITHOUT_CONFIG_DTYPE). ValueError naming the key and
    SOURCE when the dtype is one this table does not know: a guess would size
    GPU memory wrongly."""
    if dtype != "auto":
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        return dtype
    text = text_config(config)
    for key in ("dtype", "torch_dtype"):
        found = text.get(key) or config.get(key)
        if found:
            name = str(found).removeprefix("torch.")
            if name not in DTYPE_BYTES:
                raise ValueError(f"{source}: {key} {found!r} is not one of {', '.join(DTYPE_BYTES)}, "
                                 "so hostd cannot size the KV cache (set the model's dtype:)")
            return name
    return AUTO_WITHOUT_CONFIG_DTYPE


def bytes_per_token(config: dict, dtype: str, *, tensor_parallel_size: int = 1,
                    source: str = "config.json") -> int:
    """KV bytes one token takes in every layer on one tensor-parallel rank, for
    a model whose config.json is CONFIG, in DTYPE ('auto': resolve_dtype).

    ValueError naming the key and SOURCE when the config lacks what it takes
    (then no engine can size its cache) or names an unknown dtype."""
    text = text_config(config)
    layers = positive(text, "num_hidden_layers")
    heads = positive(text, "num_attention_heads")
    if layers is None or heads is None:
        raise ValueError(f"{source} lacks num_hidden_layers or num_attention_heads (positive integers): "
                         "the KV cache cannot be sized for this model")
    kv_heads = positive(text, "num_key_value_heads") or heads
    head_dim = positive(text, "head_dim")
    if head_dim is None:
        hidden = positive(text, "hidden_size")
        if hidden is None:
            raise ValueError(f"{source} lacks head_dim and hidden_size: the KV cache cannot be sized for this model")
        head_dim = hidden // heads
    per_rank_heads = max(1, kv_heads // tensor_parallel_size)
    return 2 * layers * per_rank_heads * head_dim * DTYPE_BYTES[resolve_dtype(config, dtype, source=source)]


def for_checkpoint(model_dir: str, dtype: str, *, tensor_parallel_size: int = 1) -> int:
    """bytes_per_token of the checkpoint directory MODEL_DIR, from its
    config.json; ValueError naming that file when it cannot be read or counted."""
    path = config_file.path_of(model_dir)
    config = config_file.read(model_dir)  # the one guarded reader: a FIFO, a huge file
    return bytes_per_token(config, dtype, tensor_parallel_size=tensor_parallel_size, source=str(path))
