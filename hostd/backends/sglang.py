"""The sglang backend: SGLang's weight cache daemon and a client-mode server.

One job: say, for one model config, which upstream commands hostd's weights
and engine supervisors run as children (hostd/weights/upstream.py,
hostd/engine/upstream.py), and what SGLang cannot do with its weight cache.
The daemon dies with its parent (PR_SET_PDEATHSIG), so hostd's supervisor stays
its parent for its whole life. SGLANG_JIT_CACHE_DIR is canonicalized here,
for both children, on every start: a symlink in its path makes SGLang 0.5.21
record staging paths as dependencies and recompile on every start.
Flags checked against SGLang's sources and docs (docs/sglang.md says which).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

from hostd import paths
from hostd.backends import upstream
from hostd.backends.base import Command

MINIMUM_VERSION = (0, 5, 21)  # the standalone weight cache daemon (Xinference's floor too)

JIT_CACHE_VARIABLE = "SGLANG_JIT_CACHE_DIR"
JIT_CACHE_DEFAULT = "~/.cache/sglang/jit"  # SGLang's own default
SOCKET_TEMPLATE_VARIABLE = "SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE"
READY_TEMPLATE_VARIABLE = "SGLANG_WEIGHT_CACHE_READY_TEMPLATE"

DEVICE_UUID = re.compile(r"^((?:GPU|MIG)-[0-9a-fA-F-]{36})\.sock$")

# Quantization SGLang's daemon can share: unquantized, and fp8 only block-wise
# (per-tensor fp8 is repacked after loading, which tensor export cannot carry).
QUANTIZATION_ALLOWLIST: dict[Optional[str], str] = {
    None: "unquantized weights are exported as loaded",
    "fp8": "block-wise fp8 only (checked against config.json weight_block_size)",
}

# Editable engine key -> SGLang flag (DESIGN.md §2): one entry per field of
# schema.SglangEngine, the flag its description names, in its order (the argv's).
# tests/unit/test_upstream_backends.py pins it: a field in the schema alone would
# validate, be echoed by the engine's /health, verify and report done without
# ever reaching SGLang.
EDITABLE_FLAGS = {
    "max_running_requests": "--max-running-requests",
    "max_prefill_tokens": "--max-prefill-tokens",
    "context_length": "--context-length",
    "chunked_prefill_size": "--chunked-prefill-size",
    "mem_fraction_static": "--mem-fraction-static",
    # --disable-cuda-graph is deprecated in 0.5.23 in favour of these two.
    "disable_decode_cuda_graph": "--disable-decode-cuda-graph",
    "disable_prefill_cuda_graph": "--disable-prefill-cuda-graph",
    "cuda_graph_max_bs_decode": "--cuda-graph-max-bs-decode",
    "cuda_graph_max_bs_prefill": "--cuda-graph-max-bs-prefill",
    "schedule_conservativeness": "--schedule-conservativeness",
}

# Refused whether or not the weight cache holds the weights.
REPLICA_FLAGS = {
    "--dp-size": "hostd runs one replica per model (data parallelism is refused by the cache)",
    "--nnodes": "the weight cache under hostd is single-node",
    "--disable-cuda-graph": "deprecated in SGLang 0.5.23; set engine.disable_decode_cuda_graph and "
    "engine.disable_prefill_cuda_graph instead (a reload can change them)",
    # sglang/srt/sampling/custom_logit_processor.py (0.5.23) dill.loads() the
    # `custom_logit_processor` of a public request once this flag is on: any
    # client of the model would run code as the model's user.
    "--enable-custom-logit-processor": "it lets every client of the model ship a callable the engine "
    "unpickles and runs (dill); hostd serves the endpoint to the network",
}

# Refused while the weight cache holds the weights.
REFUSED_FLAGS = {
    "--enable-lora": "LoRA adapters change weights the engine does not own",
    "--lora-paths": "LoRA adapters change weights the engine does not own",
    "--speculative-algorithm": "SGLang refuses speculative decoding with the weight cache",
    "--speculative-draft-model-path": "SGLang refuses speculative decoding with the weight cache",
    "--enable-memory-saver": "sleep mode releases weights that live in the daemon",
    "--cpu-offload-gb": "CPU weight offload moves weights out of the daemon's GPU allocations",
    **REPLICA_FLAGS,
}

# Other names SGLang's parser declares for a flag hostd checks (0.5.23; the
# contract tests check this table against the real parser). Abbreviations
# such as --tp (argparse's prefix matching) are caught by upstream.has_flag.
ALIASES = {
    "--tensor-parallel-size": "--tp-size",
    "--pipeline-parallel-size": "--pp-size",
    "--data-parallel-size": "--dp-size",
    "--model": "--model-path",
}

OWNED_FLAGS = {
    "--model-path": "model",
    "--tp-size": "tensor_parallel_size",
    "--pp-size": "pipeline_parallel_size",
    "--weight-cache-mode": "the backend (client, fixed)",
    "--weight-cache-socket": "the private runtime directory",
}


class SglangBackend(upstream.UpstreamBackend):
    name = "sglang"
    QUANTIZATION_ALLOWLIST = QUANTIZATION_ALLOWLIST
    FP8_BLOCK_ONLY = True
    writes_ready_files = True
    # SGLang refuses an input of --context-length tokens or more
    # (sglang/srt/managers/tokenizer_manager.py:1338, 0.5.23): the one
    # editable key that changes which requests a standby accepts.
    standby_answer_keys = frozenset({"context_length"})
    # SGLang's /health runs a one-token generation and may take up to
    # SGLANG_HEALTH_CHECK_TIMEOUT (20 s) to answer; /ready (0.5.21+) answers at
    # once: 200 when started, not paused and not shutting down.
    health_path = "/ready"
    # SGLang's HTTP server (sglang/srt/entrypoints/http_server.py): native
    # /generate, the OpenAI API, embeddings, rerank, score, classify,
    # tokenizer and model info. Never public: /health, /health_generate,
    # /metrics (served by the gateway), /get_server_info (server args),
    # /flush_cache, every /update_weights_* and weights route,
    # /release_memory_occupation, /resume_memory_occupation, profiling,
    # /configure_logging, /abort_request, /pause_generation,
    # /continue_generation, /set_internal_state.
    public_routes = (
        ("POST", "/generate"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/embeddings"),
        ("POST", "/encode"),
        ("POST", "/classify"),
        ("POST", "/v1/rerank"),
        ("POST", "/v1/score"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/models"),
        ("GET", "/get_model_info"),
    )
    metrics_prefixes = ("sglang:",)
    # SGLang 0.5.23's words as it starts (site-packages/sglang/srt/...):
    # model_executor/model_runner.py:1274 and :1373, mem_cache/kv_cache_configurator.py:499,
    # model_executor/model_runner_components/cuda_graph_setup.py:685 and :759.
    phase_lines = tuple(re.compile(p) for p in (
        r"Load weight begin", r"Load weight end", r"Memory pool end", r"Capture \S.* begin\."))
    upstream_package = "sglang"

    def python(self, cfg) -> str:
        """The Python that has sglang: $HOSTD_SGLANG_PYTHON, else hostd's own."""
        return upstream.effective_env(cfg).get("HOSTD_SGLANG_PYTHON") or sys.executable

    def _layout_args(self, cfg) -> list[str]:
        args = ["--model-path", cfg.model, "--dtype", cfg.dtype, "--tp-size", str(cfg.tensor_parallel_size)]
        if cfg.quantization:
            args += ["--quantization", cfg.quantization]
        return args

    def socket_dir(self, model: str, slot: str = "main") -> Path:
        return paths.upstream_socket_dir(model, paths.SGLANG_SOCKET_DIR, slot)

    def jit_cache_dir(self, cfg) -> str:
        """SGLANG_JIT_CACHE_DIR as a real absolute path: the model's env:, else
        hostd's environment, else the shared CacheDirectory, else SGLang's default."""
        env = upstream.effective_env(cfg)
        value = env.get(JIT_CACHE_VARIABLE) or upstream.cache_defaults(
            cfg, {JIT_CACHE_VARIABLE: "sglang/jit"}
        ).get(JIT_CACHE_VARIABLE)
        return upstream.canonical_dir(value, JIT_CACHE_DEFAULT)

    def _env(self, model: str, cfg, weights_slot: str = "main") -> dict[str, str]:
        """WEIGHTS_SLOT: the daemon whose sockets these templates name (the
        daemon's own, or the one a client-mode server attaches)."""
        directory = self.socket_dir(model, weights_slot)
        return {
            **cfg.env,
            **upstream.gpu_env(cfg),
            **upstream.cache_defaults(cfg, {"TRITON_CACHE_DIR": "triton"}),
            JIT_CACHE_VARIABLE: self.jit_cache_dir(cfg),
            SOCKET_TEMPLATE_VARIABLE: f"{directory}/{{device_uuid}}.sock",
            READY_TEMPLATE_VARIABLE: f"{directory}/{{device_uuid}}.ready",
        }

    def weights_command(self, model: str, cfg, slot: str = "main") -> Command:
        argv = [
            self.python(cfg), "-m", "sglang.srt.weight_cache.daemon",
            *self._layout_args(cfg),
            *cfg.extra_args,
        ]
        return Command(argv, self._env(model, cfg, slot))

    def engine_command(self, model: str, cfg, port: int = 0, slot: str = "main",
                       bridge: Optional[upstream.Bridge] = None, weights_slot: str = "main") -> Command:
        """PORT: the private loopback port hostd's engine supervisor of SLOT
        picked (one per engine, so two slots never share one). BRIDGE's flags
        come last: argparse keeps a flag's last value."""
        argv = [
            self.python(cfg), "-m", "sglang.launch_server",
            *self._layout_args(cfg),
            "--served-model-name", cfg.served_model_name or model,
            "--host", "127.0.0.1",
            "--port", str(port),
            *(["--weight-cache-mode", "client"] if self.retains_weights(cfg) else []),
            "--enable-metrics",  # sglang:* on /metrics, passed on by the gateway
            *upstream.editable_args(cfg.engine, EDITABLE_FLAGS),
            *cfg.extra_args,
            *cfg.engine_extra_args,
            *(self.bridge_args(cfg, bridge) if bridge is not None else []),
        ]
        return Command(argv, self._env(model, cfg, weights_slot))

    def bridge_args(self, cfg, bridge: upstream.Bridge) -> list[str]:
        """--max-total-tokens: the KV budget in tokens (reload.bridge_kv_mib over
        the model's KV bytes per token on one rank). SGLang 0.5.23 sizes its
        pool from the memory free when it starts less mem_fraction_static's
        slack (sglang/srt/mem_cache/kv_cache_configurator.py:2990-3060), so
        beside a serving engine the fraction already applies to what is left,
        and --max-total-tokens caps the pool (same file, 3096-3105); a reduced
        --mem-fraction-static would only grow the slack it leaves unused."""
        per_token = upstream.kv_bytes_per_token(cfg)
        return ["--max-total-tokens", str(max(1, bridge.kv_bytes // per_token))] if per_token else []

    def overlap_refusal(self, cfg) -> Optional[str]:
        problem = upstream.kv_size_problem(cfg)
        if problem is not None:
            return f"model: {problem}; so hostd cannot size the bridge engine's --max-total-tokens"
        return None

    def refusals(self, cfg) -> list[str]:
        retained = self.retains_weights(cfg)  # reads the checkpoint's config.json: once
        problems = upstream.common_refusals(
            cfg,
            owned_flags=OWNED_FLAGS,
            refused_flags=REFUSED_FLAGS if retained else REPLICA_FLAGS,
            editable_flags={flag: key for key, flag in EDITABLE_FLAGS.items()},
            aliases=ALIASES,
            retained=retained,
        )
        for variable in (SOCKET_TEMPLATE_VARIABLE, READY_TEMPLATE_VARIABLE):
            if variable in cfg.env:
                problems.append(
                    f"env.{variable}: hostd sets it to the private runtime directory "
                    "(/run/hostd/NAME/sglang/{device_uuid}...); remove it"
                )
        return problems

    def version_argv(self, cfg) -> list[str]:
        return [self.python(cfg), "-c", "import importlib.metadata as m; print(m.version('sglang'))"]

    def install_refusals(self, cfg) -> list[str]:
        problem = upstream.version_refusal(
            "sglang", self.version_argv(cfg), upstream.effective_env(cfg), MINIMUM_VERSION,
            "install SGLang >= 0.5.21 into that Python, or point env.HOSTD_SGLANG_PYTHON at one",
        )
        return [problem] if problem else []

    memory_fraction_key = "mem_fraction_static"

    def memory_fraction(self, cfg) -> Optional[float]:
        return cfg.engine.mem_fraction_static

    def socket_devices(self, names: list[str], cfg) -> list[str]:
        """The GPUs behind upstream socket NAMES: hostd's template names each
        socket {device_uuid}.sock, SGLang's device UUID ('GPU-...' or 'MIG-...')."""
        return sorted(m.group(1) for name in names if (m := DEVICE_UUID.match(name)))

    def drain_seconds(self, cfg) -> float:
        """SGLang's SIGTERM drain has no limit of its own: hostd allows the
        unit's stop timeout minus a margin to kill it, then kills it."""
        return max(1.0, float(cfg.timeouts.stop) - 10.0)
