"""The vLLM and SGLang standby (issue 35): its command line (its own
upstream socket or port, the main engine's attach to the weight cache
daemon, and the bridge's KV budget, reload.bridge_kv_mib,
with and without the weight cache, tensor parallel 1 and 2; the real parsers
accept every such line in tests/upstream/test_contract.py), when a reload
restarts it, and its start preflight. tests/system/test_real_vllm.py runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from hostd import backends, paths
from hostd.backends import upstream
from hostd.config import schema

GiB = 1 << 30
MiB = 1 << 20
# Qwen2.5-7B's shape: 28 layers, 4 KV heads of 128 (56 KiB of bf16 KV a token).
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "hidden_size": 3584, "torch_dtype": "bfloat16"}
# The budget the bridge computes for it on an 80 GiB GPU, 14 GiB of weights per GPU.
ON_A_GPU = upstream.Bridge(2048 * MiB, gpu_total=80 * GiB, weights_bytes=14 * GiB)


@pytest.fixture(autouse=True)
def no_runtime_dir_override(monkeypatch):
    for name in ("HOSTD_RUNTIME_DIR", "CACHE_DIRECTORY", "VLLM_CPU_KVCACHE_SPACE"):
        monkeypatch.delenv(name, raising=False)


def make(tmp_path: Path, backend: str, **keys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(QWEN_7B))
    (ckpt / "model.safetensors").write_bytes(b"x")
    return msgspec.convert({"backend": backend, "model": str(ckpt), **keys}, schema.MODEL_TYPES[backend])


def value(argv: list[str], flag: str) -> str:
    """FLAG's value as upstream's parser reads ARGV: the last occurrence wins."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def without(argv: list[str], flag: str) -> list[str]:
    """ARGV less every FLAG and its value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        else:
            out.append(arg)
    return out


TP2 = {"tensor_parallel_size": 2, "gpus": [0, 1]}


@pytest.mark.parametrize("keys", [{}, TP2, {"weight_cache": "off"}], ids=["tp1", "tp2", "cache-off"])
def test_the_vllm_standby_is_the_bridge_on_a_uds_of_its_own(tmp_path, keys):
    """Same flags as the bridge (the same attach, the same budget), only the
    --uds differs: vllm-engine-standby.sock, beside main's and next's."""
    cfg = make(tmp_path, "vllm", **keys)
    backend = backends.for_config(cfg)
    standby = backend.standby_command("m", cfg, ON_A_GPU)
    bridge = backend.engine_command("m", cfg, slot="next", bridge=ON_A_GPU)
    main = backend.engine_command("m", cfg)
    sockets = {value(c.argv, "--uds") for c in (standby, bridge, main)}
    assert value(standby.argv, "--uds") == str(paths.runtime_dir("m") / "vllm-engine-standby.sock")
    assert len(sockets) == 3
    assert without(standby.argv, "--uds") == without(bridge.argv, "--uds")
    assert (standby.env, standby.unset) == (bridge.env, bridge.unset)
    assert value(standby.argv, "--tensor-parallel-size") == str(cfg.tensor_parallel_size)


def test_the_vllm_standby_attaches_to_the_main_engines_weight_cache_zero_copy(tmp_path):
    cfg = make(tmp_path, "vllm", **TP2)
    backend = backends.for_config(cfg)
    standby = backend.standby_command("m", cfg, ON_A_GPU).argv
    main = backend.engine_command("m", cfg).argv
    assert value(standby, "--load-format") == value(main, "--load-format") == "ipc_cache"
    loader = json.loads(value(standby, "--model-loader-extra-config"))
    assert loader == json.loads(value(main, "--model-loader-extra-config"))
    assert loader == {"mode": "zero_copy", "fallback": False, "socket_dir": str(paths.runtime_dir("m") / "vllm")}


def test_the_vllm_standby_runs_on_the_bridges_kv_budget_and_fraction(tmp_path):
    """--kv-cache-memory-bytes = reload.bridge_kv_mib; on a GPU the fraction its
    own need makes, (14 + 2 + 3) / 80 rounded up: 0.24 (docs/vllm.md, The
    standby: the arithmetic); both after the administrator's 0.9."""
    cfg = make(tmp_path, "vllm", reload={"bridge_kv_mib": 2048}, engine={"gpu_memory_utilization": 0.9})
    backend = backends.for_config(cfg)
    argv = backend.standby_command("m", cfg, ON_A_GPU).argv
    main = backend.engine_command("m", cfg).argv
    assert argv[-4:] == ["--kv-cache-memory-bytes", str(2048 * MiB), "--gpu-memory-utilization", "0.24"]
    assert value(main, "--gpu-memory-utilization") == "0.9" and "--kv-cache-memory-bytes" not in main
    assert argv[:len(main)] == [a.replace("vllm-engine.sock", "vllm-engine-standby.sock") for a in main]


def test_a_cpu_vllm_standby_has_no_kv_variable_of_vllm_cpus_and_a_core_of_its_own(tmp_path):
    """Without the weight cache (device: cpu) the standby loads from disk, as
    the bridge does, with VLLM_CPU_KVCACHE_SPACE removed (it would replace the
    KV flag) and its OpenMP thread on the last core."""
    cfg = make(tmp_path, "vllm", device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "8"})
    backend = backends.for_config(cfg)
    standby = backend.standby_command("m", cfg, backend.bridge(cfg))
    assert "--load-format" not in standby.argv
    assert value(standby.argv, "--kv-cache-memory-bytes") == str(cfg.reload.bridge_kv_mib * MiB)
    assert "--gpu-memory-utilization" not in standby.argv[standby.argv.index("--kv-cache-memory-bytes"):]
    assert "VLLM_CPU_KVCACHE_SPACE" not in standby.env and standby.unset == ("VLLM_CPU_KVCACHE_SPACE",)
    assert standby.env["VLLM_CPU_OMP_THREADS_BIND"] == str(max(os.sched_getaffinity(0)))


