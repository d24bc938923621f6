"""Every command line hostd would run is given to upstream's own parser.

For a matrix of model configs (every editable field, extra_args and
engine_extra_args with frontend flags, quantization in and out of the weight
cache's allowlist, tensor parallel > 1, CPU), each command hostd builds —
`vllm preload`, `vllm serve`, SGLang's weight cache daemon and SGLang's
server, the overlap reload's bridge (the server in the next slot on its
own KV budget) and the standby (issue 35: the bridge's budget in the standby
slot, a command line no unit runs yet) — is parsed by the real vLLM 0.32.0 / SGLang 0.5.23 parser (vLLM's
subcommand validate() too) and must be accepted. Every flag hostd refuses,
owns or keeps editable, in every spelling upstream accepts ('_' for '-',
'=value', short aliases, prefixes), is accepted by upstream's parser and
refused by hostd before it gets there. hostd's flag tables (FRONTEND_FLAGS,
ALIASES) are checked against the real parsers, as is the flags fixture the
test doubles are built from (tests/upstream/flags/).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from hostd import backends
from hostd.backends import sglang as sglang_backend
from hostd.backends import upstream
from hostd.backends import vllm as vllm_backend
from hostd.config import schema

from upstream_envs import SGLANG_VERSION, VLLM_VERSION, flags_fixture, run_parser

# name: (backend, config keys)
CONFIGS = {
    "vllm-defaults": ("vllm", {}),
    "vllm-every-editable-field": ("vllm", {"engine": {
        "max_num_seqs": 16, "max_num_batched_tokens": 4096, "max_model_len": 2048,
        "gpu_memory_utilization": 0.8, "enforce_eager": True, "cudagraph_capture_sizes": [1, 2, 4, 8],
        "max_cudagraph_capture_size": 8, "shutdown_timeout": 30}}),
    "vllm-extra-and-frontend-args": ("vllm", {
        "extra_args": ["--trust-remote-code", "--seed", "7", "--max-logprobs=5"],
        # an inline template: vLLM's validate() opens a path-like one
        "engine_extra_args": ["--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}",
                              "--enable-auto-tool-choice",
                              "--tool-call-parser", "hermes", "--response-role=bot"]}),
    "vllm-fp8-in-the-cache": ("vllm", {"quantization": "fp8", "dtype": "bfloat16", "served_model_name": "served"}),
    "vllm-gptq-from-disk": ("vllm", {"quantization": "gptq"}),
    "vllm-tensor-parallel-2": ("vllm", {"tensor_parallel_size": 2, "gpus": [0, 1]}),
    "vllm-cpu": ("vllm", {"device": "cpu", "engine": {"max_num_seqs": 2, "gpu_memory_utilization": 0.05}}),
    "vllm-cache-off": ("vllm", {"weight_cache": "off", "engine_extra_args": ["--enable-lora"]}),
    "sglang-defaults": ("sglang", {}),
    "sglang-every-editable-field": ("sglang", {"engine": {
        "max_running_requests": 32, "max_prefill_tokens": 8192, "context_length": 4096,
        "chunked_prefill_size": -1, "mem_fraction_static": 0.7, "disable_decode_cuda_graph": True,
        "disable_prefill_cuda_graph": True, "cuda_graph_max_bs_decode": 16, "cuda_graph_max_bs_prefill": 4,
        "schedule_conservativeness": 1.5}}),
    "sglang-extra-and-frontend-args": ("sglang", {
        "extra_args": ["--trust-remote-code", "--random-seed", "7"],
        "engine_extra_args": ["--chat-template", "/etc/hostd/t.jinja", "--tool-call-parser", "qwen25"]}),
    "sglang-fp8-in-the-cache": ("sglang", {"quantization": "fp8", "dtype": "bfloat16"}),
    "sglang-awq-from-disk": ("sglang", {"quantization": "awq"}),
    "sglang-tensor-parallel-2": ("sglang", {"tensor_parallel_size": 2, "gpus": [0, 1]}),
    "sglang-cpu": ("sglang", {"device": "cpu"}),
}

# A value each checked flag takes (None: a switch).
VALUES = {
    "--lora-modules": "a=/srv/lora", "--speculative-config": '{"method": "ngram", "num_speculative_tokens": 1}',
    "--load-format": "auto", "--model-loader-extra-config": "{}", "--uds": "/run/x.sock", "--dtype": "auto",
    "--quantization": "fp8", "--served-model-name": "x", "--host": "127.0.0.1", "--port": "8001",
    "--gpu-memory-utilization": "0.5", "--speculative-algorithm": "EAGLE", "--weight-cache-mode": "off",
    "--lora-paths": "a=/srv/lora", "--mem-fraction-static": "0.5", "--schedule-conservativeness": "1.0",
    "--enable-lora": None, "--enable-sleep-mode": None, "--enforce-eager": None, "--enable-memory-saver": None,
    "--disable-cuda-graph": None, "--disable-decode-cuda-graph": None, "--disable-prefill-cuda-graph": None,
    "--enable-custom-logit-processor": None,
}


def checked_flags(module) -> list[str]:
    return sorted(set(module.REFUSED_FLAGS) | set(module.OWNED_FLAGS) | set(module.EDITABLE_FLAGS.values())
                  | set(upstream.COMMON_OWNED_FLAGS) | set(upstream.COMMON_REFUSED_FLAGS))


# (backend, a flag hostd refuses, owns or keeps editable, a value it takes):
# each is tried in every spelling upstream accepts.
CHECKED = [
    (backend, flag, VALUES.get(flag, "4"))
    for backend, module in (("vllm", vllm_backend), ("sglang", sglang_backend))
    for flag in checked_flags(module)
    # hostd's own flags that only exist in the other subcommand, and the
    # positional model: upstream's serve parser has no such option
    if flag not in ("--weight-cache-socket-dir", "--model", "--model-path", "--pipeline-parallel-size")
]


def spellings(backend: str, flag: str, value) -> list[list[str]]:
    """FLAG as upstream's parser takes it: as is, '=value', '_' for '-' (vLLM),
    its short aliases, an unambiguous prefix."""
    tail = [value] if value is not None else []
    out = [[flag, *tail]]
    if value is not None:
        out.append([f"{flag}={value}"])
    if backend == "vllm" and "-" in flag[2:]:
        out.append(["--" + flag[2:].replace("-", "_"), *tail])
    aliases = vllm_backend.ALIASES if backend == "vllm" else sglang_backend.ALIASES
    out += [[alias, *tail] for alias, long in aliases.items() if long == flag and not alias.startswith("--no-")]
    return out


def checkpoint(tmp: Path) -> str:
    path = tmp / "ckpt"
    path.mkdir(exist_ok=True)
    # The KV shape is what sizes SGLang's bridge (--max-total-tokens).
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256}))
    (path / "model.safetensors").write_bytes(b"x")
    return str(path)


def model_config(backend: str, keys: dict, ckpt: str, vllm_env: Path, sglang_env: Path):
    env = {"HOSTD_VLLM": str(vllm_env / "bin" / "vllm"), "HOSTD_SGLANG_PYTHON": str(sglang_env / "bin" / "python")}
    return msgspec.convert({"backend": backend, "model": ckpt, "env": env, **keys}, schema.MODEL_TYPES[backend])


def commands(cfg) -> list[tuple[str, list[str]]]:
    """(what, argv without the program) for every command hostd would run for CFG."""
    b = backends.for_config(cfg)
    out = []
    if b.retains_weights(cfg):
        argv = b.weights_command("m", cfg).argv
        out.append(("weights", argv[1:] if cfg.backend == "vllm" else argv[3:]))
    argv = b.engine_command("m", cfg, port=31000).argv
    out.append(("engine", argv[1:] if cfg.backend == "vllm" else argv[3:]))
    argv = b.engine_command("m", cfg, port=31001, slot="next", bridge=bridge_of(cfg)).argv
    assert set(b.bridge_args(cfg, bridge_of(cfg))) <= set(argv), "the bridge's own budget is on its command line"
    out.append(("bridge", argv[1:] if cfg.backend == "vllm" else argv[3:]))
    argv = b.standby_command("m", cfg, bridge_of(cfg), port=31002).argv
    assert argv[-len(b.bridge_args(cfg, bridge_of(cfg))):] == b.bridge_args(cfg, bridge_of(cfg)), \
        "the standby's budget comes last, where the parser keeps it"
    out.append(("standby", argv[1:] if cfg.backend == "vllm" else argv[3:]))
    return out


def bridge_of(cfg) -> upstream.Bridge:
    """The overlap reload's bridge budget as the next slot computes it, on an
    80 GiB GPU holding 14 GiB of weights (on CPU: no GPU total)."""
    gpu = cfg.device == "cuda"
    return upstream.Bridge(cfg.reload.bridge_kv_mib << 20, 80 << 30 if gpu else None, 14 << 30 if gpu else 0)


def test_every_case_has_a_bridge_command_line_with_its_kv_budget(tmp_path):
    """The matrix covers the bridge with and without the weight cache, TP 1
    and 2, GPU and CPU, and each bridge carries its KV flag."""
    ckpt = checkpoint(tmp_path)
    seen = set()
    for case, (backend, config) in CONFIGS.items():
        cfg = msgspec.convert({"backend": backend, "model": ckpt, **config}, schema.MODEL_TYPES[backend])
        b = backends.for_config(cfg)
        argv = dict(commands(cfg))["bridge"]
        assert ("--kv-cache-memory-bytes" if backend == "vllm" else "--max-total-tokens") in argv, case
        seen.add((backend, b.retains_weights(cfg), cfg.tensor_parallel_size, cfg.device))
    for backend in ("vllm", "sglang"):
        assert {(backend, True, 1, "cuda"), (backend, True, 2, "cuda"), (backend, False, 1, "cpu")} <= seen
    assert ("vllm", False, 1, "cuda") in seen  # weight_cache: off, and gptq from disk


def test_the_tensor_parallel_cases_give_the_parsers_tp_2_in_every_command(tmp_path):
    """What the real parsers are given for `tensor_parallel_size: 2` (issue
    39): the weight cache, the engine, the overlap reload's bridge and the
    standby (issue 35) each carry TP 2 as the one value of upstream's flag. Only parsed here: no TP 2
    engine has run (docs/vllm.md, Tensor parallel)."""
    ckpt = checkpoint(tmp_path)
    for case, flag in (("vllm-tensor-parallel-2", "--tensor-parallel-size"), ("sglang-tensor-parallel-2", "--tp-size")):
        backend, config = CONFIGS[case]
        cfg = msgspec.convert({"backend": backend, "model": ckpt, **config}, schema.MODEL_TYPES[backend])
        built = dict(commands(cfg))
        assert set(built) == {"weights", "engine", "bridge", "standby"}, case
        for what, argv in built.items():
            values = [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]
            assert values == ["2"], (case, what, argv)


def test_every_case_has_a_standby_command_line_with_the_bridges_budget(tmp_path):
    """The matrix covers the standby with and without the weight cache, TP 1
    and 2; each standby has the main engine's weight-cache attach, the
    bridge's KV flag and an upstream socket or port of its own."""
    ckpt = checkpoint(tmp_path)
    seen = set()
    for case, (backend, config) in CONFIGS.items():
        cfg = msgspec.convert({"backend": backend, "model": ckpt, **config}, schema.MODEL_TYPES[backend])
        b = backends.for_config(cfg)
        lines = dict(commands(cfg))
        standby, engine = lines["standby"], lines["engine"]
        assert ("--kv-cache-memory-bytes" if backend == "vllm" else "--max-total-tokens") in standby, case
        attach = ("--load-format", "--model-loader-extra-config") if backend == "vllm" else ("--weight-cache-mode",)
        for flag in attach:
            assert (flag in standby) == (flag in engine) == b.retains_weights(cfg), (case, flag)
            if flag in engine:
                assert standby[standby.index(flag) + 1] == engine[engine.index(flag) + 1], (case, flag)
        own = "--uds" if backend == "vllm" else "--port"
        assert len({line[line.index(own) + 1] for line in lines.values() if own in line}) == len(
            [line for line in lines.values() if own in line]), case
        seen.add((backend, b.retains_weights(cfg), cfg.tensor_parallel_size))
    for backend in ("vllm", "sglang"):
        assert {(backend, True, 1), (backend, True, 2), (backend, False, 1)} <= seen


