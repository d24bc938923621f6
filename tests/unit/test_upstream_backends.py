"""The vllm and sglang backends: the exact upstream argv and environment hostd
runs, every refusal naming its setting, and SGLANG_JIT_CACHE_DIR resolved to a
real absolute path that a child process inherits.

Flag names are upstream's (vLLM 0.32+ `vllm preload` / `vllm serve`, SGLang
0.5.21+ weight cache daemon and launch_server); docs/vllm.md and docs/sglang.md
say where each was checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from hostd import backends, systemd
from hostd.backends import sglang as sglang_backend
from hostd.backends import upstream
from hostd.backends import vllm as vllm_backend
from hostd.config import schema

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"
VLLM = str(DOUBLES / "vllm")
SGLANG_PATH = str(DOUBLES / "sglang_double")
PY = sys.executable
RUN = "/run/hostd/m"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("CACHE_DIRECTORY", "SGLANG_JIT_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                 "HOSTD_VLLM", "HOSTD_SGLANG_PYTHON", "CUDA_VISIBLE_DEVICES", "HOSTD_RUNTIME_DIR",
                 "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """HOME is a symlink (as /home -> /data/home on many hosts); returns its real target."""
    real = tmp_path / "real-home"
    real.mkdir()
    (tmp_path / "home-link").symlink_to(real)
    monkeypatch.setenv("HOME", str(tmp_path / "home-link"))
    return real


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"x")
    return str(path)


def make(backend: str, model: str, **keys):
    env = keys.pop("env", {})
    if backend == "vllm":
        env = {"HOSTD_VLLM": VLLM, **env}
    else:
        env = {"PYTHONPATH": SGLANG_PATH, **env}
    return msgspec.convert({"backend": backend, "model": model, "env": env, **keys}, schema.MODEL_TYPES[backend])


# ---------------------------------------------------------------- vllm argv/env


def test_vllm_tp1_defaults(ckpt):
    cfg = make("vllm", ckpt)
    backend = backends.for_config(cfg)
    weights = backend.weights_command("m", cfg)
    assert weights.argv == [
        VLLM, "preload", "--model", ckpt, "--dtype", "auto", "--tensor-parallel-size", "1",
        "--weight-cache-socket-dir", f"{RUN}/vllm",
    ]
    engine = backend.engine_command("m", cfg)
    assert engine.argv == [
        VLLM, "serve", ckpt, "--served-model-name", "m", "--dtype", "auto", "--tensor-parallel-size", "1",
        "--load-format", "ipc_cache",
        "--model-loader-extra-config", json.dumps(
            {"fallback": False, "mode": "zero_copy", "socket_dir": f"{RUN}/vllm"}, sort_keys=True),
        "--uds", f"{RUN}/vllm-engine.sock", "--disable-uvicorn-access-log",
        "--gpu-memory-utilization", "0.9", "--shutdown-timeout", "60",
    ]
    assert weights.env == engine.env == {"HOSTD_VLLM": VLLM, "CUDA_VISIBLE_DEVICES": "0"}


def test_vllm_runs_without_its_access_log_unless_the_operator_turns_it_back_on(ckpt):
    """Issue 55: one journal line per request under the engine unit met
    journald's per-unit rate limit, which then dropped vLLM's errors too. The
    flag comes before the operator's arguments, and vLLM's parser keeps a
    flag's last value, so engine_extra_args turns it back on."""
    argv = backends.for_config(make("vllm", ckpt)).engine_command("m", make("vllm", ckpt)).argv
    assert "--disable-uvicorn-access-log" in argv
    cfg = make("vllm", ckpt, engine_extra_args=["--no-disable-uvicorn-access-log"])
    argv = backends.for_config(cfg).engine_command("m", cfg).argv
    assert argv.index("--no-disable-uvicorn-access-log") > argv.index("--disable-uvicorn-access-log")


