"""The builtin engine's KV budget: how many bytes its paged KV cache holds.

One job: the arithmetic that the engine (which allocates the cache at start,
hostd/engine/batch.py) and the manager's reload preflight (which must know
what a new engine will take before starting it, hostd/manager/probe.py
through BuiltinBackend) both do, in one place and without torch, so that the
two can never disagree.

- bytes per token: hostd/kv_bytes.py, the rule every backend shares
  (Qwen2.5-7B in bf16: 56 KiB; the tiny test model: 256 B).
- the budget: ``engine.kv_cache_mib`` when set; unset, what every one of
  ``max_num_seqs`` requests needs at ``max_model_len`` tokens in whole
  blocks of the device's PAGE_SIZE (a request holds whole blocks: 64
  requests of 128 tokens take 64 blocks of 256 on CUDA, not 32), capped at
  DEFAULT_SHARE of the device's memory (the GPU's total, or the host's
  MemTotal on CPU), so that a second engine of the same config fits beside
  it for an overlap reload or a standby (two budgets and the shared weights
  within the device).

Trust: the model's config.json is the administrator's checkpoint; the numbers
are checked for being positive integers and nothing else is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hostd import kv_bytes
from hostd.checkpoints import config_file

# The unset budget's cap, as a fraction of the device's memory. Two engines
# (the serving one and an overlap or standby engine beside it) take at most
# 2 * 0.2 = 40 %, which leaves the shared weights of a 7B model (15 GB of an
# H200's 141 GB, 11 %) and reload.overlap_reserve_mib room. A larger default
# would make the overlap preflight fall back to restart on a busy GPU.
DEFAULT_SHARE = 0.2

# Tokens per KV block (transformers' page_size), per device kind. vLLM's
# default block is 16 tokens; on CPU small blocks waste least of a small
# budget. On CUDA the library's own default (256) suits its flash and decode
# kernels. The cache holds whole blocks (engine/rules.py's KV rule).
PAGE_SIZE = {"cpu": 16, "cuda": 256}


def one_request_bytes(max_model_len: int, per_token: int, page: int) -> int:
    """KV bytes one request of MAX_MODEL_LEN tokens holds: whole blocks of PAGE tokens."""
    return -(-max_model_len // page) * page * per_token


def kv_cache_bytes(*, kv_cache_mib: Optional[int], max_num_seqs: int, max_model_len: int, per_token: int,
                   device_total: Optional[int], page: int) -> int:
    """The KV budget in bytes (see the module docstring), for blocks of PAGE
    tokens. DEVICE_TOTAL None (unknown): the unset budget is what the batch
    needs, uncapped."""
    if kv_cache_mib is not None:
        return kv_cache_mib << 20
    one = one_request_bytes(max_model_len, per_token, page)
    need = max_num_seqs * one
    if device_total is None:
        return need
    return max(min(need, int(DEFAULT_SHARE * device_total)), one)


def positions(config: dict) -> int:
    """The model's max_position_embeddings (2048 when config.json has none): max_model_len unset."""
    return kv_bytes.positive(kv_bytes.text_config(config), "max_position_embeddings") or 2048


def swap_bytes(full: int, bridge_kv_mib: int, *, max_model_len: int, per_token: int, page: int) -> int:
    """The KV budget of a checkpoint swap's engine, which is meant to serve
    alone only while the main pair restarts beside it: the smaller of
    reload.bridge_kv_mib and the full budget FULL, but never less than one
    request of MAX_MODEL_LEN tokens in whole blocks, so that it serves every
    request the main engine admits (fewer at once; the rest wait)."""
    return min(full, max(bridge_kv_mib << 20, one_request_bytes(max_model_len, per_token, page)))


def for_checkpoint(checkpoint: Path, *, dtype: str, kv_cache_mib: Optional[int], max_num_seqs: int,
                   max_model_len: Optional[int], device_total: Optional[int], device: str,
                   bridge_kv_mib: Optional[int] = None) -> int:
    """kv_cache_bytes for the checkpoint directory CHECKPOINT (its config.json) on
    DEVICE ('cpu' or 'cuda': its PAGE_SIZE): DTYPE 'auto' is the checkpoint's
    own, max_model_len None its max_position_embeddings. With BRIDGE_KV_MIB,
    the swap engine's budget instead (swap_bytes)."""
    config = config_file.read(checkpoint)
    length = max_model_len or positions(config)
    per_token = kv_bytes.bytes_per_token(config, dtype, source=str(checkpoint / "config.json"))
    full = kv_cache_bytes(kv_cache_mib=kv_cache_mib, max_num_seqs=max_num_seqs, max_model_len=length,
                          per_token=per_token, device_total=device_total, page=PAGE_SIZE[device])
    if bridge_kv_mib is None:
        return full
    return swap_bytes(full, bridge_kv_mib, max_model_len=length, per_token=per_token, page=PAGE_SIZE[device])
