"""Read a checkpoint once into the daemon's shared allocation, hashing it on the way.

One job: the weight daemon's load. Every weight file is read once,
sequentially, in CHUNK-sized pieces; each piece goes to the content hash
(fingerprint.py; skipped for a file whose digest the cache already holds) and
the bytes of every tensor in it are copied straight to their place in the
shared allocation (shared.py): pwrite into the memfd on CPU, an asynchronous
copy from a pinned buffer on CUDA (two buffers, so the disk read of one piece
overlaps the copy of the last). No tensor is put on the device first, so a
load holds the weights on the device once, not twice.

Trusts: the checkpoint's files, which the administrator chose. Still checked,
since a truncated download or a wrong file must fail with its name rather
than load garbage: the safetensors header's size and JSON, every tensor's
dtype, byte range (inside the file, the size its dtype and shape make) and
shape (the model's), that no parameter is missing, and that no file changed
while it was read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from hostd.weights import checkpoint as checkpoint_mod
from hostd.weights import fingerprint, shared

CHUNK = 64 << 20
MAX_HEADER = 100 << 20  # safetensors' own limit for the JSON header

# safetensors dtype names -> torch dtypes (those a transformers checkpoint uses).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class Piece(NamedTuple):
    """One tensor to copy: bytes [start, end) of the file go to OFFSET of the
    allocation, converted from SOURCE to TARGET dtype when they differ."""

    start: int
    end: int
    offset: int
    source: torch.dtype
    target: torch.dtype


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, the header's tensor entries) of one shard."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER or 8 + length > size:
            raise ValueError(f"{path}: safetensors header length {length} is impossible for a {size}-byte file")
        try:
            header = json.loads(handle.read(length))
        except ValueError as exc:
            raise ValueError(f"{path}: the safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


def plan_shard(path: Path, tensors, wanted: dict[str, int], table, found: set[int]) -> list[Piece]:
    """The pieces of PATH that the model wants, in file order; marks them FOUND."""
    data_start, header = read_header(path)
    file_size = path.stat().st_size
    pieces = []
    for key, info in header.items():
        index = wanted.get(key)
        if index is None or index in found:
            continue
        meta = tensors[index][2]
        try:
            source = SAFETENSORS_DTYPES[info["dtype"]]
            begin, end = (int(v) for v in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {key}: unreadable header entry {info!r}") from None
        checkpoint_mod.check_shape(path, key, shape, meta)
        nbytes = meta.numel() * torch.empty((), dtype=source).element_size()
        if not 0 <= begin <= end or end - begin != nbytes or data_start + end > file_size:
            raise ValueError(
                f"{path}: tensor {key}: bytes {begin}..{end} do not hold a {info['dtype']} "
                f"tensor of shape {shape} inside this {file_size}-byte file (truncated?)"
            )
        pieces.append(Piece(data_start + begin, data_start + end, table[index].offset, source, meta.dtype))
        found.add(index)
    return sorted(pieces)


class Reader:
    """Reusable chunk buffers: pinned for CUDA (async copies), plain for CPU."""

    def __init__(self, writer: shared.Writer):
        self.writer = writer
        self.cuda = isinstance(writer, shared.CudaWriter)
        count = 2 if self.cuda else 1
        self.buffers = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(count)]
        self.events = [None] * count
        self.turn = 0

    def next_buffer(self) -> torch.Tensor:
        """A buffer no copy still reads from."""
        self.turn = (self.turn + 1) % len(self.buffers)
        if self.events[self.turn] is not None:
            self.events[self.turn].synchronize()
            self.events[self.turn] = None
        return self.buffers[self.turn]

    def copied(self) -> None:
        """Every copy out of the current buffer has been issued."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events[self.turn] = event


def stream_file(path: Path, pieces: list[Piece], reader: Reader, hasher) -> os.stat_result:
    """Read PATH once: feed HASHER (if any), copy PIECES to the writer."""
    writer = reader.writer
    pending: dict[int, torch.Tensor] = {}  # piece index -> staging bytes (dtype conversion)
    first = 0  # pieces before this one are complete
    with open(path, "rb") as handle:
        before = os.fstat(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        position = 0
        while True:
            buffer = reader.next_buffer()
            count = handle.readinto(memoryview(buffer.numpy()))
            if not count:
                break
            chunk_end = position + count
            if hasher is not None:
                hasher.update(memoryview(buffer.numpy())[:count])
            index = first
            while index < len(pieces) and pieces[index].start < chunk_end:
                piece = pieces[index]
                low, high = max(piece.start, position), min(piece.end, chunk_end)
                if low < high:
                    data = buffer[low - position : high - position]
                    if piece.source == piece.target:
                        writer.write(piece.offset + low - piece.start, data)
                    else:
                        staging = pending.setdefault(
                            index, torch.empty(piece.end - piece.start, dtype=torch.uint8)
                        )
                        staging[low - piece.start : high - piece.start].copy_(data)
                if piece.end <= chunk_end:
                    if index in pending:
                        converted = pending.pop(index).view(piece.source).to(piece.target)
                        writer.write(piece.offset, converted.view(-1).view(torch.uint8))
                    if index == first:
                        first += 1
                index += 1
            reader.copied()
            position = chunk_end
    fingerprint.check_unchanged(path, before)
    return before


def load(
    checkpoint: Path,
    model: torch.nn.Module,
    device: torch.device,
    *,
    label: str,
    cache_dir: Optional[Path],
) -> tuple[shared.Shared, str]:
    """Every parameter and buffer of MODEL (parameters on meta, buffers real)
    in one shared allocation on DEVICE, and the checkpoint's content digest."""
    checkpoint = checkpoint.resolve()  # the digest cache is keyed by resolved paths
    tensors = checkpoint_mod.named_tensors(model)
    wanted = checkpoint_mod.wanted_keys(tensors)
    table, size = shared.plan(tensors)
    files = fingerprint.weight_files(checkpoint)
    found: set[int] = set()
    plans = {path: plan_shard(path, tensors, wanted, table, found) for path in files[1:]}
    checkpoint_mod.check_complete(checkpoint, tensors, found)

    cache = fingerprint.DigestCache(cache_dir)
    writer: shared.Writer = (
        shared.CudaWriter(size, device) if device.type == "cuda" else shared.MemfdWriter(size, label)
    )
    try:
        reader = Reader(writer)
        digests = []
        for path in files:
            digest = cache.get(path, os.stat(path))
            hasher = fingerprint.new_hasher() if digest is None else None
            st = stream_file(path, plans.get(path, []), reader, hasher)
            if hasher is not None:
                digest = hasher.hexdigest()
                cache.put(path, st, digest)
            digests.append((path.name, digest))
        for entry, (_, kind, tensor, _) in zip(table, tensors):
            if kind == "buffer":
                writer.write(entry.offset, tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8))
        result = writer.finish(table)
    except BaseException:
        writer.close()
        raise
    cache.save()
    return result, fingerprint.combine(digests)
