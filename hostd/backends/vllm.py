"""The vllm backend: `vllm preload` holds the weights, `vllm serve` runs on them.

One job: say, for one model config, which upstream commands hostd's weights and
engine supervisors run as children (hostd/weights/upstream.py,
hostd/engine/upstream.py), and what vLLM cannot do with its weight cache.
Flags checked against vLLM's sources and docs (docs/vllm.md says which).
"""

from __future__ import annotations

import json
from typing import Optional

from pathlib import Path

from hostd import paths
from hostd.backends import upstream
from hostd.backends.base import Command

MINIMUM_VERSION = (0, 31)  # `vllm preload` and --load-format ipc_cache appeared in 0.31.0

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

# Editable engine key -> vLLM flag (DESIGN.md §2).
EDITABLE_FLAGS = {
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enforce_eager": "--enforce-eager",
    "cuda_graph_sizes": "--cuda-graph-sizes",
    "shutdown_timeout": "--shutdown-timeout",
}

# Flags refused in extra_args, with the reason upstream or hostd cannot serve them.
REFUSED_FLAGS = {
    "--enable-lora": "LoRA adapters are applied to weights the engine does not own in zero_copy mode",
    "--lora-modules": "LoRA adapters are applied to weights the engine does not own in zero_copy mode",
    "--speculative-config": "speculative decoding adds draft daemons hostd does not supervise",
    "--enable-sleep-mode": "sleep mode offloads weights, and zero_copy weights live in the daemon",
    "--cpu-offload-gb": "CPU weight offload moves weights out of the daemon's GPU allocations",
    "--data-parallel-size": "hostd runs one replica per model",
}

# Flags hostd sets itself (see upstream.COMMON_OWNED_FLAGS for the shared ones).
OWNED_FLAGS = {
    "--model": "model",
    "--load-format": "the backend (ipc_cache, fixed)",
    "--model-loader-extra-config": "the backend (socket_dir, zero_copy, no fallback)",
    "--uds": "the engine socket /run/hostd/NAME/engine.sock",
    "--weight-cache-socket-dir": "the private runtime directory",
    "-tp": "tensor_parallel_size",
    "-pp": "pipeline_parallel_size",
}


class VllmBackend(upstream.UpstreamBackend):
    name = "vllm"
    stop_grace_seconds = 10.0  # vLLM honours its own --shutdown-timeout

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

    def socket_dir(self, model: str) -> Path:
        return paths.runtime_dir(model) / paths.VLLM_SOCKET_DIR

    def engine_socket(self, model: str) -> Path:
        """Where `vllm serve --uds` listens; engine.sock is hostd's proxy in front of it."""
        return paths.runtime_dir(model) / "vllm-engine.sock"

    def weights_command(self, model: str, cfg) -> Command:
        argv = [
            self.executable(cfg), "preload",
            "--model", cfg.model,
            *self._layout_args(cfg),
            "--weight-cache-socket-dir", str(self.socket_dir(model)),
            *cfg.extra_args,
        ]
        return Command(argv, self._env(cfg))

    def engine_command(self, model: str, cfg, port: int = 0) -> Command:
        """PORT is unused: `vllm serve` listens on engine_socket()."""
        extra_config = {"mode": "zero_copy", "fallback": False, "socket_dir": str(self.socket_dir(model))}
        argv = [
            self.executable(cfg), "serve", cfg.model,
            "--served-model-name", cfg.served_model_name or model,
            *self._layout_args(cfg),
            "--load-format", "ipc_cache",
            "--model-loader-extra-config", json.dumps(extra_config, sort_keys=True),
            "--uds", str(self.engine_socket(model)),
            *self.editable_args(cfg.engine),
            *cfg.extra_args,
        ]
        return Command(argv, self._env(cfg))

    @staticmethod
    def editable_args(engine) -> list[str]:
        args: list[str] = []
        for key, flag in EDITABLE_FLAGS.items():
            value = getattr(engine, key)
            if value is None or value is False:
                continue
            if value is True:
                args.append(flag)
            elif isinstance(value, list):
                args += [flag, *(str(v) for v in value)]
            else:
                args += [flag, str(value)]
        return args

    def refusals(self, cfg) -> list[str]:
        problems = upstream.common_refusals(
            cfg,
            owned_flags=OWNED_FLAGS,
            refused_flags=REFUSED_FLAGS,
            editable_flags={flag: key for key, flag in EDITABLE_FLAGS.items()},
        )
        problems += upstream.quantization_refusals(cfg, QUANTIZATION_ALLOWLIST, check_fp8_block=False)
        env = upstream.effective_env(cfg)
        exe = self.executable(cfg)
        problem = upstream.version_refusal(
            "vllm", [exe, "--version"], env, MINIMUM_VERSION,
            "install vLLM >= 0.31 for the hostd user, or point env.HOSTD_VLLM at its `vllm`",
        )
        if problem:
            problems.append(problem)
        return problems

    def memory_fraction(self, cfg) -> float:
        return cfg.engine.gpu_memory_utilization

    def drain_seconds(self, cfg) -> float:
        return float(cfg.engine.shutdown_timeout)

