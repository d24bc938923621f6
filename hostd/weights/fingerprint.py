"""Compute a checkpoint's fingerprint: what the weights are.

One job: the Fingerprint of protocol.py for a checkpoint directory and a
config. The content digest hashes every *.safetensors file and config.json
(names and bytes), so a fine-tune that keeps the base model's tensor names and
shapes still differs (vLLM's key hashes only headers: vllm issue 59647).
Hashing a large checkpoint takes seconds, so digests are cached per file by
(size, mtime, inode, ctime) in the model's state directory; a file rewritten
in place changes its mtime/ctime and is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import msgspec

from hostd.config.atomic import write_atomic
from hostd.weights.protocol import Fingerprint

log = logging.getLogger(__name__)

DIGEST_CACHE = "digests.json"


def weight_files(checkpoint: Path) -> list[Path]:
    """The files whose bytes define the weights, in a stable order."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{checkpoint}: no *.safetensors files; the builtin backend loads "
            "safetensors checkpoints only"
        )
    return [checkpoint / "config.json", *files]


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"


def _hash_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def content_digest(checkpoint: Path, cache_dir: Optional[Path]) -> str:
    """sha256 over (name, sha256 of content) of every weight file."""
    cache_file = cache_dir / DIGEST_CACHE if cache_dir else None
    cache: dict[str, dict[str, str]] = {}
    if cache_file and cache_file.exists():
        try:
            cache = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cache = {}
    total = hashlib.sha256()
    changed = False
    for path in weight_files(checkpoint):
        key = _stat_key(path)
        entry = cache.get(str(path))
        if entry and entry.get("stat") == key:
            digest = entry["sha256"]
        else:
            log.info("hashing %s (%d bytes)", path, path.stat().st_size)
            digest = _hash_file(path)
            if _stat_key(path) != key:
                raise RuntimeError(f"{path} changed while it was being hashed; try again")
            cache[str(path)] = {"stat": key, "sha256": digest}
            changed = True
        total.update(f"{path.name}\0{digest}\n".encode())
    if changed and cache_file:
        try:
            write_atomic(cache_file, json.dumps(cache, indent=1, sort_keys=True), mode=0o600)
        except OSError as exc:
            log.warning("cannot cache digests in %s: %s", cache_file, exc)
    return total.hexdigest()


def architecture(checkpoint: Path) -> str:
    config = json.loads((checkpoint / "config.json").read_text())
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
) -> Fingerprint:
    import torch
    import transformers

    checkpoint = checkpoint.resolve()
    return Fingerprint(
        model_path=str(checkpoint),
        content_digest=content_digest(checkpoint, cache_dir),
        architecture=architecture(checkpoint),
        dtype=dtype,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        backend=backend,
        torch_version=str(torch.__version__),
        transformers_version=str(transformers.__version__),
    )


def describe(fp: Fingerprint) -> str:
    return json.dumps(msgspec.to_builtins(fp), sort_keys=True)
