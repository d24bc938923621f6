"""The README's main-job command, end to end, in CI's conditions (systemd is
not PID 1 here, so the demo boots its own throwaway container)."""

from __future__ import annotations

import socket
import subprocess

from conftest import CHECKOUT, require_container_support


def test_readme_main_job_serves_a_model_under_systemd():
    require_container_support()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        ["bash", "packaging/demo.sh", "--port", str(port)],
        cwd=CHECKOUT, capture_output=True, text=True, timeout=1200,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "the model serves" in out
    assert "models: ['tiny']" in out
    assert "completion (16 tokens):" in out
    assert "Active: active (running)" in out
    assert "engine.max_num_seqs 4 -> 8" in out and "unchanged: weights reused" in out
    assert "reload of tiny: done (strategy overlap, weights reused)" in out
    assert "hostd-engine[" in out and "hostd-weights[" in out and "hostd-gateway[" in out
