"""Put a model's tensors into one shareable allocation, and map it back.

One job: the memory. The daemon copies every parameter and buffer (tied
weights once, non-persistent buffers such as rotary inv_freq included) into a
single allocation at 256-byte aligned offsets (load.py streams the checkpoint
into it through MemfdWriter or CudaWriter):

- CPU: one memfd, filled with pwrite (the daemon never maps it writable), then
  sealed F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL, so no
  process, the daemon included, can change or resize it. Engines map it
  PROT_READ, MAP_SHARED: every engine's tensors are the same physical pages.
- CUDA: one device allocation whose IPC handle (torch's _share_cuda_) engines
  open; the daemon keeps the allocation alive for as long as it runs.

The tensor table (name, dtype, shape, offset, aliases) travels in the Attach
message; see protocol.py.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any, Union

import torch

from hostd.weights.protocol import CudaStorage, MemfdStorage, Storage, TensorEntry

ALIGN = 256
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def plan(tensors: list[tuple[str, str, torch.Tensor, list[str]]]) -> tuple[list[TensorEntry], int]:
    """Offsets for every tensor in one allocation; returns (table, total bytes)."""
    table, offset = [], 0
    for name, kind, tensor, aliases in tensors:
        offset = -(-offset // ALIGN) * ALIGN
        table.append(
            TensorEntry(
                name=name,
                kind=kind,
                dtype=str(tensor.dtype).removeprefix("torch."),
                shape=list(tensor.shape),
                offset=offset,
                aliases=list(aliases),
            )
        )
        offset += tensor.numel() * tensor.element_size()
    return table, max(-(-offset // ALIGN) * ALIGN, ALIGN)


@dataclass
class Shared:
    """The daemon's side: the allocation it holds and how to hand it out."""

    storage: Storage
    table: list[TensorEntry]
    size: int
    device: str
    fd: int = -1  # the memfd, on CPU
    keep: Any = None  # the CUDA allocation, kept alive


class MemfdWriter:
    """Fills one memfd of SIZE bytes with pwrite; finish() seals it. The daemon
    never maps it, so not even the daemon can write it once sealed."""

    def __init__(self, size: int, label: str):
        self.size = size
        self.fd = os.memfd_create(f"hostd-weights-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Copy DATA (uint8, on the CPU) to OFFSET."""
        view = memoryview(data.contiguous().numpy())
        written = 0
        while written < len(view):
            written += os.pwrite(self.fd, view[written:], offset + written)

    def finish(self, table: list[TensorEntry]) -> Shared:
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        storage = MemfdStorage(size=self.size, inode=os.fstat(self.fd).st_ino)
        return Shared(storage=storage, table=table, size=self.size, device="cpu", fd=self.fd)

    def close(self) -> None:
        os.close(self.fd)


class CudaWriter:
    """Fills one device allocation of SIZE bytes; finish() exports its IPC handle.
    write() copies asynchronously: DATA must stay unchanged until sync()."""

    def __init__(self, size: int, device: torch.device):
        self.size = size
        self.device = device
        self.block = torch.empty(size, dtype=torch.uint8, device=device)

    def write(self, offset: int, data: torch.Tensor) -> None:
        self.block[offset : offset + data.numel()].copy_(data, non_blocking=True)

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)

    def finish(self, table: list[TensorEntry]) -> Shared:
        self.sync()
        fields = self.block.untyped_storage()._share_cuda_()
        (dev, handle, nbytes, offset, rc_handle, rc_offset, event, event_sync) = fields
        storage = CudaStorage(
            device=dev,
            handle=handle,
            size=nbytes,
            offset=offset,
            ref_counter_handle=rc_handle,
            ref_counter_offset=rc_offset,
            event_handle=event if event else b"",
            event_sync_required=bool(event_sync),
            device_uuid=cuda_uuid(self.device),
        )
        return Shared(storage=storage, table=table, size=self.size, device=str(self.device), keep=self.block)

    def close(self) -> None:
        self.block = None


Writer = Union[MemfdWriter, CudaWriter]


def cuda_uuid(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"index-{device.index}"


# ---------------------------------------------------------------- engine side


def map_memfd(fd: int, storage: MemfdStorage) -> torch.Tensor:
    """The shared allocation as a read-only uint8 tensor (fd may be closed after)."""
    st = os.fstat(fd)
    if st.st_ino != storage.inode or st.st_size != storage.size:
        raise RuntimeError("the memfd received is not the one the daemon described")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & SEALS != SEALS:
        raise RuntimeError("the daemon's memfd is not sealed; refusing to map memory it could change")
    mapped = mmap.mmap(fd, storage.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # The buffer is read-only by design: weights are never written.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.frombuffer(mapped, dtype=torch.uint8)


def open_cuda(storage: CudaStorage) -> torch.Tensor:
    """The daemon's device allocation as a uint8 tensor in this process."""
    torch.cuda._lazy_init()
    with torch.cuda.device(storage.device):
        shared = torch.UntypedStorage._new_shared_cuda(
            storage.device,
            storage.handle,
            storage.size,
            storage.offset,
            storage.ref_counter_handle,
            storage.ref_counter_offset,
            storage.event_handle or None,
            storage.event_sync_required,
        )
        block = torch.empty(0, dtype=torch.uint8, device=f"cuda:{storage.device}")
        block.set_(shared, 0, (storage.size,), (1,))
    return block


def tensor_at(block: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    dtype = getattr(torch, entry.dtype)
    count = 1
    for dim in entry.shape:
        count *= dim
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return block[entry.offset : entry.offset + nbytes].view(dtype).view(entry.shape)
