"""Compute a checkpoint's fingerprint: what the weights are.

One job: the Fingerprint of protocol.py for a checkpoint directory and a
config. The content digest covers every *.safetensors file and config.json
(names and bytes), so a fine-tune that keeps the base model's tensor names and
shapes still differs (vLLM's key hashes only headers: vllm issue 59647).

Per file the digest is xxHash's XXH3-128 (HASH): it runs at memory speed
(tens of GB/s), so the weight daemon hashes each shard in the same pass that
reads it into the shared allocation (load.py) and the disk, not the hash,
bounds a first load. XXH3 is not collision resistant against a crafted file;
the digest guards against mistakes (a cache holding other weights than the
config names), not against whoever can write the checkpoint, who can change
the weights anyway. The per-file digests are combined with sha256 into the
64-hex-digit content_digest the protocol carries.

Digests are cached per file in the model's state directory (DIGEST_CACHE),
keyed by (device, inode, size, mtime, ctime): an unchanged checkpoint is not
hashed again by the daemon's next start or by any engine; a file rewritten in
place changes its mtime/ctime and is hashed again. The cache is only a
shortcut: a missing, unreadable or corrupt cache means hashing again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Optional

import msgspec
import xxhash

from hostd.config.atomic import write_atomic
from hostd.checkpoints import config_file
from hostd.weights.protocol import Fingerprint

log = logging.getLogger(__name__)

DIGEST_CACHE = "digests.json"
HASH = "xxh3_128"  # the per-file digest's name, in the cache and in the combined digest
CHUNK = 16 << 20


def new_hasher():
    """A streaming hasher of HASH; feed it with update(), read hexdigest()."""
    return xxhash.xxh3_128()


def weight_files(checkpoint: Path) -> list[Path]:
    """The files whose bytes define the weights, in a stable order."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{checkpoint}: no *.safetensors files; the builtin backend loads "
            "safetensors checkpoints only"
        )
    return [checkpoint / "config.json", *files]


def stat_key(st: os.stat_result) -> str:
    """What must stay equal for a cached digest to still describe a file."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class DigestCache:
    """Per-file digests in STATE_DIR/digests.json, keyed by path and stat_key."""

    def __init__(self, cache_dir: Optional[Path]):
        self.file = cache_dir / DIGEST_CACHE if cache_dir else None
        self.entries: dict[str, dict[str, str]] = {}
        self.changed = False
        if self.file and self.file.exists():
            try:
                entries = json.loads(self.file.read_text())
                if isinstance(entries, dict):
                    self.entries = entries
            except (OSError, ValueError):
                pass

    def get(self, path: Path, st: os.stat_result) -> Optional[str]:
        entry = self.entries.get(str(path))
        if isinstance(entry, dict) and entry.get("stat") == stat_key(st):
            digest = entry.get(HASH)
            return digest if isinstance(digest, str) else None
        return None

    def put(self, path: Path, st: os.stat_result, digest: str) -> None:
        self.entries[str(path)] = {"stat": stat_key(st), HASH: digest}
        self.changed = True

    def save(self) -> None:
        if not (self.changed and self.file):
            return
        try:
            write_atomic(self.file, json.dumps(self.entries, indent=1, sort_keys=True), mode=0o600)
            self.changed = False
        except OSError as exc:
            log.warning("cannot cache digests in %s: %s", self.file, exc)


def check_unchanged(path: Path, before: os.stat_result) -> None:
    """Refuse a file that changed while it was being read or hashed."""
    if stat_key(os.stat(path)) != stat_key(before):
        raise RuntimeError(f"{path} changed while it was being read; try again")


def hash_file(path: Path) -> tuple[str, os.stat_result]:
    """(HASH of PATH's bytes, the stat it was read under)."""
    hasher = new_hasher()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        before = os.fstat(handle.fileno())
        while count := handle.readinto(buffer):
            hasher.update(view[:count])
    check_unchanged(path, before)
    return hasher.hexdigest(), before


def combine(digests: Iterable[tuple[str, str]]) -> str:
    """The content digest: sha256 over (file name, HASH digest) in order."""
    total = hashlib.sha256()
    for name, digest in digests:
        total.update(f"{name}\0{HASH}:{digest}\n".encode())
    return total.hexdigest()


def content_digest(checkpoint: Path, cache_dir: Optional[Path]) -> str:
    """The content digest of CHECKPOINT, hashing only files the cache lacks."""
    cache = DigestCache(cache_dir)
    digests = []
    for path in weight_files(checkpoint):
        digest = cache.get(path, os.stat(path))
        if digest is None:
            log.info("hashing %s (%d bytes)", path, path.stat().st_size)
            digest, st = hash_file(path)
            cache.put(path, st, digest)
        digests.append((path.name, digest))
    cache.save()
    return combine(digests)


def architecture(checkpoint: Path) -> str:
    config = config_file.read(checkpoint)
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    return str(archs[0])


def compute(
    checkpoint: Path,
    *,
    dtype: str,
    device: str,
    backend: str = "builtin",
    tensor_parallel_size: int = 1,
    cache_dir: Optional[Path] = None,
    digest: Optional[str] = None,
    library_versions: Optional[tuple[str, str]] = None,
) -> Fingerprint:
    """The fingerprint of CHECKPOINT as configured; DIGEST when the caller
    already has the content digest (the daemon computes it while loading).
    LIBRARY_VERSIONS: the (torch, transformers) versions that serve these
    weights; None means this interpreter's, imported here (the builtin
    backend's daemon and engine load with them). An upstream backend's
    supervisor hands its own in: upstream's torch lives in upstream's
    environment, and hostd's may have none (no `builtin` extra)."""
    if library_versions is None:
        import torch
        import transformers

        library_versions = (str(torch.__version__), str(transformers.__version__))
    checkpoint = checkpoint.resolve()
    return Fingerprint(
        model_path=str(checkpoint),
        content_digest=digest if digest is not None else content_digest(checkpoint, cache_dir),
        architecture=architecture(checkpoint),
        dtype=dtype,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        backend=backend,
        torch_version=library_versions[0],
        transformers_version=library_versions[1],
    )


def describe(fp: Fingerprint) -> str:
    return json.dumps(msgspec.to_builtins(fp), sort_keys=True)
