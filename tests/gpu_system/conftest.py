"""The GPU system tier: hostd's units, hardening and manager under a real
systemd 252 on a CUDA machine (tests/gpu_system/README.md).

Runs only where CUDA exists, exactly as tests/gpu does: elsewhere (CI, the
CPU machine) every test is skipped with the reason, whatever CI=true says,
since no CI machine has a GPU. HOSTD_GPU_TIER_DEVICE=cpu runs the same tests
on a CPU machine with the tiny model (the harness's own debugging, where
device time costs nothing); the CUDA-only checks skip there.

packaging/run-gpu-tier.sh starts it on the GPU machine, one part a command
(tier_parts.py): the whole tier outgrew one device-tool call (539 s of the
600 s a call may run on the H200 at 4bf6be2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# container.py, ports.py and the system tier's helpers, whatever pytest's --import-mode is.
sys.path.insert(0, str(HERE.parent / "system"))
sys.path.insert(0, str(HERE))

from debian_container import DEBS  # noqa: E402
from tier_parts import PART_ENV, tier_part  # noqa: E402


def tier_device() -> tuple[str | None, str]:
    """('cuda' | 'cpu', '') where the tier runs, or (None, why it is skipped)."""
    wanted = os.environ.get("HOSTD_GPU_TIER_DEVICE", "").strip()
    if wanted == "cpu":
        return "cpu", ""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device here: the GPU system tier runs on the GPU machine (packaging/run-gpu-tier.sh)"
    return "cuda", ""


def pytest_collection_modifyitems(config, items) -> None:
    part = os.environ.get(PART_ENV, "").strip()
    if not part:
        return  # the whole tier, in file order
    if part not in ("1", "2"):
        raise pytest.UsageError(f"{PART_ENV}={part!r}: the GPU system tier has parts 1 and 2")
    chosen = [item for item in items
              if HERE not in Path(item.path).parents or part in tier_part(item.originalname)]
    config.hook.pytest_deselected(items=[item for item in items if item not in chosen])
    items[:] = chosen


@pytest.fixture(scope="session")
def device() -> str:
    found, why = tier_device()
    if found is None:
        pytest.skip(why)
    if not DEBS.is_dir():
        pytest.skip(f"{DEBS} is missing: run packaging/fetch-gpu-tier.sh on a Debian 12 machine first")
    return found


class Results:
    """What the tier measured (seconds, MiB, tables), written as JSON to
    $HOSTD_GPU_TIER_RESULTS/results.json as each test ends, for docs/benchmarks.md."""

    def __init__(self) -> None:
        directory = os.environ.get("HOSTD_GPU_TIER_RESULTS")
        self.dir = Path(directory) if directory else None
        self.data: dict = {}

    def __setitem__(self, key: str, value) -> None:
        self.data[key] = value
        print(f"[gpu tier] {key} = {json.dumps(value)}", flush=True)
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "results.json").write_text(json.dumps(self.data, indent=1, sort_keys=True))

    def write(self, name: str, text: str) -> None:
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / name).write_text(text)


@pytest.fixture(scope="session")
def results() -> Results:
    return Results()
