"""Every CUDA test is in the ledger (issue 48): CI has no GPU, so the tests of
tests/gpu and tests/gpu_system never run there, and tests/gpu/README.md says
for each the commit at which it last passed on CUDA. A test that the ledger
does not name fails here; so does a GPU system test that no part of
run-gpu-tier.sh would run, and a part that names a test that is gone."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEDGER = ROOT / "tests/gpu/README.md"
CUDA_FOLDERS = (ROOT / "tests/gpu", ROOT / "tests/gpu_system")


def cuda_tests(folders=CUDA_FOLDERS) -> set[str]:
    """'tests/FOLDER/FILE.py::test_name' for each test function in FOLDERS."""
    found = set()
    for folder in folders:
        for path in sorted(folder.glob("test_*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                    found.add(f"{path.relative_to(path.parents[2]).as_posix()}::{node.name}")
    return found


def ledger_rows(text: str) -> dict[str, str]:
    """The ledger's rows: test id -> when it last passed on CUDA."""
    rows = {}
    for test, passed in re.findall(r"^\| `(tests/[^`]+::test_\w+)` \| ([^|]+) \|", text, re.M):
        rows[test] = passed.strip()
    return rows


def unlisted(tests: set[str], ledger_text: str) -> set[str]:
    return tests - set(ledger_rows(ledger_text))


def test_every_cuda_test_is_in_the_ledger():
    tests = cuda_tests()
    assert len(tests) >= 20, tests  # both folders found
    assert unlisted(tests, LEDGER.read_text()) == set()


def test_the_ledger_names_no_test_that_is_gone():
    assert set(ledger_rows(LEDGER.read_text())) - cuda_tests() == set()


def test_every_row_says_a_commit_or_never():
    for test, passed in ledger_rows(LEDGER.read_text()).items():
        assert re.match(r"([0-9a-f]{7,40}\b|never\b)", passed), (test, passed)


def test_a_planted_unlisted_gpu_test_is_caught(tmp_path):
    planted = tmp_path / "tests/gpu"
    planted.mkdir(parents=True)
    (planted / "test_planted.py").write_text("def test_new_cuda_path():\n    pass\n")
    tests = cuda_tests((planted,)) | cuda_tests()
    assert unlisted(tests, LEDGER.read_text()) == {"tests/gpu/test_planted.py::test_new_cuda_path"}


def test_each_gpu_system_part_names_tests_that_exist_and_every_test_has_a_part():
    spec = importlib.util.spec_from_file_location("gpu_tier_parts", ROOT / "tests/gpu_system/tier_parts.py")
    tier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tier)
    names = [t.split("::")[1] for t in cuda_tests((ROOT / "tests/gpu_system",))]
    for prefix in tier.EVERY_PART + tier.PART_2:
        assert any(name.startswith(prefix) for name in names), f"{prefix}: no such test in tests/gpu_system"
    for name in names:
        assert tier.tier_part(name) <= {"1", "2"} and tier.tier_part(name)
    # The two parts together are the whole tier, and part 2 is not the whole of it.
    assert {n for n in names if "1" in tier.tier_part(n)} | {n for n in names if "2" in tier.tier_part(n)} == set(names)
    assert {n for n in names if tier.tier_part(n) == {"1"}}
