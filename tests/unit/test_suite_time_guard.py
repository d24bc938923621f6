"""The suite's time guard (tests/conftest.py, issue 54): a run past
HOSTD_SUITE_LIMIT_S fails with one line naming its slowest modules; one
within it passes as before. Shown on a scratch run: a planted slow test in a
directory of its own, with this checkout's conftest, under a 1-second limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def scratch_run(tmp_path: Path, limit: str) -> subprocess.CompletedProcess:
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_planted_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(1.5)\n")
    env = {**os.environ, "HOSTD_SUITE_LIMIT_S": limit}
    env.pop("HOSTD_RUN_STARTED", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_run_past_the_limit_fails_naming_its_slowest_modules(tmp_path):
    run = scratch_run(tmp_path, "1")
    assert run.returncode == 1, run.stdout + run.stderr
    assert "past the suite's limit of 0.0 min (HOSTD_SUITE_LIMIT_S" in run.stdout, run.stdout
    assert "the slowest modules: test_planted_slow.py 2 s" in run.stdout or \
        "the slowest modules: test_planted_slow.py 1 s" in run.stdout, run.stdout


def test_a_run_within_the_limit_passes(tmp_path):
    run = scratch_run(tmp_path, "600")
    assert run.returncode == 0 and "suite time guard" not in run.stdout, run.stdout
