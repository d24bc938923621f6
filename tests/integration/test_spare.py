"""The pre-imported spare by hand (`hostd engine-spare`, issue 51): an engine
started with `spare: true` hands over to a process forked from it, which
serves the same greedy text on the daemon's weights as an engine that
imported everything itself; the spare refuses garbage and oversized request
lines and a peer of another uid, and forks the next engine after them.
(Under systemd, with the cgroup move and MAINPID=: tests/system/test_spare_units.py.)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from harness.local import ForkedProcess, ModelTree, as_other_user, wait_for
from hostd import paths
from hostd.engine import spare
from test_engine_restart import greedy


@pytest.fixture
def tree(tmp_path: Path, tiny_checkpoint: Path):
    model = ModelTree(tmp_path)
    model.write_config(tiny_checkpoint, max_num_seqs=2)
    model.start_weights()
    yield model
    model.stop_all()


def start_spare(tree: ModelTree, checkpoint: Path) -> Path:
    """`spare: true` in the model's YAML, and `hostd engine-spare` by hand on its socket."""
    tree.write_config(checkpoint, fixed={"spare": True}, max_num_seqs=2)
    daemon = tree._spawn("engine-spare")
    path = tree.runtime_dir / paths.SPARE_SOCKET
    wait_for(lambda: tree._connectable(path), 120, "the spare", daemon.proc)
    return path


def ask(path: Path, data: bytes) -> bytes:
    """Send DATA to the spare; what it answers before it closes (b"": nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(30)
        conn.connect(str(path))
        answer = b""
        try:
            conn.sendall(data)
            conn.shutdown(socket.SHUT_WR)
            while chunk := conn.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):  # closed with our bytes unread: refused
            pass
        return answer


def test_an_engine_forked_from_the_spare_serves_as_one_that_imported_itself(tree: ModelTree, tiny_checkpoint: Path):
    own = tree.start_engine()
    expected = greedy(tree)
    assert own.stop() == 0
    start_spare(tree, tiny_checkpoint)
    forked = tree.start_engine()
    assert isinstance(forked.proc, ForkedProcess)  # `hostd engine` exited 0 after the handover
    assert "forked from the spare" in forked.log()
    health = tree.health()
    assert health["weights"] == "daemon" and health["tensors_outside_shared"] == 0
    assert greedy(tree) == expected
    # Its imports were the spare's: far less than the engine that imported them itself.
    assert health["phases_s"]["build_skeleton"] < 0.5
    assert forked.stop() == 0
    assert tree.start_engine().proc.pid != forked.proc.pid  # and the next start forks again


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_the_spare_refuses_garbage_oversized_lines_and_other_uids_then_forks_for_the_next(
        tree: ModelTree, tiny_checkpoint: Path):
    open_dir = Path(tempfile.mkdtemp(prefix="hostd-spare-test-"))
    try:
        path = open_dir / "tiny" / paths.SPARE_SOCKET
        path.parent.mkdir(mode=0o700)  # the spare listens in a private directory only
        tree.write_config(tiny_checkpoint, fixed={"spare": True}, max_num_seqs=2)
        daemon = tree._spawn("engine-spare", "--socket", str(path))
        wait_for(lambda: tree._connectable(path), 120, "the spare", daemon.proc)
        assert ask(path, b"not json\n") == b""
        assert ask(path, json.dumps({"argv": "engine tiny", "started": 0}).encode() + b"\n") == b""
        assert ask(path, b"x" * (spare.REQUEST_LIMIT + 10)) == b""
        # Past the socket's mode (0600, opened here): the peer's uid is checked too.
        os.chmod(open_dir, 0o755)
        os.chmod(path.parent, 0o711)
        os.chmod(path, 0o666)
        assert as_other_user(lambda: ask(path, b'{"argv": ["engine", "tiny"], "started": 0}\n').decode()) == ""
        wait_for(lambda: "refused a request from uid 65534" in daemon.log(), 10, "the uid refusal")
        log = daemon.log()
        assert "refused a request that is not {argv: [strings], started: seconds}" in log
        assert f"a line longer than {spare.REQUEST_LIMIT} bytes" in log
        # Still forking: a good request gets a process, which exits when no "go" comes.
        forked = json.loads(ask(path, b'{"argv": ["engine", "tiny"], "started": 0}\n'))
        assert forked["uid"] == os.getuid() and forked["pid"] != daemon.pid
        wait_for(lambda: ForkedProcess(forked["pid"]).poll() is not None, 30, "the unused fork gone")
        assert daemon.proc.poll() is None
    finally:
        shutil.rmtree(open_dir)
