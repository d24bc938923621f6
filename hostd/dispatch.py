"""hostd weights NAME / hostd engine NAME: run the daemon the model's backend names.

One job: the step from a model's name to the process its unit runs. Load the
model's config (config/load.py), pick its backend (hostd/backends, the one
switch on the backend's name), check that the backend can serve the config,
then call the backend's run_weights() / run_engine() with it. The backend
hands itself to the daemon it runs, so no daemon looks the backend up (no
import circle), and each process imports only what its backend needs: a
vLLM or SGLang supervisor never loads torch (tests/unit/test_imports.py).

Trusts: the config as config/load.py validated it. Refuses, before anything
starts (exit 1, the reason in the journal and the unit's STATUS=), a config
the backend cannot serve: its refusals, a missing or too old upstream install,
and for the engine what it refuses given the model's config.json (a
max_model_len beyond the model's positions).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from hostd import backends, logs, paths, systemd
from hostd import config as hostd_config
from hostd.checkpoints import config_file


def model_config(cfg) -> Optional[dict]:
    """The checkpoint's config.json, or None when there is none to read (the
    backend's refusals name a missing one)."""
    try:
        return config_file.read(cfg.model)
    except ValueError:
        return None


def run(role: str, args: argparse.Namespace) -> int:
    """`hostd ROLE NAME` (ROLE: weights or engine); returns the exit code."""
    log = logging.getLogger(f"hostd.{role}")
    logs.setup(args.name, role)
    root = hostd_config.config_root(args.config_dir)
    cfg = hostd_config.load_model(args.name, root).config
    logs.apply_level(hostd_config.load_daemon(root).log_level)  # hostd.yaml once more, at start only
    try:
        backend = backends.for_config(cfg)
        backend.check(cfg, model_config(cfg) if role == "engine" else None)
    except backends.BackendRefused as exc:
        log.error("cannot serve %s: %s", args.name, exc)
        systemd.status(f"refused: {exc}")
        return 1
    return backend.run_weights(args, cfg) if role == "weights" else backend.run_engine(args, cfg)


def weights_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--socket", metavar="PATH", help="listen here when not socket-activated")
    parser.add_argument("--slot", choices=sorted(paths.WEIGHTS_SOCKETS), default="main",
                        help="weight slot: main (weights.sock), or next (weights-next.sock: a checkpoint swap's "
                        "daemon, loading the new checkpoint beside main; vllm and sglang keep its upstream "
                        "sockets in a directory of its own)")
    parser.add_argument("--state-dir", metavar="DIR", help="digest cache (default /var/lib/hostd/NAME)")


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--socket", metavar="PATH", help="serve HTTP here (default /run/hostd/NAME/engine.sock)")
    parser.add_argument("--slot", choices=sorted(paths.ENGINE_SOCKETS), default="main",
                        help="engine slot: main (engine.sock), next (engine-next.sock, during an overlap reload) "
                        "or standby (engine-standby.sock, the warm standby)")
    parser.add_argument("--weights", metavar="PATH", help="weight daemon socket (default: the weight slot's)")
    parser.add_argument("--weights-slot", choices=sorted(paths.WEIGHTS_SOCKETS), default="main",
                        help="the weight daemon to attach: main (weights.sock), or next (weights-next.sock, "
                        "a checkpoint swap's engine on the new checkpoint)")
    parser.add_argument("--state-dir", metavar="DIR", help="digest cache (default /var/lib/hostd/NAME)")
    parser.add_argument("--from-disk", action="store_true",
                        help="builtin backend: load the checkpoint from disk (cold start; for benchmarks)")


@dataclass(frozen=True)
class Daemon:
    """One of a model's daemons as a subcommand of hostd/main.py."""

    role: str
    add_arguments: Callable[[argparse.ArgumentParser], None]

    def run(self, args: argparse.Namespace) -> int:
        return run(self.role, args)


weights = Daemon("weights", weights_arguments)
engine = Daemon("engine", engine_arguments)
