"""Backends: for one model config, what the weights and engine units run.

base.py is the interface (DESIGN.md §3); builtin.py hostd's own backend;
vllm.py and sglang.py the upstream ones, sharing upstream.py.
"""

from typing import Optional

from hostd.backends.base import Backend, BackendRefused, Command
from hostd.backends.builtin import BuiltinBackend
from hostd.backends.sglang import SglangBackend
from hostd.backends.vllm import VllmBackend

BACKENDS: dict[str, type[Backend]] = {
    "builtin": BuiltinBackend,
    "vllm": VllmBackend,
    "sglang": SglangBackend,
}


def refused_at_start(cfg, name: str, log, model_config: Optional[dict] = None) -> bool:
    """Check CFG before a daemon of model NAME starts anything; on refusal log
    the reason, put it in the unit's STATUS= and return True."""
    from hostd import systemd

    try:
        for_config(cfg).check(cfg, model_config)
    except BackendRefused as exc:
        log.error("cannot serve %s: %s", name, exc)
        systemd.status(f"refused: {exc}")
        return True
    return False


def for_config(cfg) -> Backend:
    try:
        return BACKENDS[cfg.backend]()
    except KeyError:
        raise BackendRefused(f"backend: {cfg.backend!r} is not available in this hostd build") from None


__all__ = ["BACKENDS", "Backend", "BackendRefused", "Command", "for_config", "refused_at_start"]
