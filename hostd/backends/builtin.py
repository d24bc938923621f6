"""The builtin backend: hostd's own weight daemon and engine (torch + transformers)."""

from __future__ import annotations

import json
from pathlib import Path

from hostd.backends.base import Backend, Command


class BuiltinBackend(Backend):
    name = "builtin"

    def weights_command(self, model: str, cfg) -> Command:
        return Command(self.hostd_argv("weights", model), dict(cfg.env))

    def engine_command(self, model: str, cfg) -> Command:
        return Command(self.hostd_argv("engine", model), dict(cfg.env))

    def refusals(self, cfg) -> list[str]:
        problems = []
        checkpoint = Path(cfg.model)
        if not (checkpoint / "config.json").is_file():
            problems.append(f"model: {checkpoint} has no config.json (not a checkpoint directory)")
        elif not list(checkpoint.glob("*.safetensors")):
            problems.append(
                f"model: {checkpoint} has no *.safetensors files; the builtin backend "
                "loads safetensors only (convert .bin/GGUF checkpoints first)"
            )
        else:
            positions = json.loads((checkpoint / "config.json").read_text()).get(
                "max_position_embeddings"
            )
            limit = cfg.engine.max_model_len
            if positions and limit and limit > positions:
                problems.append(
                    f"engine.max_model_len: {limit} exceeds the model's "
                    f"max_position_embeddings ({positions})"
                )
        return problems

    def drain_seconds(self, cfg) -> float:
        return cfg.engine.shutdown_timeout
