"""NVML, the driver's own view of the GPUs, for the few places that ask it.

One job: one initialised NVML session per question, shut down after it, and
one error when there is no driver library (CPU hosts, containers without
GPUs) so that each caller decides what that means: the generator allows
every NVIDIA device, the vLLM backend goes without GPU UUIDs, the manager's
preflight is skipped. pynvml is imported inside session() only, so importing
this module costs nothing. Sessions are serialised (one at a time in the
process): init and shutdown are process-wide, and each NVML question takes
milliseconds per GPU, so callers ask it from a thread (the manager does) and
never many at once.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

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
