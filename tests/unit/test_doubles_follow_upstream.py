"""The test doubles accept no flag that the real parser of the upstream
version they imitate rejects: their parsers are built from the flags fixture
(tests/upstream/flags/, generated from vLLM's and SGLang's own parsers by
tests/upstream/generate_flags.py; test_contract.py checks it against the
installed parsers), and nothing else."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
DOUBLES = TESTS / "doubles"
FLAGS = TESTS / "upstream" / "flags"


def load_vllm_double():
    loader = importlib.machinery.SourceFileLoader("vllm_double", str(DOUBLES / "vllm"))
    spec = importlib.util.spec_from_loader("vllm_double", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings
            if not isinstance(action, argparse._HelpAction)}


def test_the_vllm_double_takes_exactly_vllms_flags():
    double = load_vllm_double()
    fixture = json.loads((FLAGS / f"vllm-{double.VERSION}.json").read_text())["flags"]
    _, subparsers = double.build_parser()
    for name, parser in subparsers.items():
        assert options(parser) == set(fixture[name]), name


@pytest.mark.parametrize("argv", [
    ["serve", "/m", "--cuda-graph-sizes", "1"],            # in no vLLM release
    ["preload", "--model", "/m", "--chat-template", "x"],  # a frontend flag: serve only
    ["preload", "--model", "/m", "--uds", "/x.sock"],
])
def test_the_vllm_double_rejects_what_vllm_rejects(argv):
    result = subprocess.run([str(DOUBLES / "vllm"), *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_the_sglang_double_takes_exactly_sglangs_flags():
    sys.path.insert(0, str(DOUBLES / "sglang_double"))
    try:
        from sglang import _common
        from sglang.launch_server import build_parser as server_parser
        from sglang.srt.weight_cache.daemon import build_parser as daemon_parser
    finally:
        sys.path.remove(str(DOUBLES / "sglang_double"))
    fixture = json.loads((FLAGS / f"sglang-{_common.VERSION}.json").read_text())["flags"]
    assert options(server_parser()) == set(fixture["launch_server"])
    assert options(daemon_parser()) == set(fixture["weight_cache.daemon"])
