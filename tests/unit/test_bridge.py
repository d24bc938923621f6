"""The bridge engine of vLLM and SGLang: the next slot's own upstream socket
or port, its KV budget on its command line (the main slot keeps the
administrator's values), and the preflight that weighs that budget against
the free memory (issue 21)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import msgspec
import pytest

from hostd import backends, paths
from hostd.backends import upstream
from hostd.config import schema
from hostd.engine.health import EngineHealth
from hostd.manager.probe import GpuMemory, Memory, Probe

GiB = 1 << 30
MiB = 1 << 20
# Qwen2.5-7B's shape: 28 layers, 28 query heads, 4 KV heads of 128.
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "hidden_size": 3584, "torch_dtype": "bfloat16"}


def as_health(reported: dict) -> EngineHealth:
    """A /health as the probe decodes it (engine/health.py)."""
    return msgspec.convert(reported, EngineHealth)


@pytest.fixture(autouse=True)
def no_runtime_dir_override(monkeypatch):
    monkeypatch.delenv("HOSTD_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)


def make(tmp_path: Path, backend: str, config_json: dict = QWEN_7B, weights: int = 1, **keys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(config_json))
    with open(ckpt / "model.safetensors", "wb") as f:
        f.truncate(weights)  # sparse: the size is what counts
    return msgspec.convert({"backend": backend, "model": str(ckpt), **keys}, schema.MODEL_TYPES[backend])


def value(argv: list[str], flag: str) -> str:
    """FLAG's value as argparse reads ARGV: the last occurrence wins."""
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def test_the_vllm_slots_listen_on_their_own_upstream_sockets_and_only_next_gets_a_kv_budget(tmp_path):
    cfg = make(tmp_path, "vllm", engine={"gpu_memory_utilization": 0.85})
    backend = backends.for_config(cfg)
    main = backend.engine_command("m", cfg).argv
    bridge = backend.engine_command("m", cfg, slot="next", bridge=upstream.Bridge(2048 * MiB)).argv
    assert value(main, "--uds") == str(paths.runtime_dir("m") / "vllm-engine.sock")
    assert value(bridge, "--uds") == str(paths.runtime_dir("m") / "vllm-engine-next.sock")
    assert "--kv-cache-memory-bytes" not in main and value(main, "--gpu-memory-utilization") == "0.85"
    assert value(bridge, "--kv-cache-memory-bytes") == str(2048 * MiB)
    # no GPU total known: the administrator's fraction stays
    assert value(bridge, "--gpu-memory-utilization") == "0.85"


def test_a_vllm_bridge_on_a_gpu_asks_for_the_fraction_its_own_need_makes(tmp_path):
    """80 GiB GPU, 14 GiB of weights held by the daemon, 2 GiB of KV, 3 GiB
    non-KV: (14 + 2 + 3) / 80 = 0.2375, rounded up to 0.24, so vLLM's start
    check (free >= fraction x total - external weights) asks for 5 GiB."""
    cfg = make(tmp_path, "vllm")
    backend = backends.for_config(cfg)
    bridge = upstream.Bridge(2 * GiB, gpu_total=80 * GiB, weights_bytes=14 * GiB)
    argv = backend.engine_command("m", cfg, slot="next", bridge=bridge).argv
    assert value(argv, "--gpu-memory-utilization") == "0.24"
    assert backend.bridge_summary(cfg, bridge) == (
        f"--kv-cache-memory-bytes {2 * GiB} --gpu-memory-utilization 0.24 -u VLLM_CPU_KVCACHE_SPACE")


