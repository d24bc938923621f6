"""The builtin engine's KV budget (hostd/engine/budget.py) and how the reload preflight charges it."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from hostd import config, kv_bytes
from hostd.engine import budget
from hostd.engine.health import EngineHealth
from hostd.manager.probe import Memory, Probe

MiB = 1 << 20

QWEN_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
           "max_position_embeddings": 32768, "dtype": "bfloat16"}


def as_health(reported: dict) -> EngineHealth:
    """A /health as the probe decodes it (engine/health.py)."""
    return msgspec.convert(reported, EngineHealth)


def test_bytes_per_token_is_keys_and_values_of_every_layer():
    assert kv_bytes.bytes_per_token(QWEN_7B, "bfloat16") == 56 * 1024  # 2 * 28 * 4 * 128 * 2
    assert kv_bytes.bytes_per_token({**QWEN_7B, "head_dim": 64}, "float32") == 2 * 28 * 4 * 64 * 4


def test_the_unset_budget_fits_the_batch_and_is_capped_at_a_share_of_the_device():
    per_token = kv_bytes.bytes_per_token(QWEN_7B, "bfloat16")
    small = budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=8, max_model_len=4096, per_token=per_token,
                                  device_total=141 << 30, page=budget.PAGE_SIZE["cuda"])
    assert small == 8 * 4096 * per_token
    capped = budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=64, max_model_len=32768, per_token=per_token,
                                   device_total=141 << 30, page=budget.PAGE_SIZE["cuda"])
    assert capped == int(budget.DEFAULT_SHARE * (141 << 30))
    assert budget.kv_cache_bytes(kv_cache_mib=300, max_num_seqs=64, max_model_len=32768, per_token=per_token,
                                 device_total=141 << 30, page=budget.PAGE_SIZE["cuda"]) == 300 * MiB


def test_the_unset_budget_never_falls_below_one_full_length_request():
    """A device whose share cannot hold one request of max_model_len still
    gets one (issue 53: without the floor, a 7B on a small share got no
    block for a full-length request: turn 4's GPU failure)."""
    per_token = kv_bytes.bytes_per_token(QWEN_7B, "bfloat16")
    page = budget.PAGE_SIZE["cuda"]
    one = budget.one_request_bytes(32768, per_token, page)
    small_device = int(one / budget.DEFAULT_SHARE) // 2  # its share is half a request
    assert budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=8, max_model_len=32768, per_token=per_token,
                                 device_total=small_device, page=page) == one


def test_a_budget_one_block_short_of_a_request_not_a_multiple_of_the_block_is_refused():
    """rules.kv_problem rounds the request up to whole blocks: 17 tokens in
    blocks of 16 need two; a budget of one block is refused, of two accepted."""
    from hostd.engine import rules

    page = budget.PAGE_SIZE["cpu"]
    length = page + 1
    assert rules.kv_problem(kv_cache_bytes=page, per_token=1, max_model_len=length, device="cpu")
    assert rules.kv_problem(kv_cache_bytes=2 * page, per_token=1, max_model_len=length, device="cpu") is None


def test_the_unset_budget_counts_each_request_in_whole_blocks():
    """A request holds whole blocks: on CUDA (256 tokens a block) 64 requests
    of 128 tokens need 64 blocks. Counted in tokens (32 blocks) half of them
    waited for the other half (benchmarks/throughput.py at 64 streams on the
    H200, 2026-12-02), and one request of 128 tokens got no block at all."""
    per_token = kv_bytes.bytes_per_token(QWEN_7B, "bfloat16")
    page = budget.PAGE_SIZE["cuda"]
    batch = budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=64, max_model_len=128, per_token=per_token,
                                  device_total=141 << 30, page=page)
    assert batch // (per_token * page) == 64
    one = budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=1, max_model_len=128, per_token=per_token,
                                device_total=141 << 30, page=page)
    assert one // (per_token * page) == 1
    # a whole number of blocks already: unchanged
    assert budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=8, max_model_len=4096, per_token=per_token,
                                 device_total=141 << 30, page=page) == 8 * 4096 * per_token


