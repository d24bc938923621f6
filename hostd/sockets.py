"""Unix sockets in a model's private runtime directory.

One job: create or check /run/hostd/NAME and bind sockets in it safely. The
directory must be a real directory (not a symlink) owned by this uid with no
group or other access; a socket path that is a symlink or belongs to another
uid is refused rather than replaced.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from pathlib import Path


class UnsafePath(Exception):
    """A runtime path is a symlink, foreign-owned or open to other users."""


def ensure_private_dir(directory: Path) -> None:
    """Create DIRECTORY 0700 (parents as needed) or check that it is private."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
        st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{directory} is not a directory (a symlink?); refusing to use it")
    if st.st_uid != os.getuid():
        raise UnsafePath(
            f"{directory} is owned by uid {st.st_uid}, not {os.getuid()}; "
            "refusing a runtime directory another user controls"
        )
    if st.st_mode & 0o077:
        raise UnsafePath(
            f"{directory} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 "
            f"(chmod 0700 {directory})"
        )


def bind_private(path: Path, backlog: int = 64) -> socket.socket:
    """Listen on PATH (mode 0600) in a private directory, replacing a stale socket."""
    ensure_private_dir(path.parent)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid():
            raise UnsafePath(f"{path} exists and is not our socket; refusing to replace it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def check_socket_path(path: Path) -> os.stat_result:
    """lstat of a socket we are about to connect to, refusing unsafe ones."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePath(f"{path} is not a socket (a symlink?); refusing to connect")
    # A socket another user planted must not fool us; root (the manager) may
    # talk to the service user's sockets in their private directory.
    if st.st_uid not in (os.getuid(), 0) and os.getuid() != 0:
        raise UnsafePath(f"{path} is owned by uid {st.st_uid}; refusing to connect")
    return st


UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    return UCRED.unpack(raw)
