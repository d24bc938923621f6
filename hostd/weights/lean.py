"""Keep transformers from importing what the builtin engine and weight daemon never use.

One job: the import policy of the processes that build a model (the builtin
engine and weight daemon), applied once by checkpoint.py before anything
imports transformers. An engine's start decides how long a `restart` reload
answers 503, and on the GPU image most of that start was imports:
transformers probes for optional packages and imports them when they are
installed (`python -X importtime`, benchmarks/engine_imports.py).

BLOCKED lists optional packages marked absent (None in sys.modules, the
documented way to stop an import): transformers asks importlib whether they
exist, finds they do not, and skips the code that needs them. Nothing here
changes what the model computes. Each entry needs a measurement
(benchmarks/engine_imports.py --try-block NAME shows the gain).

Tried and left out, for the record: telling transformers that torch has no
torch.distributed (it then skips its own DTensor/FSDP imports) saved nothing
with transformers 5.24 and torch 2.13, because transformers imports
torch._dynamo unconditionally (masking_utils, torch.compiler.disable
decorators) and torch._dynamo itself imports torch.distributed.tensor, FSDP
and sympy. Those stay until transformers or torch import them lazily.

HOSTD_LEAN_IMPORTS=0 in the environment turns the policy off (for a transformers
release that turns out to need one of them; say so in an issue).
"""

from __future__ import annotations

import os
import sys

# Package -> why the builtin engine and daemon can do without it.
BLOCKED = {
    "sklearn": (
        "transformers' assisted generation (generation/candidate_generator.py) imports "
        "scikit-learn when it is installed; the builtin engine never runs assisted "
        "generation. 2.2 s of a 7B engine's imports on the GPU image by "
        "python -X importtime (transformers 5.17; docs/benchmarks.md)."
    ),
    "scipy": (
        "transformers' object-detection losses (loss/loss_for_object_detection.py, "
        "pulled in by modeling_utils through loss/loss_utils.py) import scipy.optimize "
        "when it is installed: 323 modules of a builtin engine's 3,446 on the GPU image "
        "(2026-12-04); a causal LM never computes those losses."
    ),
    "torchvision": (
        "the same losses import transformers.image_transforms, which imports torchvision "
        "when it is installed (image_utils.py): 145 modules on the GPU image; the builtin "
        "engine serves text."
    ),
    "torchaudio": (
        "74 modules of a builtin engine's imports on the GPU image; transformers uses it "
        "only for audio (audio_utils.py, loss/loss_rnnt.py) and the builtin engine serves text."
    ),
    "PIL": (
        "transformers.utils.chat_template_utils and image_transforms import PIL.Image when "
        "Pillow is installed, for image content in chats and image processors: 24 modules "
        "on the GPU image; the builtin engine's chat template renders text."
    ),
    "accelerate": (
        "modeling_utils and integrations/accelerate.py import accelerate when it is "
        "installed, for device maps, offloading and model unwrapping; the builtin engine "
        "builds its model on the meta device and attaches tensors itself "
        "(hostd/weights/checkpoint.py): 49 modules on the GPU image."
    ),
    "triton": (
        "torch._dynamo (imported by transformers.masking_utils) imports Triton when it is "
        "installed, for torch.compile's GPU code generation; the builtin engine runs eager "
        "kernels and CUDA graphs, never torch.compile (hostd/engine/batch.py): 69 modules "
        "on the GPU image."
    ),
}

_applied = False


def enabled() -> bool:
    return os.environ.get("HOSTD_LEAN_IMPORTS", "1") != "0"


def apply() -> None:
    """Install the policy in this process (once; a no-op when disabled, and
    where transformers is imported already: it decided at its import which
    optional packages exist (accelerate, for one) and would import a blocked
    one later and fail; random_model.py imports it first, for instance)."""
    global _applied
    if _applied or not enabled() or "transformers" in sys.modules:
        return
    _applied = True
    for name in BLOCKED:
        sys.modules.setdefault(name, None)
