"""model@.service's ExecStartPost= (hostd/startwait.py): a start ends when the
model serves, or fails naming the unit that cannot serve and its last error."""

from __future__ import annotations

from hostd import startwait


def test_a_failed_engine_fails_the_start_naming_the_unit_and_its_last_error(monkeypatch, capsys):
    states = {
        "model-weights@vq.service": {"ActiveState": "active", "SubState": "running", "Result": "success"},
        "model-engine@vq.service": {"ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
                                    "ExecMainStatus": "1"},
    }
    monkeypatch.setattr(startwait, "gateway_state", lambda name: "starting")
    monkeypatch.setattr(startwait, "unit_state", states.__getitem__)
    monkeypatch.setattr(startwait, "last_error", lambda unit: "vllm: executable /nonexistent/vllm not found")
    assert startwait.main(["vq"]) == 1
    err = capsys.readouterr().err
    assert "model vq cannot serve: model-engine@vq.service failed (exit-code, exit status 1" in err
    assert "vllm: executable /nonexistent/vllm not found" in err


def test_the_start_ends_when_the_gateway_serves(monkeypatch):
    answers = iter(["starting", None, "serving"])
    monkeypatch.setattr(startwait, "POLL", 0)
    monkeypatch.setattr(startwait, "gateway_state", lambda name: next(answers))
    monkeypatch.setattr(startwait, "unit_state", lambda unit: {"ActiveState": "active", "SubState": "running"})
    assert startwait.main(["tiny"]) == 0