def upstream_request(backend: str, what: str, argv: list[str]):
    if backend == "vllm":
        return argv
    return {"kind": "daemon" if what == "weights" else "server", "argv": argv}


@pytest.fixture(scope="module")
def answers(tmp_path_factory, vllm_env, sglang_env) -> dict:
    """{(case, what): upstream's answer}: one run of each real parser."""
    ckpt = checkpoint(tmp_path_factory.mktemp("contract"))
    asked: dict[str, list] = {"vllm": [], "sglang": []}
    keys: dict[str, list] = {"vllm": [], "sglang": []}
    for case, (backend, config) in CONFIGS.items():
        cfg = model_config(backend, config, ckpt, vllm_env, sglang_env)
        assert backends.for_config(cfg).refusals(cfg) == [], (case, backends.for_config(cfg).refusals(cfg))
        for what, argv in commands(cfg):
            asked[backend].append(upstream_request(backend, what, argv))
            keys[backend].append((case, what, tuple(argv)))
    for index, (backend, flag, value) in enumerate(CHECKED):
        for n, spelled in enumerate(spellings(backend, flag, value)):
            base = ["serve", ckpt] if backend == "vllm" else ["--model-path", ckpt]
            request = upstream_request(backend, "engine", [*base, *spelled])
            asked[backend].append(request)
            keys[backend].append((f"checked-{index}-{n}", "engine", tuple(spelled)))
    result = {}
    result.update(zip(keys["vllm"], run_parser(vllm_env / "bin" / "python", "vllm_parser.py", asked["vllm"])))
    result.update(zip(keys["sglang"], run_parser(sglang_env / "bin" / "python", "sglang_parser.py", asked["sglang"])))
    return {"answers": result, "ckpt": ckpt}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_command_hostd_runs_is_accepted_by_upstreams_parser(case, answers):
    mine = {k: v for k, v in answers["answers"].items() if k[0] == case}
    assert mine, case
    for (_, what, argv), answer in mine.items():
        assert answer["ok"], f"{case} {what}: upstream refuses {' '.join(argv)}: {answer}"


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_standby_command_line_is_accepted_by_upstreams_parser(case, answers):
    """The standby's own lines, selectable with `-k standby`: vLLM 0.32's
    parser and validate(), SGLang 0.5.23's server parser."""
    mine = {k: v for k, v in answers["answers"].items() if k[0] == case and k[1] == "standby"}
    assert len(mine) == 1, case
    for (_, _, argv), answer in mine.items():
        assert answer["ok"], f"{case} standby: upstream refuses {' '.join(argv)}: {answer}"


