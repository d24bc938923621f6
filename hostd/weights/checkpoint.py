"""Read a Hugging Face style checkpoint directory into tensors.

One job: the model skeleton and the checkpoint's tensors, shared by the
weight daemon (which loads once and shares) and the engine's from-disk mode
(the cold start the benchmarks compare against). Parameters are never
allocated twice: the skeleton's parameters live on the meta device, and each
tensor is read from safetensors straight onto its target device.

Checkpoint keys must be the transformers module paths (true of Llama, Qwen2
and most decoder-only models saved by transformers); a parameter missing from
the checkpoint is an error unless it is tied to one that is present.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from hostd import kv_bytes
from hostd.checkpoints import config_file
from hostd.weights import lean

lean.apply()  # before anything in this process imports transformers

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(checkpoint: Path, configured: str) -> str:
    """The dtype name to load in: the configured one, or the checkpoint's own,
    read as every KV budget reads it (hostd/kv_bytes.py): what the weights are
    loaded in is what the preflight and the engine size the cache for.
    ValueError naming config.json and the key for a dtype hostd does not know."""
    if configured != "auto":
        return configured
    source = str(config_file.path_of(checkpoint))
    return kv_bytes.resolve_dtype(config_file.read(checkpoint), configured, source=source)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Register every new parameter on the meta device (buffers stay real):
    building a 7B model then costs no memory and no random init."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def build_skeleton(checkpoint: Path, dtype: str, *, meta_buffers: bool) -> torch.nn.Module:
    """The model with parameters on meta; buffers computed on CPU (or meta too)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    context = torch.device("meta") if meta_buffers else _parameters_on_meta()
    with context:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    return model.eval()


Named = list[tuple[str, str, torch.Tensor, list[str]]]


def named_tensors(model: torch.nn.Module) -> Named:
    """(name, kind, tensor, aliases) for every parameter and buffer of MODEL,
    tied ones once (their other names in aliases)."""
    by_id: dict[int, int] = {}
    out: Named = []
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            if id(tensor) in by_id:
                out[by_id[id(tensor)]][3].append(name)
                continue
            by_id[id(tensor)] = len(out)
            out.append((name, kind, tensor, []))
    return out


def wanted_keys(tensors: Named) -> dict[str, int]:
    """Checkpoint key -> index in TENSORS, for every parameter name and alias."""
    wanted: dict[str, int] = {}
    for index, (name, kind, _, aliases) in enumerate(tensors):
        if kind == "parameter":
            for candidate in (name, *aliases):
                wanted[candidate] = index
    return wanted


def check_shape(path: Path, key: str, shape, expected: torch.Tensor) -> None:
    if tuple(shape) != tuple(expected.shape):
        raise ValueError(
            f"{path}: tensor {key} has shape {tuple(shape)}, the model "
            f"expects {tuple(expected.shape)}"
        )


def check_complete(checkpoint: Path, tensors: Named, found: set[int]) -> None:
    """Refuse a checkpoint that lacks a parameter the model needs."""
    missing = [tensors[i][0] for i, (_, kind, _, _) in enumerate(tensors) if kind == "parameter" and i not in found]
    if missing:
        raise ValueError(
            f"{checkpoint}: the checkpoint lacks {len(missing)} parameter(s) the model "
            f"needs, e.g. {', '.join(missing[:3])}"
        )


def load_tensors(checkpoint: Path, model: torch.nn.Module, device: torch.device) -> Named:
    """(name, kind, tensor on DEVICE, aliases) for every parameter and buffer of
    MODEL, parameters read from the checkpoint, tied ones once. The engine's
    cold start (--from-disk); the weight daemon reads with load.py instead."""
    from safetensors import safe_open

    out = named_tensors(model)
    wanted = wanted_keys(out)
    found: set[int] = set()
    device_name = str(device) if device.type == "cuda" else "cpu"
    for path in sorted(checkpoint.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device=device_name) as shard:
            for key in shard.keys():
                index = wanted.get(key)
                if index is None or index in found:
                    continue
                name, kind, meta, aliases = out[index]
                tensor = shard.get_tensor(key).to(meta.dtype)
                check_shape(path, key, tensor.shape, meta)
                out[index] = (name, kind, tensor, aliases)
                found.add(index)
    check_complete(checkpoint, out, found)
    return [
        (name, kind, tensor if kind == "parameter" else tensor.to(device), aliases)
        for name, kind, tensor, aliases in out
    ]


def attach(model: torch.nn.Module, tensors: Iterator[tuple[str, str, torch.Tensor, list[str]]]) -> None:
    """Put TENSORS into MODEL by assignment (no copy); every alias of a tied
    weight gets the very same Parameter, so ties survive."""
    for name, kind, tensor, aliases in tensors:
        value = torch.nn.Parameter(tensor, requires_grad=False) if kind == "parameter" else tensor
        for path in (name, *aliases):
            owner_path, _, leaf = path.rpartition(".")
            owner = model.get_submodule(owner_path) if owner_path else model
            if kind == "parameter":
                owner._parameters[leaf] = value
            else:
                owner._buffers[leaf] = value
    left = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"no weights for {len(left)} tensor(s), e.g. {', '.join(left[:3])}")