def test_a_vllm_bridge_on_cpu_runs_without_vllm_cpus_own_kv_variable(tmp_path, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE (the model's env: or hostd's own environment)
    would replace the bridge's --kv-cache-memory-bytes inside vLLM; the main
    engine keeps it. Removed, not emptied: vLLM int()s an empty value and
    fails to start (seen with the real vllm-cpu 0.32.0)."""
    from hostd import systemd

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    cfg = make(tmp_path, "vllm", device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "8"})
    backend = backends.for_config(cfg)
    assert backend.engine_command("m", cfg).env["VLLM_CPU_KVCACHE_SPACE"] == "8"
    bridge = backend.engine_command("m", cfg, slot="next", bridge=backend.bridge(cfg))
    assert "VLLM_CPU_KVCACHE_SPACE" not in bridge.env and bridge.unset == ("VLLM_CPU_KVCACHE_SPACE",)
    assert "VLLM_CPU_KVCACHE_SPACE" not in systemd.child_env(bridge.env, bridge.unset)
    assert systemd.child_env(bridge.env)["VLLM_CPU_KVCACHE_SPACE"] == "4"  # what a mere env update left
    assert "--gpu-memory-utilization" not in bridge.argv[bridge.argv.index("--kv-cache-memory-bytes"):]


def test_a_cpu_vllm_bridge_binds_its_openmp_thread_to_the_last_core_unless_the_administrator_did(tmp_path):
    """vllm-cpu's "auto" binding puts both engines on the same cores, where
    the serving engine's worker spins while requests come: the bridge gets
    the last core this process may use, which "auto" leaves to the main
    engine's scheduler. The main engine, a GPU bridge, tensor parallel and
    an administrator's own binding are left to vLLM."""
    cfg = make(tmp_path, "vllm", device="cpu")
    backend = backends.for_config(cfg)
    last = str(max(os.sched_getaffinity(0)))
    assert backend.engine_command("m", cfg, slot="next", bridge=backend.bridge(cfg)).env[
        "VLLM_CPU_OMP_THREADS_BIND"] == last
    assert "VLLM_CPU_OMP_THREADS_BIND" not in backend.engine_command("m", cfg).env
    own = make(tmp_path, "vllm", device="cpu", env={"VLLM_CPU_OMP_THREADS_BIND": "2-3"})
    assert backend.engine_command("m", own, slot="next", bridge=backend.bridge(own)).env[
        "VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert backend.bridge_env(make(tmp_path, "vllm", device="cpu", tensor_parallel_size=2)) == {}
    assert backend.bridge_env(make(tmp_path, "vllm", device="cuda")) == {}


@pytest.mark.parametrize("tp, tokens", [(1, 2 * GiB // (28 * 4 * 128 * 2 * 2)), (2, 2 * GiB // (28 * 2 * 128 * 2 * 2))])
def test_an_sglang_bridge_caps_its_pool_in_tokens_of_the_models_kv(tmp_path, tp, tokens):
    cfg = make(tmp_path, "sglang", tensor_parallel_size=tp, gpus=list(range(tp)))
    backend = backends.for_config(cfg)
    main = backend.engine_command("m", cfg, port=31000).argv
    bridge = backend.engine_command("m", cfg, port=31001, slot="next", bridge=upstream.Bridge(2 * GiB)).argv
    assert "--max-total-tokens" not in main
    assert value(bridge, "--max-total-tokens") == str(tokens)
    assert (value(main, "--port"), value(bridge, "--port")) == ("31000", "31001")
    assert backend.overlap_refusal(cfg) is None


def test_sglang_refuses_the_overlap_when_config_json_cannot_size_the_bridge(tmp_path):
    cfg = make(tmp_path, "sglang", config_json={"architectures": ["X"]})
    assert "cannot size the bridge engine's --max-total-tokens" in backends.for_config(cfg).overlap_refusal(cfg)


def test_vllm_and_builtin_do_not_refuse_a_second_engine(tmp_path):
    for backend in ("vllm", "builtin"):
        cfg = make(tmp_path, backend)
        assert backends.for_config(cfg).overlap_refusal(cfg) is None


def test_the_cpu_preflight_weighs_the_bridge_and_its_own_weights_against_memavailable(tmp_path):
    """vllm-cpu has no weight cache: the bridge loads its own copy (1 GiB
    here) besides 512 MiB of KV and the non-KV footprint."""
    cfg = make(tmp_path, "vllm", device="cpu", weights=GiB, reload={"bridge_kv_mib": 512})
    need = GiB + 512 * MiB + upstream.BRIDGE_NON_KV_BYTES
    probe = Probe("m")
    tight = {"memory": {"host_available": need + 100 * MiB}}
    problem = probe.overlap_problem(cfg, as_health(tight), Memory(None, ""))
    assert f"about {need >> 20} MiB" in problem and "bridge_kv_mib=512" in problem
    assert "its own copy of the weights" in problem and "overlap_reserve_mib=256" in problem
    assert probe.overlap_problem(cfg, as_health({"memory": {"host_available": need + 300 * MiB}}), Memory(None, "")) is None
    assert "does not report the host's memory" in probe.overlap_problem(cfg, as_health({}), Memory(None, ""))


def test_the_gpu_preflight_weighs_the_bridge_kv_budget_against_nvml_free_memory(tmp_path):
    """With the weight cache the bridge shares the weights: KV budget + non-KV
    + reserve against each GPU's free memory, whatever the serving engine holds."""
    cfg = make(tmp_path, "vllm", tensor_parallel_size=2, gpus=[0, 1], weights=14 * GiB)
    need = 2048 * MiB + upstream.BRIDGE_NON_KV_BYTES + 256 * MiB
    serving = 60 * GiB  # far more than is free: the bridge does not need as much
    roomy = GpuMemory(0, 80 * GiB, need + MiB, serving, 7 * GiB)
    tight = GpuMemory(1, 80 * GiB, need - MiB, serving, 7 * GiB)
    probe = Probe("m")
    assert probe.overlap_problem(cfg, as_health({}), Memory([roomy, roomy._replace(index=1)], "")) is None
    problem = probe.overlap_problem(cfg, as_health({}), Memory([roomy, tight], ""))
    assert problem.startswith("GPU 1: the bridge engine needs about 5120 MiB")
    assert "its own copy" not in problem
    assert "cannot read GPU memory" in probe.overlap_problem(cfg, as_health({}), Memory(None, "no NVML"))


def test_the_upstream_supervisor_reports_its_slot_and_bridge_on_health(tmp_path, monkeypatch):
    from hostd.engine.upstream import EngineSupervisor

    cfg = make(tmp_path, "vllm", device="cpu", reload={"bridge_kv_mib": 256})
    backend = backends.for_config(cfg)
    main = EngineSupervisor("m", cfg, backend, tmp_path / "engine.sock", (1, 2))
    nxt = EngineSupervisor("m", cfg, backend, tmp_path / "engine-next.sock", (1, 2), slot="next")
    assert (main.bridge, main.upstream_socket.name) == ("", "vllm-engine.sock")
    assert nxt.upstream_socket.name == "vllm-engine-next.sock"
    assert nxt.bridge == (f"--kv-cache-memory-bytes {256 * MiB} -u VLLM_CPU_KVCACHE_SPACE"
                          f" VLLM_CPU_OMP_THREADS_BIND={max(os.sched_getaffinity(0))}")
    assert value(nxt.command.argv, "--kv-cache-memory-bytes") == str(256 * MiB)


def test_the_upstream_supervisor_reports_the_checkpoint_its_weight_daemon_holds(tmp_path):
    """/health carries the weight daemon's checkpoint and content digest, which
    a checkpoint swap's verify holds the restarted main engine to."""
    from hostd.engine.upstream import EngineSupervisor
    from hostd.weights import protocol

    cfg = make(tmp_path, "vllm", device="cpu")
    fingerprint = protocol.Fingerprint(
        model_path="/srv/ckpt/v2", content_digest="d2", architecture="Qwen2ForCausalLM", dtype="auto",
        device="cpu", tensor_parallel_size=1, backend="vllm", torch_version="", transformers_version="")
    swap = EngineSupervisor("m", cfg, backends.for_config(cfg), tmp_path / "engine-next.sock", (1, 2), slot="next",
                            weights_slot="next", fingerprint=fingerprint)

    async def health() -> dict:
        async def upstream_health():
            return 200
        swap.upstream_health = upstream_health
        return json.loads((await swap.health(None)).body)

    answer = asyncio.run(health())
    assert (answer["checkpoint"], answer["content_digest"], answer["slot"]) == ("/srv/ckpt/v2", "d2", "next")


def test_a_swaps_preflight_counts_each_gpus_shard_of_the_new_checkpoint_and_names_it(tmp_path):
    """vllm on two GPUs with the weight cache: the new checkpoint's second
    daemon holds half of its 14 GiB on each GPU, besides the bridge's need;
    the refusal names those bytes. On CPU (no weight cache) the bridge's own
    copy is its need already: nothing is added for the daemon."""
    from types import SimpleNamespace

    from hostd.manager.change import Change

    from hostd.manager.strategies import swap_problem

    cfg = make(tmp_path, "vllm", tensor_parallel_size=2, gpus=[0, 1], weights=14 * GiB)
    bridge = 2048 * MiB + upstream.BRIDGE_NON_KV_BYTES + 256 * MiB
    probe = Probe("m")
    run = SimpleNamespace(target=cfg, change=Change(checkpoint=cfg.model), health=as_health({}), model=SimpleNamespace(probe=probe))
    fits = GpuMemory(0, 80 * GiB, bridge + 7 * GiB + MiB, 0, 7 * GiB)
    assert swap_problem(run, Memory([fits, fits._replace(index=1)], "")) is None
    short = fits._replace(index=1, free=bridge + 7 * GiB - MiB)
    problem = swap_problem(run, Memory([fits, short], ""))
    assert problem.startswith("a checkpoint swap does not fit: GPU 1: the bridge engine needs about 5120 MiB")
    assert "the new checkpoint's weights (7168 MiB) and reload.overlap_reserve_mib=256 must stay free" in problem

    cpu = make(tmp_path, "vllm", device="cpu", weights=GiB, reload={"bridge_kv_mib": 512})
    need = GiB + 512 * MiB + upstream.BRIDGE_NON_KV_BYTES + 256 * MiB
    run = SimpleNamespace(target=cpu, change=Change(checkpoint=cpu.model), model=SimpleNamespace(probe=probe),
                          health=as_health({"memory": {"host_available": need + MiB}}))
    assert swap_problem(run, Memory(None, "")) is None


def test_an_upstream_engine_refuses_a_weight_daemon_of_another_checkpoint(tmp_path):
    from hostd.engine.upstream import checkpoint_problem
    from hostd.weights import protocol

    cfg = make(tmp_path, "vllm", device="cpu")

    def held(path: str) -> protocol.Fingerprint:
        return protocol.Fingerprint(model_path=path, content_digest="d", architecture="Qwen2ForCausalLM",
                                    dtype="auto", device="cpu", tensor_parallel_size=1, backend="vllm",
                                    torch_version="", transformers_version="")

    assert checkpoint_problem(cfg, held(str(Path(cfg.model).resolve())), Path("/run/hostd/m/weights.sock")) is None
    problem = checkpoint_problem(cfg, held("/srv/ckpt/old"), Path("/run/hostd/m/weights.sock"))
    assert problem.startswith(f"the weight daemon at /run/hostd/m/weights.sock holds /srv/ckpt/old, but model: "
                              f"names {Path(cfg.model).resolve()}")


VLLM_START = (  # vLLM 0.32's stderr as it starts, a progress bar redrawn with carriage returns
    b"INFO 12-04 22:00:00 [cpu_model_runner.py:68] Starting to load model /m...\n"
    b"Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]\r"
    b"Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01, 1.0it/s]\r"
    b"Loading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00, 1.0it/s]\n"
    b"INFO 12-04 22:00:03 [api_server.py:1] a line that names no phase\n"
    b"INFO 12-04 22:00:04 [core.py:386] init engine (profile, create kv cache, warmup model) took 4.20 s"
)


def test_the_upstream_supervisor_relays_its_start_phases_to_status_and_its_stderr_unchanged(tmp_path, monkeypatch,
                                                                                          capfd):
    """Issue 55, item 4: while upstream starts, each phase line (the backend's
    phase_lines) becomes the supervisor's STATUS=, from the phase's words on;
    a progress bar's redraws (carriage returns) are lines too, a new phase
    goes at once and a redraw of the same one at most every PHASE_STATUS_S;
    other lines are not relayed, the stderr passes through byte for byte,
    and once the server serves nothing is relayed any more."""
    import sys

    from hostd import systemd
    from hostd.engine import upstream as supervisor

    sent: list[str] = []
    monkeypatch.setattr(systemd, "status", sent.append)
    cfg = make(tmp_path, "vllm", device="cpu")
    engine = supervisor.EngineSupervisor("m", cfg, backends.for_config(cfg), tmp_path / "engine.sock", (1, 2))

    async def run(data: bytes) -> None:
        engine.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import sys; sys.stderr.buffer.write(sys.stdin.buffer.read())",
            stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        engine.proc.stdin.write(data)
        engine.proc.stdin.close()
        await engine.stderr.copy(engine.proc.stderr)
        await engine.proc.wait()

    asyncio.run(run(VLLM_START))
    assert sent[0] == "vllm starting: Starting to load model /m..."
    assert sent[1] == "vllm starting: Loading safetensors checkpoint shards:   0% Completed | 0/2 [00:00<?, ?it/s]"
    assert sent[-1] == "vllm starting: init engine (profile, create kv cache, warmup model) took 4.20 s"
    assert len(sent) <= 5 and not any("names no phase" in s for s in sent), sent  # redraws within 0.5 s: one
    assert capfd.readouterr().err.encode() == VLLM_START
    assert engine.stderr.tail[-1].endswith("took 4.20 s") and len(engine.stderr.tail) == 6

    sent.clear()
    engine.stderr.starting = False  # READY=1 sent: STATUS= is the supervisor's own from here on
    asyncio.run(run(VLLM_START))
    assert sent == []