def write_model(root: Path, engine: str) -> object:
    checkpoint = root / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(QWEN_7B))
    (checkpoint / "model.safetensors").write_bytes(b"")
    models = root / "etc" / "models"
    models.mkdir(parents=True)
    (models / "m.yaml").write_text(f"backend: builtin\nmodel: {checkpoint}\ndevice: cpu\nengine: {engine}\n")
    return config.load_model("m", root / "etc").config


def test_the_overlap_preflight_swaps_the_serving_kv_cache_for_the_new_configs(tmp_path):
    cfg = write_model(tmp_path, "{max_num_seqs: 4, max_model_len: 1024, kv_cache_mib: 1000}")
    serving = {"kv_cache_bytes": 500 * MiB,
               "memory": {"anonymous": 800 * MiB, "host_available": 1500 * MiB, "host_total": 64 << 30}}
    # 800 - 500 + 1000 = 1300 MiB, and the 256 MiB reserve: 1556 > 1500
    problem = Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, ""))
    assert "about 1300 MiB" in problem and "KV cache of 1000 MiB" in problem
    serving["memory"]["host_available"] = 1600 * MiB
    assert Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, "")) is None


def test_the_thread_per_request_engine_has_no_kv_budget_to_charge(tmp_path):
    cfg = write_model(tmp_path, "{batching: none, max_num_seqs: 4}")
    serving = {"memory": {"anonymous": 800 * MiB, "host_available": 1100 * MiB}}
    assert Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, "")) is None  # 800 + 256 reserve fits


def test_a_swaps_engine_takes_the_bridge_budget_but_never_less_than_one_request():
    """A checkpoint swap's engine (the next weight slot) serves alone only
    while the main pair restarts: reload.bridge_kv_mib, unless the full
    budget is smaller, and never below one max_model_len request (else it
    would refuse a request the main engine admits)."""
    per_token = kv_bytes.bytes_per_token(QWEN_7B, "bfloat16")
    page = budget.PAGE_SIZE["cuda"]
    full = 20 << 30
    assert budget.swap_bytes(full, 2048, max_model_len=32768, per_token=per_token, page=page) == 2048 * MiB
    assert budget.swap_bytes(100 * MiB, 2048, max_model_len=1024, per_token=per_token, page=page) == 100 * MiB
    one = 32768 * per_token  # 1,792 MiB: 128 whole blocks
    assert budget.swap_bytes(full, 16, max_model_len=32768, per_token=per_token, page=page) == one
    # a length that is no whole number of blocks: one request is 4 blocks of 256 (56 MiB)
    assert budget.swap_bytes(full, 16, max_model_len=1000, per_token=per_token, page=page) == 1024 * per_token
    assert budget.swap_bytes(full, 100, max_model_len=1000, per_token=per_token, page=page) == 100 * MiB


def test_the_swap_preflight_charges_the_swap_engines_smaller_cache_and_names_the_key(tmp_path):
    cfg = write_model(tmp_path, "{max_num_seqs: 4, max_model_len: 1024, kv_cache_mib: 1000}")
    cfg = msgspec.structs.replace(cfg, reload=msgspec.structs.replace(cfg.reload, bridge_kv_mib=100))
    serving = {"kv_cache_bytes": 1000 * MiB,
               "memory": {"anonymous": 1200 * MiB, "host_available": 1000 * MiB, "host_total": 64 << 30}}
    # 1200 - 1000 + 100 = 300 MiB, the new weights 400 and the 256 MiB reserve: 956 fits in 1000
    assert Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, ""), 400 * MiB, swap=True) is None
    # an overlap's engine takes the full 1000 MiB: 1200 + 400 + 256 does not fit
    assert "KV cache of 1000 MiB" in Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, ""), 400 * MiB)
    serving["memory"]["host_available"] = 900 * MiB
    problem = Probe("m").overlap_problem(cfg, as_health(serving), Memory(None, ""), 400 * MiB, swap=True)
    assert "about 300 MiB" in problem and "swap engine's KV cache of 100 MiB, reload.bridge_kv_mib=100" in problem


