"""Backends: for one model config, what the weights and engine units run.

base.py is the interface (DESIGN.md §3); builtin.py hostd's own backend;
vllm.py and sglang.py the upstream ones, sharing upstream.py.
"""

from hostd.backends.base import Backend, BackendRefused, Command
from hostd.backends.builtin import BuiltinBackend
from hostd.backends.sglang import SglangBackend
from hostd.backends.vllm import VllmBackend

BACKENDS: dict[str, type[Backend]] = {
    "builtin": BuiltinBackend,
    "vllm": VllmBackend,
    "sglang": SglangBackend,
}


def for_config(cfg) -> Backend:
    try:
        return BACKENDS[cfg.backend]()
    except KeyError:
        raise BackendRefused(f"backend: {cfg.backend!r} is not available in this hostd build") from None


__all__ = ["BACKENDS", "Backend", "BackendRefused", "Command", "for_config"]
