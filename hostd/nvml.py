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
import re
import threading
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Optional, Union

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


# ---------------------------------------------------------------- naming a GPU

GpuName = Union[int, str]  # the config's `gpus:` entries: a host index, a 'GPU-…' or a 'MIG-…' UUID

# Where the driver publishes a MIG slice's capability devices (/dev/nvidia-caps/nvidia-capN):
# gpu<minor>/mig/gi<GI>/access and gi<GI>/ci<CI>/access, each with a "DeviceFileMinor: N" line.
MIG_CAPABILITIES = Path("/proc/driver/nvidia/capabilities")


class NoSuchGpu(ValueError):
    """The config's `gpus` names a GPU that NVML says this host lacks."""


class Gpu(NamedTuple):
    """One of a model's `gpus:` as NVML knows it."""

    name: GpuName  # as the config names it
    index: int  # NVML's index of the physical GPU (of a MIG slice: its parent's)
    uuid: str  # the physical GPU's 'GPU-…'
    mig_uuid: str  # the MIG slice's 'MIG-…', "" for a whole GPU
    minor: int  # the physical GPU's /dev/nvidiaN
    mig: Optional[tuple[int, int]]  # (GPU instance, compute instance) of a MIG slice


def handle(pynvml, gpu: GpuName):
    """NVML's handle of GPU (inside a session): by index, or by its UUID."""
    if isinstance(gpu, int):
        return pynvml.nvmlDeviceGetHandleByIndex(gpu)
    return pynvml.nvmlDeviceGetHandleByUUID(gpu.encode())


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def describe(gpus: list[GpuName]) -> list[Gpu]:
    """What NVML says of each of GPUS; NoSuchGpu naming those this host
    lacks, Unavailable without NVML. NVML counts GPUs in PCI bus order (the
    units set CUDA_DEVICE_ORDER=PCI_BUS_ID so that CUDA's indices count the
    same way); a GPU's /dev/nvidiaN minor need not equal its index (it
    follows the driver's probe order). NoSuchGpu lets the generator fail the
    model's start at once, naming the key, rather than after the weights
    unit imported torch and CUDA refused the device."""
    with session() as pynvml:
        count = pynvml.nvmlDeviceGetCount()
        missing = [g for g in gpus if isinstance(g, int) and g >= count]
        out = []
        for gpu in gpus:
            if gpu in missing:
                continue
            try:
                device = handle(pynvml, gpu)
            except Exception as exc:
                # For a UUID, NVML_ERROR_NOT_FOUND: not this host's. Any other
                # error is NVML's own (the generator then allows every GPU).
                if isinstance(gpu, int) or type(exc).__name__ != "NVMLError_NotFound":
                    raise
                missing.append(gpu)
                continue
            index, uuid, mig_uuid, parent = identify(pynvml, gpu, device)
            mig = (pynvml.nvmlDeviceGetGpuInstanceId(device), pynvml.nvmlDeviceGetComputeInstanceId(device)) \
                if mig_uuid else None
            out.append(Gpu(gpu, index, uuid, mig_uuid, pynvml.nvmlDeviceGetMinorNumber(parent), mig))
    if missing:
        have = f"{count} GPU" + ("" if count == 1 else "s")
        indices = [g for g in missing if isinstance(g, int)]
        uuids = [g for g in missing if isinstance(g, str)]
        said = []
        if indices:
            said.append(f"this host has {have} (NVML, indices 0 to {count - 1} in PCI bus order), so GPU "
                        f"{', '.join(map(str, indices))} does not exist")
        if uuids:
            said.append(f"NVML knows no GPU or MIG device {', '.join(uuids)} on this host")
        raise NoSuchGpu(f"gpus: {list(gpus)}: {'; '.join(said)}; name GPUs this host has "
                        "(nvidia-smi -L lists them in the same order, with their GPU- and MIG- UUIDs)")
    return out


def identify(pynvml, gpu: GpuName, device) -> tuple[int, str, str, Any]:
    """(index, 'GPU-…' UUID, 'MIG-…' UUID or "", the physical GPU's handle)
    of GPU, whose handle is DEVICE (inside a session); of a MIG slice, its
    parent's index and UUID."""
    if isinstance(gpu, str) and gpu.startswith("MIG-"):
        parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(device)
        return pynvml.nvmlDeviceGetIndex(parent), _text(pynvml.nvmlDeviceGetUUID(parent)), gpu, parent
    index = gpu if isinstance(gpu, int) else pynvml.nvmlDeviceGetIndex(device)
    return index, _text(pynvml.nvmlDeviceGetUUID(device)), "", device


def mig_capability_minors(gpu: Gpu) -> list[int]:
    """The /dev/nvidia-caps/nvidia-capN minors a process needs to use the MIG
    slice GPU (its GPU instance's and its compute instance's); OSError when
    the driver's capability files cannot be read."""
    assert gpu.mig is not None
    instance, compute = gpu.mig
    base = MIG_CAPABILITIES / f"gpu{gpu.minor}" / "mig" / f"gi{instance}"
    minors = []
    for access in (base / "access", base / f"ci{compute}" / "access"):
        match = re.search(r"^DeviceFileMinor:\s*(\d+)", access.read_text(), re.M)
        if match is None:
            raise OSError(f"{access}: no DeviceFileMinor line")
        minors.append(int(match.group(1)))
    return minors


# ---------------------------------------------------------------- the readings the backends ask


def memory(gpus: list[GpuName]) -> dict:
    """{GPU as named: NVML memory info (total, free, used)} for GPUS (of a MIG
    slice: the slice's); empty without NVML (CPU hosts, containers without
    GPUs) or for a GPU it lacks."""
    try:
        with session() as pynvml:
            return {gpu: pynvml.nvmlDeviceGetMemoryInfo(handle(pynvml, gpu)) for gpu in gpus}
    except Exception:  # no driver library, or no such GPU
        return {}


def uuids(gpus: list[GpuName]) -> dict[GpuName, str]:
    """{GPU as named: NVML UUID ('GPU-...', a MIG slice's 'MIG-...')} for GPUS; empty without NVML."""
    try:
        with session() as pynvml:
            return {gpu: _text(pynvml.nvmlDeviceGetUUID(handle(pynvml, gpu))) for gpu in gpus}
    except Exception:  # no driver library (CPU hosts, containers without GPUs), or no such GPU
        return {}


def smallest_total(gpus: list[GpuName]) -> Optional[int]:
    """The total memory in bytes of the smallest of GPUS; None without NVML
    (CPU hosts, containers without GPUs)."""
    found = memory(gpus)
    return min(info.total for info in found.values()) if found else None
