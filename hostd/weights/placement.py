"""Which GPU each weight of a builtin model lies on when the model spans several.

One job: the placement rule, and nothing that imports torch, so that the
weight daemon (one allocation per GPU), the engine (each layer run where its
weights lie) and the manager's preflight (each GPU weighed against what lands
on it) can call one function and never disagree (issue 39).

Not wired in yet: today the builtin weight daemon and engine put every weight
on the first GPU of `gpus:` (docs/configuration.md, `gpus`). Running a model
across GPUs needs the hidden states moved between layers, a KV cache per
GPU and CUDA graphs per GPU, none of which a CPU can run; this rule is what
that wiring will follow, tested here on names and sizes alone.

The rule, for DEVICES GPUs (0 is the first of `gpus:`):
- the decoder layers (tensors named PREFIX.N.*, PREFIX the one with the most
  distinct N: model.layers for Llama and Qwen2) are split into contiguous runs,
  one run per GPU in order, so that the largest GPU's bytes are as few as can
  be (ties: the most even split);
- a tensor outside the layers that comes before the first layer's tensors in
  the order given (the embeddings) lies on the first GPU; every other one (the
  final norm, lm_head, buffers listed after the parameters) on the last;
- a tied weight lies once, where its first name puts it, and all its names map
  there (Qwen2.5-0.5B's lm_head.weight follows model.embed_tokens.weight onto
  the first GPU);
- one GPU: everything on it. With fewer layers than GPUs some GPUs get no
  layer (and may hold nothing).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional, Sequence

_LAYER = re.compile(r"^(?P<prefix>.+?)\.(?P<index>\d+)\.")


class Tensor(NamedTuple):
    """One parameter or buffer: its name, its bytes, and the other names it
    is tied to (hostd/weights/checkpoint.py's named_tensors lists them so)."""

    name: str
    nbytes: int
    aliases: tuple[str, ...] = ()


class Placement(NamedTuple):
    """Where each tensor lies (place())."""

    device_of: dict[str, int]  # every name and alias -> GPU (0 .. devices-1)
    bytes_per_device: list[int]  # each tied weight counted once
    layers_per_device: list[range]  # the decoder layers each GPU runs (empty ranges for idle GPUs)


def layer_prefix(names: Sequence[str]) -> Optional[str]:
    """The module path of the decoder layers (model.layers, transformer.h):
    of the PREFIX.N. names, the PREFIX with the most distinct N; None when no
    name has one."""
    seen: dict[str, set[int]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            seen.setdefault(match["prefix"], set()).add(int(match["index"]))
    if not seen:
        return None
    return max(seen, key=lambda prefix: (len(seen[prefix]), -len(prefix)))


def place(tensors: Sequence[Tensor], devices: int, *, prefix: Optional[str] = None) -> Placement:
    """Each tensor's GPU by the module's rule (above). TENSORS in module order,
    each tied weight once; PREFIX: the layers' module path, found when None.
    ValueError, naming what is wrong, for no GPU, a name given twice, or a
    model with no layers to split over several GPUs."""
    if devices < 1:
        raise ValueError(f"gpus: a model needs at least one GPU, got {devices}")
    names = [t.name for t in tensors]
    every = names + [alias for t in tensors for alias in t.aliases]
    if len(set(every)) != len(every):
        twice = sorted({n for n in every if every.count(n) > 1})
        raise ValueError(f"tensor name(s) given twice: {', '.join(twice[:3])}")
    if devices == 1:
        return Placement({name: 0 for name in every}, [sum(t.nbytes for t in tensors)],
                         [range(len(_layer_sizes(tensors, prefix or layer_prefix(names))))])
    prefix = prefix or layer_prefix(names)
    sizes = _layer_sizes(tensors, prefix)
    if not sizes:
        raise ValueError(
            f"gpus: cannot split the model over {devices} GPUs: no decoder layers found "
            f"(no tensor named {prefix or 'PREFIX'}.N.*); list one GPU in gpus:")
    first_layer = next(i for i, t in enumerate(tensors) if _layer_of(t.name, prefix) is not None)
    fixed = [0] * devices
    for i, t in enumerate(tensors):
        if _layer_of(t.name, prefix) is None:
            fixed[0 if i < first_layer else devices - 1] += t.nbytes
    runs = _split(sizes, fixed)
    device_of_layer = {layer: d for d, run in enumerate(runs) for layer in run}
    device_of: dict[str, int] = {}
    loads = [0] * devices
    for i, t in enumerate(tensors):
        layer = _layer_of(t.name, prefix)
        device = device_of_layer[layer] if layer is not None else (0 if i < first_layer else devices - 1)
        loads[device] += t.nbytes
        for name in (t.name, *t.aliases):
            device_of[name] = device
    return Placement(device_of, loads, runs)


def _layer_of(name: str, prefix: Optional[str]) -> Optional[int]:
    if prefix is None or not name.startswith(prefix + "."):
        return None
    head = name[len(prefix) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _layer_sizes(tensors: Sequence[Tensor], prefix: Optional[str]) -> list[int]:
    """Bytes of each decoder layer, by layer number (0 .. the highest seen)."""
    by_layer: dict[int, int] = {}
    for t in tensors:
        layer = _layer_of(t.name, prefix)
        if layer is not None:
            by_layer[layer] = by_layer.get(layer, 0) + t.nbytes
    return [by_layer.get(i, 0) for i in range(max(by_layer) + 1)] if by_layer else []


def _split(sizes: list[int], fixed: list[int]) -> list[range]:
    """Contiguous runs of SIZES, one per GPU (len(FIXED)), whose largest GPU
    total (FIXED[d] + its run) is the smallest possible; among those, the one
    with the smallest sum of squared totals (the most even). Dynamic
    programming over (GPUs used, layers placed): layers and GPUs are tens."""
    count, devices = len(sizes), len(fixed)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[d][i]: (largest total, sum of squares) placing layers [0, i) on GPUs [0, d]; cut[d][i]: where d's run starts
    best = [[(fixed[0] + prefix[i], (fixed[0] + prefix[i]) ** 2) for i in range(count + 1)]]
    cut = [[0] * (count + 1)]
    for d in range(1, devices):
        row, cuts = [], []
        for i in range(count + 1):
            choice = None
            for j in range(i + 1):
                load = fixed[d] + prefix[i] - prefix[j]
                before = best[d - 1][j]
                score = (max(before[0], load), before[1] + load * load)
                if choice is None or score < choice[0]:
                    choice = (score, j)
            row.append(choice[0])
            cuts.append(choice[1])
        best.append(row)
        cut.append(cuts)
    runs, end = [], count
    for d in range(devices - 1, -1, -1):
        start = cut[d][end] if d else 0
        runs.append(range(start, end))
        end = start
    return runs[::-1]
