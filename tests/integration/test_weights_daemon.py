"""The weight cache daemon as a real process: what it refuses, and that a
refusal never disturbs the clients it serves."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

import msgspec
import pytest

from hostd.checkpoints.random_model import write_checkpoint
from hostd.weights import client, protocol
from harness.local import ModelTree, as_other_user, wait_for


@pytest.fixture
def tree(tmp_path: Path, tiny_checkpoint: Path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    model = ModelTree(tmp_path)
    model.write_config(checkpoint)
    yield model
    model.stop_all()


def raw_connection(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(10)
    conn.connect(str(path))
    return conn


def closed_without_answer(conn: socket.socket) -> bool:
    with conn:
        try:
            return conn.recv(1) == b""
        except ConnectionResetError:  # closed with our bytes unread
            return True


def framed(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def test_status_names_the_daemon_its_socket_and_what_it_holds(tree: ModelTree):
    daemon = tree.start_weights()
    status = client.status(tree.weights_socket)
    assert status.pid == daemon.pid
    assert status.socket_inode == os.stat(tree.weights_socket).st_ino
    assert status.tensors > 0 and status.bytes_by_device["cpu"] > 0
    assert status.fingerprint.model_path == str(tree.root / "checkpoint")
    assert status.fingerprint.architecture == "Qwen2ForCausalLM"
    assert len(status.fingerprint.content_digest) == 64
    assert oct(os.stat(tree.weights_socket).st_mode & 0o777) == "0o600"
    assert oct(os.stat(tree.runtime_dir).st_mode & 0o777) == "0o700"


def test_engine_refuses_a_daemon_holding_same_shapes_with_other_values(tree: ModelTree):
    """A fine-tune written over the base checkpoint keeps every tensor name and
    shape; the content digest still tells them apart (vllm issue 59647)."""
    daemon = tree.start_weights()
    write_checkpoint(tree.root / "checkpoint", seed=1)  # same names and shapes, new values

    engine = tree.start_engine(wait=False)

    assert engine.proc.wait(120) == 1
    log = engine.log()
    assert "fingerprint mismatch in content_digest " in log
    assert "model_path" not in log.split("fingerprint mismatch in ")[1].split(" (")[0]
    assert "refused engine pid" in daemon.log() and "content_digest" in daemon.log()
    assert daemon.proc.poll() is None  # the daemon keeps serving
    assert client.status(tree.weights_socket).pid == daemon.pid


@pytest.mark.parametrize(
    "frame, logged",
    [
        (framed(b"\xc1\xc1\xc1\xc1\xc1"), "not a valid request"),
        (framed(msgspec.msgpack.encode({"type": "shutdown"})), "not a valid request"),
        (struct.pack(">I", 100) + b"0123456789", "truncated frame"),
        (struct.pack(">I", protocol.MAX_FRAME + 1), "exceeds the"),
        (b"\x00\x00", "truncated frame"),
    ],
    ids=["garbage", "unknown-message", "truncated", "oversized", "short-header"],
)
def test_bad_frames_close_that_connection_only(tree: ModelTree, frame: bytes, logged: str):
    daemon = tree.start_weights()
    bystander = raw_connection(tree.weights_socket)  # a client mid-request meanwhile

    bad = raw_connection(tree.weights_socket)
    bad.sendall(frame)
    bad.shutdown(socket.SHUT_WR)
    assert closed_without_answer(bad)

    wait_for(lambda: logged in daemon.log(), 10, f"log line {logged!r}")
    protocol.send_frame(bystander, protocol.StatusRequest())
    answer, _fds, _pid = protocol.recv_response(bystander)
    bystander.close()
    assert isinstance(answer, protocol.Status) and answer.pid == daemon.pid
    assert client.status(tree.weights_socket).pid == daemon.pid


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_peer_with_another_uid_is_refused_even_when_the_socket_is_open(tree: ModelTree):
    # A socket every user can reach (the units never do this: 0600 in a 0700
    # directory), so that only the SO_PEERCRED check stands guard.
    open_dir = Path(tempfile.mkdtemp(prefix="hostd-uid-test-"))
    try:
        _refuses_other_uid(tree, open_dir / "tiny" / "weights.sock")
    finally:
        shutil.rmtree(open_dir)


def _refuses_other_uid(tree: ModelTree, socket_path: Path) -> None:
    daemon = tree.start_weights("--socket", str(socket_path))
    os.chmod(socket_path.parent.parent, 0o755)
    os.chmod(socket_path.parent, 0o711)
    os.chmod(socket_path, 0o666)

    def status_as_nobody() -> str:
        conn = raw_connection(socket_path)
        protocol.send_frame(conn, protocol.StatusRequest())
        return "closed" if conn.recv(1) == b"" else "answered"

    outcome = as_other_user(status_as_nobody)
    # Refused before a byte is read: the peer sees the connection closed, reset,
    # or (when the close wins the race with its send) a broken pipe.
    assert outcome in ("closed", "error: [Errno 104] Connection reset by peer",
                       "error: [Errno 32] Broken pipe"), outcome
    wait_for(lambda: "uid 65534 is neither" in daemon.log(), 10, "refusal log line")
    assert client.status(socket_path).pid == daemon.pid


def test_a_symlinked_socket_path_is_refused(tree: ModelTree, tmp_path: Path):
    tree.start_weights()
    link = tmp_path / "link.sock"
    link.symlink_to(tree.weights_socket)
    with pytest.raises(Exception, match="symbolic link"):
        client.status(link)
