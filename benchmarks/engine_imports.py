"""Benchmark: what the builtin engine's imports cost, with and without hostd's import policy.

Each run is a fresh interpreter doing what an engine does before it attaches
weights: import hostd.engine.main (torch, transformers), build the model
skeleton on the meta device (which imports the model's transformers module),
load the tokenizer and import the HTTP server. Variants run interleaved:

- full: HOSTD_LEAN_IMPORTS=0 (transformers imports whatever is installed);
- lean: hostd/weights/lean.py's policy (the default);
- lean+NAMES (with --try-block): lean, and NAMES also marked absent: how to
  find the next candidate for lean.BLOCKED (then check the engine still works);
- lean+no-distributed (with --try-no-distributed): lean, and transformers
  told that torch has no torch.distributed.

Prints the median wall time per variant, and with --importtime the modules
that cost most (python -X importtime, one run of the first variant and one of
lean): where the remaining time goes.

    python benchmarks/engine_imports.py --runs 5 --importtime
    python benchmarks/engine_imports.py --runs 5 --try-block torchvision,PIL
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import sys, time
started = time.monotonic()
for name in filter(None, sys.argv[2].split(",")):
    if name == "torch.distributed":  # --try-no-distributed
        import torch.distributed
        torch.distributed.is_available = lambda: False
    else:
        sys.modules.setdefault(name, None)
import hostd.engine.main
from pathlib import Path
from hostd.weights import checkpoint
checkpoint.build_skeleton(Path(sys.argv[1]), "bfloat16", meta_buffers=True)
from transformers import AutoTokenizer
AutoTokenizer.from_pretrained(sys.argv[1])
import hostd.engine.server
heavy = ("sklearn", "scipy", "torchvision", "torchaudio", "accelerate", "triton", "PIL", "sympy", "torch._dynamo",
         "torch.distributed.tensor")
loaded = sorted(n for n in heavy if sys.modules.get(n) is not None)
count = sum(m is not None for m in sys.modules.values())
print(f"{time.monotonic() - started:.3f} {count} {','.join(loaded)}")
"""


def run_child(checkpoint: Path, lean: bool, block: str, importtime: bool = False) -> tuple[float, str, str, str]:
    env = {**os.environ, "HOSTD_LEAN_IMPORTS": "1" if lean else "0"}
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-c", CHILD, str(checkpoint), block]
    started = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    wall = time.monotonic() - started
    _, modules, loaded = (proc.stdout.strip().split(" ", 2) + [""])[:3]
    return wall, modules, loaded, proc.stderr


def top_imports(stderr: str, count: int) -> list[tuple[int, int, str]]:
    """(cumulative us, self us, module) of the costliest modules at depth <= 2."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, cumulative, name = line[len("import time:"):].split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2
        if depth <= 2:
            rows.append((int(cumulative), int(self_us), name.strip()))
    return sorted(rows, reverse=True)[:count]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkpoint", type=Path, help="default: a tiny random checkpoint written here")
    parser.add_argument("--try-block", default="", help="comma-separated packages to mark absent as well")
    parser.add_argument("--try-no-distributed", action="store_true",
                        help="a variant where transformers is told torch has no torch.distributed")
    parser.add_argument("--importtime", action="store_true", help="also print the costliest imports")
    args = parser.parse_args()
    checkpoint = args.checkpoint
    if checkpoint is None:
        from hostd.checkpoints.random_model import write_checkpoint

        checkpoint = write_checkpoint(Path(tempfile.mkdtemp(prefix="hostd-imports-")) / "tiny")
    variants = {"full": (False, ""), "lean": (True, "")}
    if args.try_block:
        variants[f"lean+{args.try_block}"] = (True, args.try_block)
    if args.try_no_distributed:
        variants["lean+no-distributed"] = (True, "torch.distributed")
    samples: dict[str, list[float]] = {name: [] for name in variants}
    loaded: dict[str, str] = {}
    modules: dict[str, str] = {}
    run_child(checkpoint, True, "")  # warm the page cache and __pycache__
    for _ in range(args.runs):
        for name, (lean, block) in variants.items():
            wall, modules[name], loaded[name], _ = run_child(checkpoint, lean, block)
            samples[name].append(wall)
            print(f"# {name}: {wall:.2f} s", file=sys.stderr)

    import torch
    import transformers

    print(f"\nEngine imports + skeleton + tokenizer, fresh interpreter, {args.runs} runs each, "
          f"interleaved; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"Python {sys.version.split()[0]}.\n")
    print("| variant | median s | min–max s | modules imported | heavy modules still imported |")
    print("|---|---|---|---|---|")
    for name, values in samples.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} "
              f"| {modules[name]} | {loaded[name] or '-'} |")
    if args.importtime:
        for name in ("full", "lean"):
            lean, block = variants[name]
            _, _, _, stderr = run_child(checkpoint, lean, block, importtime=True)
            print(f"\nCostliest imports ({name}; depth <= 2; cumulative and self, ms):\n")
            print("| module | cumulative | self |")
            print("|---|---|---|")
            for cumulative, self_us, module in top_imports(stderr, 25):
                print(f"| {module} | {cumulative / 1000:.0f} | {self_us / 1000:.0f} |")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
