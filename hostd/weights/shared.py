"""Put a model's tensors into one shareable allocation, and map it back.

One job: the memory. The daemon copies every parameter and buffer (tied
weights once, non-persistent buffers such as rotary inv_freq included) into a
single allocation at 256-byte aligned offsets:

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
from typing import Any

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


def share_cpu(tensors, label: str) -> Shared:
    table, size = plan(tensors)
    fd = os.memfd_create(f"hostd-weights-{label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for entry, (_, _, tensor, _) in zip(table, tensors):
            data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
            view = memoryview(data)
            written = 0
            while written < len(view):
                written += os.pwrite(fd, view[written:], entry.offset + written)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    storage = MemfdStorage(size=size, inode=os.fstat(fd).st_ino)
    return Shared(storage=storage, table=table, size=size, device="cpu", fd=fd)


def share_cuda(tensors, device: torch.device) -> Shared:
    table, size = plan(tensors)
    block = torch.empty(size, dtype=torch.uint8, device=device)
    for entry, (_, _, tensor, _) in zip(table, tensors):
        nbytes = tensor.numel() * tensor.element_size()
        block[entry.offset : entry.offset + nbytes].copy_(
            tensor.detach().contiguous().view(-1).view(torch.uint8)
        )
    torch.cuda.synchronize(device)
    fields = block.untyped_storage()._share_cuda_()
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
        device_uuid=cuda_uuid(device),
    )
    return Shared(storage=storage, table=table, size=size, device=str(device), keep=block)


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