@pytest.mark.parametrize(("backend", "flag", "value"), CHECKED, ids=[f"{b}{f}" for b, f, _ in CHECKED])
def test_each_checked_flag_in_each_spelling_is_refused_by_hostd_first(backend, flag, value, answers,
                                                                       vllm_env, sglang_env):
    index = CHECKED.index((backend, flag, value))
    spelled_all = {k: v for k, v in answers["answers"].items() if k[0].startswith(f"checked-{index}-")}
    assert spelled_all
    accepted = 0
    for (_, _, spelled), answer in spelled_all.items():
        cfg = model_config(backend, {"engine_extra_args": list(spelled)}, answers["ckpt"], vllm_env, sglang_env)
        problems = backends.for_config(cfg).refusals(cfg)
        assert any(p.startswith("engine_extra_args:") for p in problems), (spelled, problems)
        accepted += answer["ok"]
    # Upstream takes the flag itself; hostd refused it in every spelling above.
    assert accepted, f"upstream's parser accepts no spelling of {flag}: {spelled_all}"


# ---------------------------------------------------------------- hostd's tables against the real parsers


@pytest.fixture(scope="module")
def live_vllm_flags(vllm_env) -> dict:
    import subprocess

    out = subprocess.run([str(vllm_env / "bin" / "python"), str(Path(__file__).parent / "vllm_parser.py"), "--dump"],
                         capture_output=True, text=True, timeout=900, check=True, cwd="/").stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def live_sglang_flags(sglang_env) -> dict:
    import subprocess

    out = subprocess.run([str(sglang_env / "bin" / "python"), str(Path(__file__).parent / "sglang_parser.py"), "--dump"],
                         capture_output=True, text=True, timeout=900, check=True, cwd="/").stdout
    return json.loads(out)


