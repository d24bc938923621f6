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
import os
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


# Values upstream's own parsers refuse (exit 2) while parsing: the issue 26
# list. tests/upstream/test_contract.py gives the same command lines to the
# real parsers and checks that they refuse them too.
VALUE_REFUSALS = [
    ("vllm", ["serve", "/m", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    ("vllm", ["serve", "/m", "--max-num-seqs", "abc"], "argument --max-num-seqs: invalid int value: 'abc'"),
    ("vllm", ["serve", "/m", "--gpu-memory-utilization", "x"], "--gpu-memory-utilization: invalid float value: 'x'"),
    ("vllm", ["preload", "--model", "/m", "--tensor-parallel-size", "two"],
     "--tensor-parallel-size/-tp: invalid int value: 'two'"),
    ("sglang.launch_server", ["--model-path", "/m", "--mem-fraction-static", "lots"],
     "argument --mem-fraction-static: invalid float value: 'lots'"),
    ("sglang.launch_server", ["--model-path", "/m", "--port", "x"], "argument --port: invalid int value: 'x'"),
    ("sglang.launch_server", ["--model-path", "/m", "--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
    ("sglang.srt.weight_cache.daemon", ["--model-path", "/m", "--mem-fraction-static", "lots"],
     "argument --mem-fraction-static: invalid float value: 'lots'"),
    ("sglang.srt.weight_cache.daemon", ["--model-path", "/m", "--port", "x"], "argument --port: invalid int value: 'x'"),
    ("sglang.srt.weight_cache.daemon", ["--model-path", "/m", "--dtype", "bogus"],
     "argument --dtype: invalid choice: 'bogus'"),
]


def run_double(double: str, argv: list[str]) -> subprocess.CompletedProcess:
    if double == "vllm":
        command = [str(DOUBLES / "vllm"), *argv]
    else:
        command = [sys.executable, "-m", double, *argv]
    env = {**os.environ, "PYTHONPATH": str(DOUBLES / "sglang_double")}
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=DOUBLES)


@pytest.mark.parametrize(("double", "argv", "words"), VALUE_REFUSALS, ids=[f"{d}:{' '.join(a[-2:])}"
                                                                             for d, a, _ in VALUE_REFUSALS])
def test_every_double_refuses_the_values_upstreams_parser_refuses(double, argv, words):
    result = run_double(double, argv)
    assert result.returncode == 2 and words in result.stderr, (result.returncode, result.stderr[-500:])


@pytest.mark.parametrize(("double", "argv"), [
    ("vllm", ["serve", "/m", "--dtype", "bfloat16", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
              "--cudagraph-capture-sizes", "1", "2", "--max-model-len", "auto", "--help"]),
    ("vllm", ["preload", "--model", "/m", "--tensor-parallel-size", "2", "--help"]),
    ("sglang.launch_server", ["--model-path", "/m", "--mem-fraction-static", "0.7", "--port", "8001",
                              "--dtype", "bfloat16", "--chunked-prefill-size", "-1", "--help"]),
])
def test_the_doubles_take_the_values_upstream_takes(double, argv):
    """The positive control: the same flags with values upstream takes parse
    (--help: the double stops after parsing, as upstream's would)."""
    result = run_double(double, argv)
    assert result.returncode == 0, result.stderr[-500:]


def test_the_vllm_double_refuses_a_quantization_vllm_does_not_know():
    """vLLM's parser takes any --quantization; its ModelConfig refuses an unknown
    method at start (exit 1). The fixture records vLLM's methods."""
    fixture = json.loads((FLAGS / f"vllm-{load_vllm_double().VERSION}.json").read_text())
    assert "fp8" in fixture["quantization_methods"]
    result = run_double("vllm", ["serve", "/m", "--quantization", "fp9"])
    assert result.returncode == 1 and "Unknown quantization method: fp9" in result.stderr, result.stderr[-500:]
