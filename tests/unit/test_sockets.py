"""hostd.sockets: the one rule for what may already be at a socket path, and
the modes and owners of what we bind."""

from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from hostd import sockets


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run" / "tiny"
    sockets.ensure_private_dir(directory)
    return directory


def answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as client:
        try:
            client.connect(str(path))
        except ConnectionRefusedError:
            return False
    return True


def dead_socket(path: Path) -> None:
    """What a killed server leaves: the socket file, nobody listening."""
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()


def test_bind_private_makes_a_0600_socket_in_a_0700_directory(private_dir: Path):
    path = private_dir / "engine.sock"
    listener = sockets.bind_private(path)
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(private_dir).st_mode) == 0o700
        assert os.lstat(path).st_uid == os.getuid()
        assert answers(path)
    finally:
        listener.release()
    assert not path.exists()


def test_stale_socket_nobody_answers_is_replaced(private_dir: Path):
    path = private_dir / "engine.sock"
    dead_socket(path)
    assert not answers(path)
    listener = sockets.bind_private(path)
    try:
        assert answers(path)
    finally:
        listener.release()


def test_live_socket_is_refused_and_kept(private_dir: Path):
    path = private_dir / "engine.sock"
    first = sockets.bind_private(path)
    try:
        inode = os.lstat(path).st_ino
        with pytest.raises(sockets.InUse, match="already serving"):
            sockets.bind_private(path)
        assert os.lstat(path).st_ino == inode and answers(path)  # the first server still serves
    finally:
        first.release()


def test_live_socket_with_a_full_backlog_is_still_live(private_dir: Path):
    path = private_dir / "engine.sock"
    first = sockets.bind_private(path, backlog=0)
    clients = []
    try:
        for _ in range(4):  # fill the backlog; the listener never accepts
            client = socket.socket(socket.AF_UNIX)
            client.setblocking(False)
            try:
                client.connect(str(path))
            except BlockingIOError:
                pass
            clients.append(client)
        with pytest.raises(sockets.InUse):
            sockets.claim(path)
    finally:
        for client in clients:
            client.close()
        first.release()


def test_symlink_at_the_socket_path_is_refused(private_dir: Path, tmp_path: Path):
    target = tmp_path / "elsewhere.sock"
    dead_socket(target)
    path = private_dir / "engine.sock"
    path.symlink_to(target)
    with pytest.raises(sockets.UnsafePath, match="symbolic link"):
        sockets.bind_private(path)
    assert path.is_symlink() and target.exists()


def test_regular_file_at_the_socket_path_is_refused(private_dir: Path):
    path = private_dir / "engine.sock"
    path.write_text("not a socket")
    with pytest.raises(sockets.UnsafePath, match="not a socket"):
        sockets.bind_private(path)
    assert path.read_text() == "not a socket"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a socket owned by another uid")
def test_foreign_owned_socket_is_refused(private_dir: Path):
    path = private_dir / "engine.sock"
    dead_socket(path)
    os.lchown(path, 65534, 65534)
    with pytest.raises(sockets.UnsafePath, match="owned by uid 65534"):
        sockets.bind_private(path)
    assert os.lstat(path).st_uid == 65534


def test_directory_open_to_others_is_refused(tmp_path: Path):
    directory = tmp_path / "open"
    directory.mkdir(mode=0o755)
    os.chmod(directory, 0o755)
    with pytest.raises(sockets.UnsafePath, match="must be 0700"):
        sockets.bind_private(directory / "engine.sock")
    assert not (directory / "engine.sock").exists()


def test_symlinked_directory_is_refused(tmp_path: Path, private_dir: Path):
    link = tmp_path / "link"
    link.symlink_to(private_dir)
    with pytest.raises(sockets.UnsafePath, match="not a directory"):
        sockets.bind_private(link / "engine.sock")


def test_bind_public_is_0666_and_follows_the_same_stale_rule(tmp_path: Path):
    path = tmp_path / "public" / "model.sock"
    listener = sockets.bind_public(path)
    try:
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o666
        with pytest.raises(sockets.InUse):
            sockets.bind_public(path)
    finally:
        listener.close()  # closed without removing: now stale
    replacement = sockets.bind_public(path)
    replacement.release()
    assert not path.exists()


def test_release_leaves_a_successors_socket_alone(private_dir: Path):
    path = private_dir / "engine.sock"
    first = sockets.bind_private(path)
    first.close()
    time.sleep(0.02)  # the kernel may reuse the inode number; the change time differs
    second = sockets.bind_private(path)  # the first one's file was stale
    try:
        first.release()
        assert answers(path)
    finally:
        second.release()
    assert not path.exists()


def test_release_of_a_passed_socket_only_closes_it(private_dir: Path):
    path = private_dir / "weights.sock"
    passed = socket.socket(socket.AF_UNIX)  # as systemd hands it over
    passed.bind(str(path))
    passed.listen()
    sockets.release(passed)
    assert passed.fileno() == -1 and path.exists()


# What a socket-activated daemon sees: systemd's socket at fd 3 and
# LISTEN_PID/LISTEN_FDS naming this process. Run in a fresh interpreter,
# whose fd 3 is free.
_ACTIVATED = """
import os, socket, sys
from pathlib import Path
from hostd import sockets
passed = socket.socket(socket.AF_UNIX)
passed.bind(sys.argv[1])
passed.listen()
os.dup2(passed.fileno(), 3)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="1")
got = sockets.acquire(Path(sys.argv[2]))
print(got.fileno(), got.getsockname(), os.path.exists(sys.argv[2]), "LISTEN_FDS" in os.environ)
sockets.release(got)
print(os.path.exists(sys.argv[1]))
"""


def test_acquire_takes_the_socket_systemd_passed_and_binds_nothing(private_dir: Path):
    import subprocess
    import sys

    passed, own = private_dir / "passed.sock", private_dir / "own.sock"
    out = subprocess.run([sys.executable, "-c", _ACTIVATED, str(passed), str(own)], capture_output=True,
                         text=True, check=True).stdout.split()
    # fd 3, systemd's path, our own path never bound, the variables gone
    # (children must not take the socket); released: closed, its file left.
    assert out == ["3", str(passed), "False", "False", "True"]


def test_acquire_binds_the_path_private_when_nothing_was_passed(private_dir: Path, monkeypatch):
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    path = private_dir / "weights.sock"
    listener = sockets.acquire(path)
    try:
        assert isinstance(listener, sockets.UnixListener) and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    finally:
        sockets.release(listener)
    assert not path.exists()


def test_acquire_binds_with_the_given_binder(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    listener = sockets.acquire(tmp_path / "public.sock", bind=sockets.bind_public)
    try:
        assert stat.S_IMODE(os.lstat(tmp_path / "public.sock").st_mode) == 0o666
    finally:
        sockets.release(listener)


def test_trusted_peer_admits_our_uid_and_refuses_another(monkeypatch, caplog):
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours, theirs:
        assert sockets.trusted_peer(ours) == os.getpid()
        monkeypatch.setattr(sockets, "peer_credentials", lambda _sock: (4321, 65534, 65534))
        assert sockets.trusted_peer(ours) is None
    assert f"refused pid 4321 on : uid 65534 is neither {os.getuid()} nor root" in caplog.text