def test_the_engine_on_the_next_weight_slot_allocates_the_swap_budget(tmp_path):
    from types import SimpleNamespace

    from hostd.engine.main import limits_for

    cfg = write_model(tmp_path, "{max_num_seqs: 4, max_model_len: 1024, kv_cache_mib: 1000}")
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32768))
    assert limits_for(cfg, model).kv_cache_bytes == 1000 * MiB
    assert limits_for(cfg, model, swap=True).kv_cache_bytes == 1000 * MiB  # the default 2048 is more than the full
    cfg = msgspec.structs.replace(cfg, reload=msgspec.structs.replace(cfg.reload, bridge_kv_mib=100))
    assert limits_for(cfg, model, swap=True).kv_cache_bytes == 100 * MiB


# ---------------------------------------------------------------- one rule (issue 49)

NO_DTYPE = {key: value for key, value in QWEN_7B.items() if key != "dtype"}


def test_every_backend_counts_kv_bytes_per_token_by_one_rule(tmp_path):
    """The builtin engine's budget and the upstream bridge's --max-total-tokens
    read a checkpoint without a dtype in config.json the same way ('auto' is
    float32 in both), and halve the KV heads per tensor-parallel rank."""
    from types import SimpleNamespace

    from hostd import kv_bytes
    from hostd.backends import upstream

    (tmp_path / "config.json").write_text(json.dumps(NO_DTYPE))
    cfg = SimpleNamespace(model=str(tmp_path), dtype="auto", tensor_parallel_size=1)
    assert upstream.kv_bytes_per_token(cfg) == kv_bytes.bytes_per_token(NO_DTYPE, "auto") == 2 * 28 * 4 * 128 * 4
    assert budget.for_checkpoint(tmp_path, dtype="auto", kv_cache_mib=None, max_num_seqs=1, max_model_len=256,
                                 device_total=None, device="cuda") == 256 * 2 * 28 * 4 * 128 * 4
    assert upstream.kv_bytes_per_token(SimpleNamespace(**{**vars(cfg), "tensor_parallel_size": 2})) == 28 * 2 * 128 * 2 * 4


def test_an_unknown_dtype_is_refused_naming_the_key_and_the_file(tmp_path):
    from types import SimpleNamespace

    from hostd import kv_bytes
    from hostd.backends import upstream

    (tmp_path / "config.json").write_text(json.dumps({**NO_DTYPE, "torch_dtype": "float8_e4m3fn"}))
    cfg = SimpleNamespace(model=str(tmp_path), dtype="auto", tensor_parallel_size=1)
    problem = upstream.kv_size_problem(cfg)
    assert f"{tmp_path}/config.json: torch_dtype 'float8_e4m3fn' is not one of" in problem, problem
    assert upstream.kv_bytes_per_token(cfg) is None
    with pytest.raises(ValueError, match=r"config.json: torch_dtype 'float8_e4m3fn'"):
        budget.for_checkpoint(tmp_path, dtype="auto", kv_cache_mib=None, max_num_seqs=1, max_model_len=256,
                              device_total=None, device="cpu")
    with pytest.raises(ValueError, match=r"dtype: 'int4' is not one of"):
        kv_bytes.bytes_per_token(QWEN_7B, "int4")


def test_the_weights_load_in_the_dtype_the_kv_budget_counts(tmp_path):
    """'auto' is read once (kv_bytes.resolve_dtype) for the dtype the weights
    load in and the one every KV budget counts, so the two cannot differ."""
    from hostd import kv_bytes
    from hostd.weights import checkpoint

    for config, loads in ((NO_DTYPE, "float32"), (QWEN_7B, "bfloat16"), ({**NO_DTYPE, "torch_dtype": "float16"}, "float16"),
                          ({"text_config": {**NO_DTYPE, "dtype": "bfloat16"}}, "bfloat16")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert checkpoint.resolve_dtype(tmp_path, "auto") == kv_bytes.resolve_dtype(config, "auto") == loads
    (tmp_path / "config.json").write_text(json.dumps({**NO_DTYPE, "torch_dtype": "float8_e4m3fn"}))
    with pytest.raises(ValueError, match=r"config.json: torch_dtype 'float8_e4m3fn' is not one of"):
        checkpoint.resolve_dtype(tmp_path, "auto")
