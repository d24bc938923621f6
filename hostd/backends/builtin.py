"""The builtin backend: hostd's own weight daemon and engine (torch + transformers).

torch and transformers are the `builtin` extra, not hostd's dependencies: this
module never imports them (the manager and hostctl import it), and a host
without them refuses a builtin model before anything starts
(hostd/engine/rules.py's builtin_install_problem).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from hostd.backends.base import Backend
from hostd.checkpoints import config_file


class BuiltinBackend(Backend):
    name = "builtin"
    rebuilds_in_place = True  # hostd/engine/server.py's rebuild verb
    # hostd/engine/server.py's user-facing API; its /health (PIDs, weights
    # socket inode, engine config) and /metrics are the manager's and the
    # gateway's, never public.
    public_routes = (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model}"),
    )
    metrics_prefixes = ("hostd_engine_",)
    upstream_package = "transformers"  # builds the model; torch runs it

    def run_weights(self, args, cfg) -> int:
        from hostd.weights import daemon  # imports torch: only in the process that runs it

        return daemon.serve(args, cfg)

    def run_engine(self, args, cfg) -> int:
        # The main engine with `spare: true` takes a process forked from the
        # spare, its imports done (hostd/engine/handoff.py); the other slots,
        # a cold start from disk, and that process itself start as always.
        if (cfg.spare and args.slot == "main" and args.weights_slot == "main" and not args.from_disk
                and not getattr(args, "from_spare", None)):
            from hostd.engine import handoff

            if handoff.take(args.name):
                return 0
        from hostd.engine import main

        return main.serve(args, cfg, self)

    def refusals(self, cfg) -> list[str]:
        """What no engine could serve. Limits beyond what the model can do (a
        max_model_len past its positions) are the engine's to refuse at start:
        it knows the model, and a reload rolls back when it does."""
        problems = []
        checkpoint = Path(cfg.model)
        if not (checkpoint / "config.json").is_file():
            problems.append(f"model: {checkpoint} has no config.json (not a checkpoint directory)")
        elif not list(checkpoint.glob("*.safetensors")):
            problems.append(
                f"model: {checkpoint} has no *.safetensors files; the builtin backend "
                "loads safetensors only (convert .bin/GGUF checkpoints first)"
            )
        return problems

    def install_refusals(self, cfg) -> list[str]:
        """torch or transformers missing from hostd's environment (the
        `builtin` extra): the units refuse before importing either."""
        return self._install()

    def engine_refusals(self, cfg, model_config: dict) -> list[str]:
        """What this engine refuses once it has read the model's config.json:
        the config-time rules (start_refusals) and a max_model_len past the
        model's positions."""
        problems = self._rules(cfg, model_config)
        positions = model_config.get("max_position_embeddings")
        limit = cfg.engine.max_model_len
        if positions and limit and limit > positions:
            problems.append(
                f"engine.max_model_len: {limit} exceeds the model's max_position_embeddings "
                f"({positions}); lower it or leave it unset"
            )
        return problems

    def start_refusals(self, cfg) -> list[str]:
        """hostd/engine/rules.py's refusals: torch and transformers installed
        (the `builtin` extra), the batched engine's transformers and its KV
        budget against one request of max_model_len."""
        missing = self._install()
        if missing:
            return missing
        try:
            model_config = config_file.read(cfg.model)
        except ValueError:
            return []  # refusals() names a missing config.json; the engine an unreadable one
        return self._rules(cfg, model_config)

    @staticmethod
    def _install() -> list[str]:
        from hostd.engine import rules  # no torch: the manager and hostctl import it

        problem = rules.builtin_install_problem(rules.missing_builtin_packages())
        return [problem] if problem else []

    @staticmethod
    def _rules(cfg, model_config: dict) -> list[str]:
        from hostd.engine import rules  # no torch: the manager and hostctl import it

        if rules.missing_builtin_packages():
            return []  # install_refusals() and start_refusals() say it, once
        return rules.start_problems(cfg, model_config, rules.installed_transformers())

    def engine_kv_bytes(self, cfg, device_total, swap=False):
        """The paged cache of engine.batching continuous (hostd/engine/budget.py,
        the engine's own arithmetic; a swap's engine on reload.bridge_kv_mib,
        budget.swap_bytes); None with batching none, or when the
        checkpoint's config.json cannot size it."""
        if cfg.engine.batching != "continuous":
            return None
        from hostd.engine import budget  # no torch: the manager imports it

        try:
            return budget.for_checkpoint(
                Path(cfg.model), dtype=cfg.dtype, kv_cache_mib=cfg.engine.kv_cache_mib,
                max_num_seqs=cfg.engine.max_num_seqs, max_model_len=cfg.engine.max_model_len,
                device_total=device_total, device=cfg.device,
                bridge_kv_mib=cfg.reload.bridge_kv_mib if swap else None)
        except (OSError, ValueError):
            return None

    def uses_gpu(self, cfg) -> bool:
        return cfg.device == "cuda"

    def upstream_version(self, cfg) -> str:
        try:
            return importlib.metadata.version(self.upstream_package)
        except importlib.metadata.PackageNotFoundError:
            return ""

    def drain_seconds(self, cfg) -> float:
        return cfg.engine.shutdown_timeout