def test_a_swaps_weight_daemon_and_its_engine_use_the_next_slots_socket_directory(ckpt):
    """A checkpoint swap's upstream daemon (weight slot next) keeps its
    sockets apart from the serving one's, which it would otherwise empty at
    its start; the swap's engine attaches there, the main engine and the
    standby stay on main's."""
    vllm = make("vllm", ckpt)
    backend = backends.for_config(vllm)
    argv = backend.weights_command("m", vllm, slot="next").argv
    assert argv[argv.index("--weight-cache-socket-dir") + 1] == f"{RUN}/next"
    loader = backend.engine_command("m", vllm, slot="next", bridge=backend.bridge(vllm), weights_slot="next").argv
    assert json.loads(loader[loader.index("--model-loader-extra-config") + 1])["socket_dir"] == f"{RUN}/next"
    for command in (backend.engine_command("m", vllm), backend.standby_command("m", vllm, backend.bridge(vllm))):
        argv = command.argv
        assert json.loads(argv[argv.index("--model-loader-extra-config") + 1])["socket_dir"] == f"{RUN}/vllm"
    sglang = make("sglang", ckpt)
    backend = backends.for_config(sglang)
    for command in (backend.weights_command("m", sglang, slot="next"),
                    backend.engine_command("m", sglang, port=1, slot="next", weights_slot="next")):
        assert command.env["SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"] == f"{RUN}/next/{{device_uuid}}.sock"
        assert command.env["SGLANG_WEIGHT_CACHE_READY_TEMPLATE"] == f"{RUN}/next/{{device_uuid}}.ready"
    assert backend.engine_command("m", sglang, port=1).env["SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"] == \
        f"{RUN}/sglang/{{device_uuid}}.sock"


def test_vllm_tp2_every_editable_field_and_quantization(ckpt):
    cfg = make(
        "vllm", ckpt, tensor_parallel_size=2, gpus=[2, 3], dtype="bfloat16", quantization="fp8",
        served_model_name="served", extra_args=["--trust-remote-code"],
        engine={"max_num_seqs": 16, "max_num_batched_tokens": 4096, "max_model_len": 2048,
                "gpu_memory_utilization": 0.8, "enforce_eager": True, "cudagraph_capture_sizes": [1, 2, 4],
                "max_cudagraph_capture_size": 4, "shutdown_timeout": 30},
    )
    backend = backends.for_config(cfg)
    assert backend.weights_command("m", cfg).argv == [
        VLLM, "preload", "--model", ckpt, "--dtype", "bfloat16", "--tensor-parallel-size", "2",
        "--quantization", "fp8", "--weight-cache-socket-dir", f"{RUN}/vllm", "--trust-remote-code",
    ]
    engine = backend.engine_command("m", cfg)
    assert engine.argv[engine.argv.index("--uds") + 2:] == [
        "--disable-uvicorn-access-log", "--max-num-seqs", "16", "--max-num-batched-tokens", "4096", "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.8", "--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "4",
        "--max-cudagraph-capture-size", "4", "--shutdown-timeout", "30", "--trust-remote-code",
    ]
    assert engine.argv[:12] == [
        VLLM, "serve", ckpt, "--served-model-name", "served", "--dtype", "bfloat16",
        "--tensor-parallel-size", "2", "--quantization", "fp8", "--load-format",
    ]
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert backend.drain_seconds(cfg) == 30


