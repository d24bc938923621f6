"""Engine restarts attach the daemon's weights: same daemon, same output, and
the engine's weights are the daemon's memory, not a copy."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from harness.local import ModelTree
from hostd.weights import client

PROMPT = "Once upon a time there was a model"


@pytest.fixture
def tree(tmp_path: Path, tiny_checkpoint: Path):
    model = ModelTree(tmp_path)
    model.write_config(tiny_checkpoint, max_num_seqs=2)
    yield model
    model.stop_all()


def greedy(tree: ModelTree) -> str:
    with tree.http() as http:
        response = http.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
        )
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def memfd_mappings(pid: int) -> list[dict]:
    """The engine's mappings of the daemon's memfd, from /proc/PID/smaps."""
    found, current = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$", line)
        if head:
            current = None
            if "memfd:hostd-weights-" in head.group(5):
                current = {
                    "start": int(head.group(1), 16), "end": int(head.group(2), 16),
                    "perms": head.group(3), "inode": int(head.group(4)),
                }
                found.append(current)
        elif current is not None and ":" in line:
            key, value = line.split(":", 1)
            current[key] = value.strip()
    return found


def daemon_memfd_inode(pid: int) -> int:
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("/memfd:hostd-weights-"):
            return os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    raise AssertionError("the daemon holds no hostd memfd")


def test_engine_restart_keeps_daemon_pid_inode_and_output_and_shares_memory(tree: ModelTree):
    daemon = tree.start_weights()
    socket_inode = os.stat(tree.weights_socket).st_ino
    held = daemon_memfd_inode(daemon.pid)
    outputs = []
    for restart in range(4):  # the first start and three restarts
        engine = tree.start_engine()
        health = tree.health()
        outputs.append(greedy(tree))

        # The same daemon process behind the same socket file, every time.
        assert health["weights_pid"] == daemon.pid == client.status(tree.weights_socket).pid
        assert health["weights_socket_inode"] == socket_inode == os.stat(tree.weights_socket).st_ino

        # Not a copy: the engine maps the very memfd the daemon holds (same
        # inode), read-only and shared ("r--s": a MAP_SHARED mapping of the
        # daemon's pages; writes would fault, nothing can copy on write); every
        # parameter and buffer of the model points inside that mapping; and the
        # mapping holds no anonymous (copied) pages. ("Private_*" in smaps only
        # means no other process maps those page-cache pages: the daemon holds
        # the memfd without mapping it.)
        [mapping] = memfd_mappings(engine.pid)
        assert mapping["inode"] == held
        assert mapping["perms"] == "r--s"
        assert mapping["start"] <= health["shared_ptr"] < mapping["end"]
        assert health["shared_bytes"] <= mapping["end"] - mapping["start"]
        assert health["tensors_total"] > 0 and health["tensors_outside_shared"] == 0
        assert mapping["Anonymous"] == "0 kB"
        assert engine.stop() == 0
    assert len(set(outputs)) == 1 and outputs[0], outputs
    assert daemon.proc.poll() is None
