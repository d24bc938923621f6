"""NVML, the driver's own view of the GPUs, for the few places that ask it.

One job: one initialised NVML session per question, shut down after it, and
one error when there is no driver library (CPU hosts, containers without
GPUs) so that each caller decides what that means: the generator allows
every NVIDIA device, the vLLM backend goes without GPU UUIDs (uuids), the
upstream backends without GPU memory figures (memory, smallest_total), the
manager's preflight is skipped. pynvml is imported inside session() only, so importing
this module costs nothing. Sessions are serialised (one at a time in the
process): init and shutdown are process-wide, and each NVML question takes
milliseconds per GPU, so callers ask it from a thread (the manager does) and
never many at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

_one_session = threading.Lock()


class Unavailable(RuntimeError):
    """NVML cannot be read here."""


@contextlib.contextmanager
def session() -> Iterator[Any]:
    """pynvml, initialised for the block (one block at a time); Unavailable when it cannot be."""
    with _one_session:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:
            raise Unavailable(f"NVML unavailable ({exc})") from None
        try:
            yield pynvml
        finally:
            pynvml.nvmlShutdown()


# ---------------------------------------------------------------- the readings the backends ask


def memory(indices: list[int]) -> dict:
    """{GPU index: NVML memory info (total, free, used)} for INDICES; empty
    without NVML (CPU hosts, containers without GPUs) or for a GPU it lacks."""
    try:
        with session() as pynvml:
            return {i: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices}
    except Exception:  # no driver library, or no such GPU
        return {}


def uuids(indices: list[int]) -> dict[int, str]:
    """{GPU index: NVML UUID ('GPU-...')} for INDICES; empty without NVML."""
    try:
        with session() as pynvml:
            found = {}
            for index in indices:
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
                found[index] = uuid.decode() if isinstance(uuid, bytes) else uuid
            return found
    except Exception:  # no driver library (CPU hosts, containers without GPUs), or no such GPU
        return {}


def smallest_total(indices: list[int]) -> Optional[int]:
    """The total memory in bytes of the smallest of the GPUs INDICES; None
    without NVML (CPU hosts, containers without GPUs)."""
    found = memory(indices)
    return min(info.total for info in found.values()) if found else None
