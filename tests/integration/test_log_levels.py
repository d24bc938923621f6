"""A running process's log level changes without a restart: the signal
Model.SetLogLevel has systemd send (hostd/logs.py's LEVEL_SIGNALS, to the
unit's main process) turns on DEBUG lines in a running engine, gateway and
weights daemon, by hand here, and back off, every process the same PID
throughout. (Through hostctl, the manager and systemd:
tests/system/test_verbs.py.)"""

from __future__ import annotations

import os
from pathlib import Path

from hostd import logs
from harness.local import ModelTree, free_port, wait_for
from test_overlap import completion


def debug_lines(text: str, component: str) -> list[str]:
    return [line for line in text.splitlines() if f"hostd-{component}[tiny] DEBUG " in line]


def test_a_signal_turns_debug_lines_on_and_off_in_a_running_engine_and_gateway_with_the_same_pids(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    port = free_port()
    tree = ModelTree(tmp_path)
    trees.append(tree)
    tree.write_config(tiny_checkpoint, fixed={"listen": f"127.0.0.1:{port}"})
    tree.start_serving(port)
    weights, engine, gateway = tree.daemons
    before = tree.health()
    assert (before["pid"], before["weights_pid"]) == (engine.pid, weights.pid)

    def traffic() -> None:  # what writes debug lines: a completion (engine), a control request (gateway)
        assert completion(tree.base_url, 2) == "length"
        tree.control("status")

    traffic()
    assert debug_lines(engine.log(), "engine") == [] and debug_lines(gateway.log(), "gateway") == []

    for daemon in (weights, engine, gateway):
        os.kill(daemon.pid, logs.level_signal("debug"))
    for daemon, component in ((weights, "weights"), (engine, "engine"), (gateway, "gateway")):
        wait_for(lambda: "INFO log level debug (was info), set by a signal" in daemon.log(), 30,
                 f"the {component} saying it logs at debug", daemon.proc)
    traffic()
    wait_for(lambda: any(" prompt + " in line for line in debug_lines(engine.log(), "engine")), 30,
             "the engine's debug line for the completion", engine.proc)
    wait_for(lambda: any("control: status from pid" in line for line in debug_lines(gateway.log(), "gateway")),
             30, "the gateway's debug line for the control request", gateway.proc)

    for daemon in (engine, gateway):
        os.kill(daemon.pid, logs.level_signal("info"))
    for daemon in (engine, gateway):
        wait_for(lambda: "log level info (was debug)" in daemon.log(), 30, "back at info", daemon.proc)
    seen = {"engine": len(debug_lines(engine.log(), "engine")), "gateway": len(debug_lines(gateway.log(), "gateway"))}
    traffic()
    assert len(debug_lines(engine.log(), "engine")) == seen["engine"]
    assert len(debug_lines(gateway.log(), "gateway")) == seen["gateway"]

    after = tree.health()  # the same processes throughout: nothing restarted, the weights never reloaded
    assert (after["pid"], after["weights_pid"]) == (engine.pid, weights.pid)
    assert all(daemon.proc.poll() is None for daemon in (weights, engine, gateway))