@pytest.mark.parametrize("keys, tokens", [
    ({}, 2 * GiB // (28 * 4 * 128 * 2 * 2)),
    (TP2, 2 * GiB // (28 * 2 * 128 * 2 * 2)),
    ({"weight_cache": "off"}, 2 * GiB // (28 * 4 * 128 * 2 * 2)),
], ids=["tp1", "tp2", "cache-off"])
def test_the_sglang_standby_is_the_bridge_on_a_port_of_its_own(tmp_path, keys, tokens):
    """--max-total-tokens: the bridge's budget in tokens of one rank's KV; the
    same --weight-cache-mode client (none without the cache) and the same
    socket and ready templates as the main engine, so all three attach to one
    daemon per GPU; only --port differs."""
    cfg = make(tmp_path, "sglang", reload={"bridge_kv_mib": 2048}, **keys)
    backend = backends.for_config(cfg)
    standby = backend.standby_command("m", cfg, upstream.Bridge(2 * GiB), port=31002)
    bridge = backend.engine_command("m", cfg, port=31001, slot="next", bridge=upstream.Bridge(2 * GiB))
    main = backend.engine_command("m", cfg, port=31000)
    assert value(standby.argv, "--port") == "31002"
    assert without(standby.argv, "--port") == without(bridge.argv, "--port")
    assert value(standby.argv, "--max-total-tokens") == str(tokens)
    assert "--max-total-tokens" not in main.argv
    assert standby.env == main.env
    cached = backend.retains_weights(cfg)
    assert ("--weight-cache-mode" in standby.argv) == cached == ("--weight-cache-mode" in main.argv)
    if cached:
        assert value(standby.argv, "--weight-cache-mode") == "client"
    assert value(standby.argv, "--tp-size") == str(cfg.tensor_parallel_size)


def test_standby_is_a_key_of_every_backend_and_off_by_default(tmp_path):
    for backend in ("builtin", "vllm", "sglang"):
        assert "standby" in {f.name for f in msgspec.structs.fields(schema.MODEL_TYPES[backend])}
    assert make(tmp_path, "vllm").standby is False
    assert make(tmp_path, "sglang", standby=True).standby is True


def test_only_the_builtin_rebuilds_in_place_in_its_process():
    assert backends.for_config(msgspec.convert({"backend": "builtin", "model": "/m"}, schema.BuiltinModel)).rebuilds_in_place
    for name in ("vllm", "sglang"):
        cfg = msgspec.convert({"backend": name, "model": "/m"}, schema.MODEL_TYPES[name])
        assert backends.for_config(cfg).rebuilds_in_place is False


@pytest.mark.parametrize("backend, key", [("vllm", "max_model_len"), ("sglang", "context_length")])
def test_the_standby_restarts_only_for_a_key_that_changes_which_requests_it_accepts(tmp_path, backend, key):
    """A capacity key (max_num_seqs, the memory fraction) leaves the standby
    on the config it started with; the context length restarts it, named."""
    be = backends.for_config(make(tmp_path, backend))
    running = msgspec.to_builtins(make(tmp_path, backend).engine)
    capacity = "max_num_seqs" if backend == "vllm" else "max_running_requests"
    assert be.standby_restart_reason(running, {**running, capacity: 99}) is None
    why = be.standby_restart_reason(running, {**running, key: 512})
    assert why is not None and key in why and "512" in why


def test_a_standby_that_does_not_fit_is_refused_naming_the_numbers(tmp_path):
    """The standby's start preflight: on CPU the bridge's need, its own copy
    of the weights (no weight cache there) and the reserve against
    MemAvailable; on a GPU against each GPU's NVML free memory."""
    cpu = make(tmp_path, "vllm", device="cpu", standby=True, reload={"bridge_kv_mib": 1024})
    be = backends.for_config(cpu)
    need = be.bridge_need(cpu) + (cpu.reload.overlap_reserve_mib << 20)
    assert be.standby_fit_problem(cpu, need, {}) is None
    problem = be.standby_fit_problem(cpu, need - MiB, {})
    assert problem is not None
    for words in ("reload.bridge_kv_mib=1024", "its own copy of the weights", "reload.overlap_reserve_mib=256",
                  f"MemAvailable is {(need - MiB) >> 20} MiB", "standby: false"):
        assert words in problem, (words, problem)
    gpu = make(tmp_path, "vllm", standby=True, gpus=[0, 1], tensor_parallel_size=2)
    be = backends.for_config(gpu)
    need = be.bridge_need(gpu) + (gpu.reload.overlap_reserve_mib << 20)
    assert be.standby_fit_problem(gpu, None, {0: need, 1: need}) is None
    problem = be.standby_fit_problem(gpu, None, {0: need, 1: need - MiB})
    assert problem is not None and problem.startswith("GPU 1: ") and f"{(need - MiB) >> 20} MiB are free" in problem
    assert be.standby_fit_problem(gpu, None, {}) is None  # NVML cannot tell: upstream's own check guards
