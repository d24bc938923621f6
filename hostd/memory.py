"""What an engine uses beyond the shared weights, and what the host has free.

One job: the numbers an overlap reload's preflight needs on CPU. The engine
reports them on /health (it can read its own /proc/self/status and the host's
/proc/meminfo; the manager's sandbox, ProtectProc=invisible and
ProcSubset=pid, can read neither for another user's process), and the manager
compares them (manager/probe.py).

- anonymous: the engine's RssAnon, its own heap and tensors. The weights are
  the daemon's memfd (RssShmem), shared by every engine, so a second engine
  needs about this much more, not the weights again.
- host_available: MemAvailable of /proc/meminfo.
- host_total: MemTotal, what the builtin engine's unset KV budget is a share
  of (hostd/engine/budget.py), so the manager can size a new engine's.
"""

from __future__ import annotations

from pathlib import Path


def _kib_field(path: str, key: str) -> int:
    for line in Path(path).read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise ValueError(f"{path} has no {key} line")


def snapshot() -> dict:
    """{"anonymous": bytes, "host_available": bytes} for this process; {} when
    /proc cannot tell (then an overlap reload falls back to restart)."""
    try:
        return {
            "anonymous": _kib_field("/proc/self/status", "RssAnon"),
            "host_available": _kib_field("/proc/meminfo", "MemAvailable"),
            "host_total": _kib_field("/proc/meminfo", "MemTotal"),
        }
    except (OSError, ValueError):
        return {}


def host_total() -> int | None:
    """MemTotal in bytes; None when /proc cannot tell."""
    try:
        return _kib_field("/proc/meminfo", "MemTotal")
    except (OSError, ValueError):
        return None
