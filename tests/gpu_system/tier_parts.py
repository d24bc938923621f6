"""The GPU system tier's parts, each one command on the GPU machine that
finishes within 480 s there (tests/gpu_system/README.md has the measured
times): `run-gpu-tier.sh 1` and `run-gpu-tier.sh 2` set HOSTD_GPU_TIER_PART,
and conftest.py deselects the other part's tests. Imports nothing, so that
tests/unit/test_gpu_ledger.py checks these names on the CPU machine.

Each part boots its own container; both start the model first and stop it
last (EVERY_PART). Part 2 holds the tests that run a second engine pair or
a standby beside the main one, and two short ones that balance the times;
part 1 the rest, the two-GPU module included. A test named nowhere runs in
part 1.
"""

from __future__ import annotations

PART_ENV = "HOSTD_GPU_TIER_PART"
#: Test function names start with these.
EVERY_PART = ("test_start_returns_once_serving", "test_stop_returns_gpu_memory")
PART_2 = ("test_a_checkpoint_swap", "test_the_warm_standby", "test_the_nvml_preflight",
          "test_a_reload_the_engine_refuses", "test_an_in_place_reload", "test_the_pre_imported_spare")


def tier_part(test_name: str) -> set[str]:
    """The parts ('1', '2') that run the test of this function name."""
    if test_name.startswith(EVERY_PART):
        return {"1", "2"}
    return {"2"} if test_name.startswith(PART_2) else {"1"}