def test_the_flags_fixtures_are_what_the_real_parsers_say(live_vllm_flags, live_sglang_flags):
    """tests/upstream/flags/ (which the doubles are built from) is the output of
    tests/upstream/generate_flags.py for the installed versions."""
    assert flags_fixture(f"vllm-{VLLM_VERSION}") == live_vllm_flags
    assert flags_fixture(f"sglang-{SGLANG_VERSION}") == live_sglang_flags


@pytest.mark.parametrize("version", ["0.32.0"])
def test_frontend_flags_are_serves_flags_that_preload_lacks(version):
    flags = flags_fixture(f"vllm-{version}")["flags"]
    preload_dests = {v["dest"] for v in flags["preload"].values()}
    frontend = {o for o, v in flags["serve"].items() if v["dest"] not in preload_dests and o.startswith("--")}
    assert vllm_backend.FRONTEND_FLAGS == frontend


@pytest.mark.parametrize(("name", "module", "subcommands"), [
    (f"vllm-{VLLM_VERSION}", vllm_backend, ("serve", "preload")),
    (f"sglang-{SGLANG_VERSION}", sglang_backend, ("launch_server", "weight_cache.daemon")),
])
def test_hostd_reads_every_upstream_flag_as_upstream_does(name, module, subcommands):
    """Every option string of the real parser that sets the same field as a
    flag hostd checks is caught, and no other option string is."""
    flags = flags_fixture(name)["flags"]
    checked = set(checked_flags(module))
    for sub in subcommands:
        options = flags[sub]
        dests = {options[c]["dest"] for c in checked if c in options}
        for option, spec in options.items():
            hit = upstream.has_flag([option], *sorted(checked), aliases=module.ALIASES)
            assert bool(hit) == (spec["dest"] in dests), (sub, option, spec["dest"], hit)


# ---------------------------------------------------------------- the doubles' value refusals against the real parsers


def test_the_values_the_doubles_refuse_are_refused_by_upstreams_parsers(vllm_env, sglang_env):
    """Every command line tests/unit/test_doubles_follow_upstream.py shows a
    double refusing (exit 2) is refused by the real parser too, with exit 2."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    try:
        from test_doubles_follow_upstream import VALUE_REFUSALS
    finally:
        sys.path.pop(0)
    vllm_lines = [argv for double, argv, _ in VALUE_REFUSALS if double == "vllm"]
    sglang_lines = [{"kind": "daemon" if double.endswith("daemon") else "server", "argv": argv}
                    for double, argv, _ in VALUE_REFUSALS if double != "vllm"]
    answers = run_parser(vllm_env / "bin" / "python", "vllm_parser.py", vllm_lines) + \
        run_parser(sglang_env / "bin" / "python", "sglang_parser.py", sglang_lines)
    for line, answer in zip(vllm_lines + sglang_lines, answers):
        assert not answer["ok"] and answer["code"] == 2, (line, answer)