def test_vllm_argv_is_accepted_by_the_double(ckpt):
    """The double's parser is the upstream flag set hostd relies on: an
    unknown flag fails there as argparse fails in vLLM."""
    cfg = make("vllm", ckpt, engine={"max_num_seqs": 3, "enforce_eager": True, "cudagraph_capture_sizes": [8]})
    argv = backends.for_config(cfg).engine_command("m", cfg).argv
    bad = subprocess.run([*argv, "--no-such-flag"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr


def test_vllm_cache_root_under_the_shared_cache_directory(ckpt, monkeypatch):
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/hostd/m")
    cfg = make("vllm", ckpt)
    backend = backends.for_config(cfg)
    assert backend.weights_command("m", cfg).env["VLLM_CACHE_ROOT"] == "/var/cache/hostd/m/vllm"
    assert backend.engine_command("m", cfg).env["VLLM_CACHE_ROOT"] == "/var/cache/hostd/m/vllm"
    cfg = make("vllm", ckpt, env={"VLLM_CACHE_ROOT": "/srv/vllm"})
    assert backend.engine_command("m", cfg).env["VLLM_CACHE_ROOT"] == "/srv/vllm"


# ---------------------------------------------------------------- sglang argv/env


def test_sglang_tp1_defaults(ckpt, home):
    cfg = make("sglang", ckpt)
    backend = backends.for_config(cfg)
    weights = backend.weights_command("m", cfg)
    assert weights.argv == [
        PY, "-m", "sglang.srt.weight_cache.daemon", "--model-path", ckpt, "--dtype", "auto", "--tp-size", "1",
    ]
    engine = backend.engine_command("m", cfg, port=31000)
    assert engine.argv == [
        PY, "-m", "sglang.launch_server", "--model-path", ckpt, "--dtype", "auto", "--tp-size", "1",
        "--served-model-name", "m", "--host", "127.0.0.1", "--port", "31000", "--weight-cache-mode", "client",
        "--enable-metrics",
    ]
    expected_env = {
        "PYTHONPATH": SGLANG_PATH,
        "CUDA_VISIBLE_DEVICES": "0",
        "SGLANG_JIT_CACHE_DIR": str(home / ".cache/sglang/jit"),
        "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": f"{RUN}/sglang/{{device_uuid}}.sock",
        "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": f"{RUN}/sglang/{{device_uuid}}.ready",
    }
    assert weights.env == engine.env == expected_env


def test_sglang_tp2_every_editable_field(ckpt, home):
    cfg = make(
        "sglang", ckpt, tensor_parallel_size=2, gpus=[0, 1], quantization=None, dtype="float16",
        engine={"max_running_requests": 32, "max_prefill_tokens": 8192, "context_length": 4096,
                "chunked_prefill_size": -1, "mem_fraction_static": 0.7, "disable_decode_cuda_graph": True,
                "disable_prefill_cuda_graph": True,
                "cuda_graph_max_bs_decode": 16, "cuda_graph_max_bs_prefill": 4,
                "schedule_conservativeness": 1.5},
    )
    backend = backends.for_config(cfg)
    assert backend.weights_command("m", cfg).argv[3:] == [
        "--model-path", ckpt, "--dtype", "float16", "--tp-size", "2",
    ]
    engine = backend.engine_command("m", cfg, port=31001)
    assert engine.argv[engine.argv.index("--enable-metrics") + 1:] == [
        "--max-running-requests", "32", "--max-prefill-tokens", "8192", "--context-length", "4096",
        "--chunked-prefill-size", "-1", "--mem-fraction-static", "0.7", "--disable-decode-cuda-graph",
        "--disable-prefill-cuda-graph",
        "--cuda-graph-max-bs-decode", "16", "--cuda-graph-max-bs-prefill", "4",
        "--schedule-conservativeness", "1.5",
    ]
    assert engine.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    bad = subprocess.run([*engine.argv, "--no-such-flag"], capture_output=True, text=True,
                         env=systemd.child_env(engine.env), timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr


def _unwrapped(info):
    while isinstance(info, (msgspec.inspect.Metadata, msgspec.inspect.UnionType)):
        if isinstance(info, msgspec.inspect.Metadata):
            info = info.type
        else:
            info = next(t for t in info.types if not isinstance(t, msgspec.inspect.NoneType))
    return info


def _not_the_default(field) -> object:
    """A valid value of FIELD (a schema engine field) other than its default."""
    info = _unwrapped(field.type)
    if isinstance(info, msgspec.inspect.BoolType):
        return not field.default
    if isinstance(info, msgspec.inspect.ListType):
        return [2, 3]
    if isinstance(info, msgspec.inspect.IntType):
        return 3 if field.default != 3 else 4
    if isinstance(info, msgspec.inspect.FloatType):
        return 0.25 if field.default != 0.25 else 0.5
    raise AssertionError(f"engine.{field.name}: no sample value for {info}; extend this test")


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_every_engine_field_of_the_schema_reaches_upstreams_command_line(backend, ckpt, home):
    """EDITABLE_FLAGS is pinned to the schema's engine section: a field added
    to the schema alone would validate, be echoed back by the engine's /health
    (so verify passes) and report `done` without ever reaching upstream. Each
    field maps to the flag its schema description names (the configuration
    reference is generated from those), and a value other than the default
    changes the engine's command line at that flag."""
    module = {"vllm": vllm_backend, "sglang": sglang_backend}[backend]
    fields = msgspec.inspect.type_info(schema.ENGINE_TYPES[backend]).fields
    assert list(module.EDITABLE_FLAGS) == [f.name for f in fields], (
        f"{module.__name__}.EDITABLE_FLAGS and schema.{schema.ENGINE_TYPES[backend].__name__} differ: "
        f"only in the schema {sorted({f.name for f in fields} - set(module.EDITABLE_FLAGS))}, "
        f"only in the table {sorted(set(module.EDITABLE_FLAGS) - {f.name for f in fields})}")
    for field in fields:
        named = re.match(r"--[a-z0-9-]+", field.type.extra_json_schema["description"])
        assert named and named.group() == module.EDITABLE_FLAGS[field.name], field.name
    default = backends.for_config(make(backend, ckpt)).engine_command("m", make(backend, ckpt)).argv
    for field in fields:
        value = _not_the_default(field)
        cfg = make(backend, ckpt, engine={field.name: value})
        argv = backends.for_config(cfg).engine_command("m", cfg).argv
        flag = module.EDITABLE_FLAGS[field.name]
        assert argv != default and flag in argv, (field.name, value)


def test_sglang_templates_keep_device_uuid(ckpt, home):
    cfg = make("sglang", ckpt)
    env = backends.for_config(cfg).weights_command("m", cfg).env
    for name in ("SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE", "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"):
        assert "{device_uuid}" in env[name] and env[name].startswith(f"{RUN}/sglang/")


def test_sglang_drain_is_bounded_by_hostd(ckpt):
    cfg = make("sglang", ckpt, timeouts={"stop": 100})
    assert backends.for_config(cfg).drain_seconds(cfg) == 90


# ---------------------------------------------------------------- refusals

REFUSALS = [
    # (backend, config keys, text the message must contain)
    ("vllm", {"extra_args": ["--enable-lora"]}, "extra_args: --enable-lora is refused"),
    ("sglang", {"extra_args": ["--lora-paths=a"]}, "extra_args: --lora-paths is refused"),
    ("vllm", {"extra_args": ["--speculative-config", "{}"]}, "--speculative-config is refused"),
    ("sglang", {"extra_args": ["--speculative-algorithm", "EAGLE"]}, "--speculative-algorithm is refused"),
    ("vllm", {"extra_args": ["--enable-sleep-mode"]}, "--enable-sleep-mode is refused"),
    ("sglang", {"extra_args": ["--enable-memory-saver"]}, "--enable-memory-saver is refused"),
    ("vllm", {"extra_args": ["--cpu-offload-gb", "4"]}, "--cpu-offload-gb is refused"),
    ("sglang", {"extra_args": ["--cpu-offload-gb=4"]}, "--cpu-offload-gb is refused"),
    ("vllm", {"extra_args": ["--api-key", "sk-1"]}, "--api-key is refused: the manager's checks carry no key"),
    ("sglang", {"extra_args": ["--api-key=sk-1"]}, "set gateway.api_keys"),
    # Without the weight cache too: a key on the engine breaks every reload's check, cache or not.
    ("vllm", {"weight_cache": "off", "engine_extra_args": ["--api-key", "sk-1"]},
     "engine_extra_args: --api-key is refused: the manager's checks carry no key"),
    ("sglang", {"weight_cache": "off", "extra_args": ["--api-key", "sk-1"]}, "extra_args: --api-key is refused"),
    ("vllm", {"env": {"VLLM_API_KEY": "sk-1"}}, "env.VLLM_API_KEY: the manager's checks carry no key"),
    ("vllm", {"env": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}, "env.PYTORCH_CUDA_ALLOC_CONF"),
    ("sglang", {"env": {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}}, "env.PYTORCH_ALLOC_CONF"),
    ("vllm", {"pipeline_parallel_size": 2, "tensor_parallel_size": 1}, "pipeline_parallel_size: 2"),
    ("sglang", {"pipeline_parallel_size": 2}, "pipeline_parallel_size: 2"),
    ("vllm", {"tensor_parallel_size": 2, "gpus": [0]}, "tensor_parallel_size: 2 does not match"),
    ("sglang", {"tensor_parallel_size": 1, "gpus": [0, 1]}, "tensor_parallel_size: 1 does not match"),
    ("vllm", {"extra_args": ["--max-num-seqs", "4"]}, "extra_args: --max-num-seqs is the editable engine.max_num_seqs"),
    ("sglang", {"extra_args": ["--port", "1"]}, "extra_args: --port is set by hostd"),
    ("vllm", {"extra_args": ["--load-format", "auto"]}, "extra_args: --load-format is set by hostd"),
    ("vllm", {"env": {"HOSTD_VLLM": "/nonexistent/vllm"}}, "vllm: /nonexistent/vllm does not exist"),
    ("vllm", {"env": {"HOSTD_TEST_VLLM_VERSION": "0.30.2"}}, "vllm: version '0.30.2' is older than 0.32"),
    # PEP 440: a release candidate comes before its release (a regex read 0.32.0)
    ("vllm", {"env": {"HOSTD_TEST_VLLM_VERSION": "0.32.0rc1"}}, "vllm: version '0.32.0rc1' is older than 0.32"),
    ("sglang", {"env": {"PYTHONPATH": "/nonexistent"}}, "sglang's metadata failed"),
]


@pytest.mark.parametrize(("backend", "keys", "message"), REFUSALS, ids=[m for _, _, m in REFUSALS])
def test_refusal_names_the_setting(backend, keys, message, ckpt, home):
    cfg = make(backend, ckpt, **keys)
    backend_ = backends.for_config(cfg)
    problems = backend_.refusals(cfg) + backend_.install_refusals(cfg)
    assert any(message in p for p in problems), problems
    with pytest.raises(backends.BackendRefused, match="."):
        backends.for_config(cfg).check(cfg)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_gguf_is_refused(backend, tmp_path, ckpt, home):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cfg = make(backend, str(gguf))
    assert any("GGUF" in p and p.startswith("model:") for p in backends.for_config(cfg).refusals(cfg))


# ---------------------------------------------------------------- served without the weight cache

NOT_RETAINED = [
    # (backend, config keys, checkpoint quantization_config, words of the reason)
    ("vllm", {"quantization": "gptq"}, None, "quantization: 'gptq' is not verified for IPC sharing"),
    ("sglang", {"quantization": "awq"}, None, "quantization: 'awq' is not verified"),
    ("sglang", {"quantization": "fp8"}, None, "weight_block_size"),
    ("vllm", {}, {"quant_method": "gptq"}, "config.json quantization_config.quant_method): 'gptq'"),
    ("vllm", {"device": "cpu"}, None, "device: cpu; the vllm weight cache shares weights through CUDA IPC only"),
    ("sglang", {"device": "cpu"}, None, "device: cpu"),
    ("vllm", {"weight_cache": "off"}, None, "weight_cache: off"),
]


@pytest.mark.parametrize(("backend", "keys", "declared", "reason"), NOT_RETAINED, ids=[r for *_, r in NOT_RETAINED])
def test_without_the_weight_cache_the_engine_loads_from_disk(backend, keys, declared, reason, ckpt, home):
    if declared:
        (Path(ckpt) / "config.json").write_text(json.dumps({"quantization_config": declared}))
    cfg = make(backend, ckpt, **keys)
    b = backends.for_config(cfg)
    assert reason in b.weights_not_retained(cfg)
    assert b.refusals(cfg) == []
    engine = b.engine_command("m", cfg, port=1).argv
    assert "ipc_cache" not in engine and "--model-loader-extra-config" not in engine
    assert "--weight-cache-mode" not in engine
    if keys.get("device") == "cpu":
        assert "CUDA_VISIBLE_DEVICES" not in b.engine_command("m", cfg, port=1).env
        assert not b.uses_gpu(cfg)


def test_without_the_weight_cache_only_the_caches_refusals_are_lifted(ckpt):
    cfg = make("vllm", ckpt, device="cpu", extra_args=["--enable-lora"], engine_extra_args=["-dp", "2"])
    problems = backends.for_config(cfg).refusals(cfg)
    assert problems == ["engine_extra_args: --data-parallel-size is refused: hostd runs one replica per model"]
    cfg = make("vllm", ckpt, device="cpu", tensor_parallel_size=2)  # CPU: gpus: does not count
    assert backends.for_config(cfg).refusals(cfg) == []


def test_with_the_weight_cache_weights_are_retained(ckpt, home):
    for backend in ("vllm", "sglang"):
        cfg = make(backend, ckpt)
        assert backends.for_config(cfg).weights_not_retained(cfg) is None


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_supported_configs_have_no_refusals(backend, ckpt, home):
    cfg = make(backend, ckpt, tensor_parallel_size=2, gpus=[0, 1])
    assert backends.for_config(cfg).refusals(cfg) == []


def test_block_wise_fp8_is_accepted_by_sglang(ckpt, home):
    (Path(ckpt) / "config.json").write_text(json.dumps(
        {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    cfg = make("sglang", ckpt)
    assert backends.for_config(cfg).refusals(cfg) == []


# ---------------------------------------------------------------- SGLANG_JIT_CACHE_DIR


def jit_dir(cfg) -> str:
    return backends.for_config(cfg).weights_command("m", cfg).env["SGLANG_JIT_CACHE_DIR"]


def test_jit_cache_default_resolves_a_symlinked_home(ckpt, home):
    assert jit_dir(make("sglang", ckpt)) == str(home / ".cache/sglang/jit")


def test_jit_cache_empty_means_the_default(ckpt, home):
    assert jit_dir(make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": ""})) == str(home / ".cache/sglang/jit")


def test_jit_cache_tilde_expands_to_the_real_home(ckpt, home):
    assert jit_dir(make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": "~"})) == str(home)
    assert jit_dir(make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": "~/jit"})) == str(home / "jit")


def test_jit_cache_relative_path_is_made_absolute_and_real(ckpt, tmp_path, monkeypatch, home):
    real = tmp_path / "real-work"
    real.mkdir()
    (tmp_path / "work-link").symlink_to(real)
    monkeypatch.chdir(tmp_path / "work-link")
    monkeypatch.setenv("PWD", str(tmp_path / "work-link"))
    assert jit_dir(make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": "jit-cache"})) == str(real / "jit-cache")


def test_jit_cache_symlinked_root_with_a_missing_suffix(ckpt, tmp_path, home):
    real = tmp_path / "disk"
    real.mkdir()
    (tmp_path / "cache-link").symlink_to(real)
    value = str(tmp_path / "cache-link" / "sglang" / "jit")  # sglang/jit does not exist yet
    assert jit_dir(make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": value})) == str(real / "sglang" / "jit")


def test_jit_cache_from_hostds_environment_and_the_shared_cache_directory(ckpt, tmp_path, monkeypatch, home):
    real = tmp_path / "var-cache"
    real.mkdir()
    (tmp_path / "cache-link").symlink_to(real)
    monkeypatch.setenv("CACHE_DIRECTORY", str(tmp_path / "cache-link"))
    assert jit_dir(make("sglang", ckpt)) == str(real / "sglang/jit")
    monkeypatch.setenv("SGLANG_JIT_CACHE_DIR", str(tmp_path / "cache-link" / "mine"))
    assert jit_dir(make("sglang", ckpt)) == str(real / "mine")


def test_both_children_inherit_the_real_jit_path_through_a_symlink(ckpt, tmp_path, home):
    """A real child process, started the way the supervisors start theirs, sees
    the resolved path: no symlink anywhere in it, on every start."""
    real = tmp_path / "disk"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    cfg = make("sglang", ckpt, env={"SGLANG_JIT_CACHE_DIR": str(tmp_path / "link" / "jit")})
    backend = backends.for_config(cfg)
    probe = [sys.executable, "-c", "import os; print(os.environ['SGLANG_JIT_CACHE_DIR'])"]
    for _start in range(2):  # first start and a restart (reload) compute it afresh
        for command in (backend.weights_command("m", cfg), backend.engine_command("m", cfg, port=1)):
            seen = subprocess.run(probe, env=systemd.child_env(command.env), capture_output=True,
                                  text=True, check=True).stdout.strip()
            assert seen == str(real / "jit")
            assert os.path.realpath(seen) == seen


def test_canonical_dir_keeps_an_already_real_path():
    assert upstream.canonical_dir("/", sglang_backend.JIT_CACHE_DEFAULT) == "/"


def test_child_env_drops_systemds_per_process_variables(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("LISTEN_FDS", "1")
    env = systemd.child_env({"A": "1"})
    assert "NOTIFY_SOCKET" not in env and "LISTEN_FDS" not in env and env["A"] == "1"


# ---------------------------------------------------------------- issue 11: where hostd and upstream disagreed


def test_vllm_cuda_graph_capture_sizes_use_vllms_flags(ckpt):
    """No vLLM release has --cuda-graph-sizes (vllm serve exits 2 on it)."""
    cfg = make("vllm", ckpt, engine={"cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 8})
    argv = backends.for_config(cfg).engine_command("m", cfg).argv
    assert argv[argv.index("--cudagraph-capture-sizes"):][:3] == ["--cudagraph-capture-sizes", "1", "8"]
    assert argv[argv.index("--max-cudagraph-capture-size") + 1] == "8"
    assert not any(arg.startswith("--cuda-graph") for arg in argv)
    with pytest.raises(msgspec.ValidationError, match="cuda_graph_sizes"):
        make("vllm", ckpt, engine={"cuda_graph_sizes": [1]})


def test_vllm_frontend_flags_reach_the_engine_only(ckpt):
    """`vllm preload` takes engine flags only: frontend flags make it exit 2."""
    frontend = ["--chat-template", "/t.jinja", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    cfg = make("vllm", ckpt, extra_args=["--trust-remote-code"], engine_extra_args=frontend)
    backend = backends.for_config(cfg)
    assert backend.refusals(cfg) == []
    preload = backend.weights_command("m", cfg).argv
    serve = backend.engine_command("m", cfg).argv
    assert "--trust-remote-code" in preload and "--trust-remote-code" in serve
    assert not set(frontend) & set(preload)
    assert serve[-len(frontend):] == frontend


@pytest.mark.parametrize("flag", ["--chat-template=/t.jinja", "--tool_call_parser", "--enable-auto-tool-choice",
                                  "--api-key"])
def test_vllm_frontend_flag_in_extra_args_is_refused(flag, ckpt):
    cfg = make("vllm", ckpt, extra_args=[flag])
    problems = backends.for_config(cfg).refusals(cfg)
    assert any("vllm preload" in p and "engine_extra_args" in p for p in problems), problems


def test_vllm_older_than_032_is_refused_naming_the_version(ckpt):
    """vLLM 0.31 does not count daemon-held weights inside --gpu-memory-utilization."""
    cfg = make("vllm", ckpt, env={"HOSTD_TEST_VLLM_VERSION": "0.31.2"})
    problems = backends.for_config(cfg).install_refusals(cfg)
    assert any("'0.31.2'" in p and "0.32" in p and "--gpu-memory-utilization" in p for p in problems), problems
    cfg = make("vllm", ckpt, env={"HOSTD_TEST_VLLM_VERSION": "0.32.0"})
    assert backends.for_config(cfg).install_refusals(cfg) == []


def test_a_pip_console_scripts_version_is_read_from_its_interpreters_metadata(tmp_path):
    """vllm --version imports vLLM (about 20 s on a CPU, at every start of each
    unit); the script's own interpreter reads the installation's metadata. A
    script that is not a pip console script, or whose interpreter lacks the
    package, is asked --version."""
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\nimport sys; print('asked', sys.argv[1:])\n")
    script.chmod(0o755)
    argv = upstream.version_argv(str(script), "pytest")
    assert argv[:2] == [sys.executable, "-c"] and argv[-1] == str(script)
    assert subprocess.run(argv, capture_output=True, text=True).stdout.strip() == pytest.__version__
    missing = subprocess.run(upstream.version_argv(str(script), "no-such-package"), capture_output=True, text=True)
    assert missing.stdout.strip() == "asked ['--version']"
    script.write_text("#!/usr/bin/env python3\nprint('0.32.0')\n")
    assert upstream.version_argv(str(script), "vllm") == [str(script), "--version"]
    assert upstream.version_argv(str(tmp_path / "absent"), "vllm") == [str(tmp_path / "absent"), "--version"]


def test_sglang_engine_readiness_uses_ready_not_the_generating_health(ckpt):
    """SGLang's /health runs a one-token generation (up to 20 s); /ready does not."""
    cfg = make("sglang", ckpt)
    backend = backends.for_config(cfg)
    assert backend.health_path == "/ready"
    assert backends.for_config(make("vllm", ckpt)).health_path == "/health"


def test_vllm_socket_names_are_the_md5_of_the_gpu_uuid(ckpt):
    """vLLM's weight_cache/protocol.py: vllm_weight_cache_{md5(NVML UUID)}{role}.sock."""
    from hostd.backends import vllm as vllm_backend

    uuid = "GPU-12345678-1234-1234-1234-123456789abc"
    name = vllm_backend.socket_name(uuid)
    assert name == "vllm_weight_cache_" + __import__("hashlib").md5(uuid.encode()).hexdigest() + ".sock"
    cfg = make("vllm", ckpt)
    devices = backends.for_config(cfg).socket_devices(
        [name, vllm_backend.socket_name(uuid, draft=True), name + ".lock", "other.sock"], cfg)
    assert devices == ["md5:" + name[len("vllm_weight_cache_"):-len(".sock")]]


SPELLINGS = [
    # (backend, extra_args, text the refusal must contain): vLLM takes '_' for '-' and short aliases.
    ("vllm", ["--max_num_seqs", "4"], "--max-num-seqs is the editable engine.max_num_seqs"),
    ("vllm", ["--max_num_seqs=4"], "--max-num-seqs is the editable engine.max_num_seqs"),
    ("vllm", ["-q", "gptq"], "--quantization is set by hostd"),
    ("vllm", ["-qgptq"], "--quantization is set by hostd"),
    ("vllm", ["-dp", "2"], "--data-parallel-size is refused"),
    ("vllm", ["-dp=2"], "--data-parallel-size is refused"),
    ("vllm", ["-sc", "{}"], "--speculative-config is refused"),
    ("vllm", ["-tp", "2"], "--tensor-parallel-size is set by hostd"),
    ("vllm", ["--enable_lora"], "--enable-lora is refused"),
    ("vllm", ["--load_format=auto"], "--load-format is set by hostd"),
    ("sglang", ["--tp", "2"], "--tp-size is set by hostd"),
    ("sglang", ["--tensor-parallel-size", "2"], "--tp-size is set by hostd"),
    ("sglang", ["--dp", "2"], "--dp-size is refused"),
    ("sglang", ["--disable-cuda-graph"], "--disable-cuda-graph is refused: deprecated"),
]


@pytest.mark.parametrize(("backend", "args", "message"), SPELLINGS, ids=[" ".join(a) for _, a, _ in SPELLINGS])
def test_every_spelling_of_a_checked_flag_is_caught(backend, args, message, ckpt, home):
    for key in ("extra_args", "engine_extra_args"):
        cfg = make(backend, ckpt, **{key: args})
        problems = backends.for_config(cfg).refusals(cfg)
        assert any(p.startswith(key + ":") and message in p for p in problems), problems


def test_values_are_not_read_as_flags(ckpt):
    cfg = make("vllm", ckpt, extra_args=["--trust-remote-code", "--seed", "-1"],
               engine_extra_args=["--chat-template", "q.jinja"])
    assert backends.for_config(cfg).refusals(cfg) == []


@pytest.mark.parametrize("key", ["extra_args", "engine_extra_args"])
@pytest.mark.parametrize("cache", ["auto", "off"])
def test_sglang_custom_logit_processor_is_refused_with_or_without_the_cache(key, cache, ckpt):
    """With it a public request's `custom_logit_processor` is unpickled (dill)
    and run by the engine: remote code for every client."""
    cfg = make("sglang", ckpt, weight_cache=cache, **{key: ["--enable-custom-logit-processor"]})
    problems = backends.for_config(cfg).refusals(cfg)
    assert any("--enable-custom-logit-processor" in p and "dill" in p for p in problems), problems
