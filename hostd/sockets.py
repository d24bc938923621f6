"""Unix sockets hostd listens on: the one place that binds them.

One job: take a Unix socket path safely and give it up cleanly. Every
listener (weights.sock, engine.sock, control.sock, the gateway's public Unix
address when run by hand) and every path an upstream child will bind for us
(vLLM's --uds) goes through here, so there is one rule for each question:

- Which socket (acquire()). The one systemd passed (socket activation,
  LISTEN_FDS) if any, else the path bound here; a daemon never asks systemd
  itself.

- Directory. A private socket lives in a real directory (not a symlink) owned
  by this uid with no group or other access (0700), created when missing. A
  public socket's directory is created 0755 when missing and otherwise left
  as the administrator made it.
- What is already at the path (claim()):
    nothing                      -> bind
    a socket nobody accepts on   -> stale (its server died): removed, then bind
    a socket that accepts        -> refused: another process serves there
    a symlink, a non-socket, or a socket owned by another uid
                                 -> refused, never replaced
  The probe is a non-blocking connect(): ECONNREFUSED means nobody listens;
  success or EAGAIN (a full backlog) means somebody does.
- Modes. A private socket is 0600 (umask 0177 while binding, so it is never
  wider, not even for an instant), a public one 0666 (systemd's SocketMode=
  default); both are owned by the uid that binds.
- Release. A socket we bound is removed at shutdown only if the file at its
  path is still the one we bound (a successor may have replaced it).

Trusts: nobody at the socket path. Peers are identified with SO_PEERCRED
(peer_credentials); a private socket's server admits only peers of its own
uid or root, checked before it reads a byte (trusted_peer). Every client connects through connect(), which refuses a
symlink or non-socket at the path, a directory others may write, a socket file
not owned by the expected user and a peer (SO_PEERCRED) that is neither that
user nor root (systemd listens on activated sockets). Root (the manager)
expects the owner of the model's private runtime directory, which root made
for the model's user inside its own /run/hostd. The path is opened once
(O_PATH, no symlinks) and connected through that descriptor, so nobody can
swap the file between the check and the connect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any, Callable, Optional

from hostd import systemd

log = logging.getLogger("hostd.sockets")


class UnsafePath(Exception):
    """A runtime path is a symlink, foreign-owned, open to other users, or in use."""


class InUse(UnsafePath):
    """Another process accepts connections on the socket path."""


class UnsafeSocket(UnsafePath, ConnectionRefusedError):
    """connect() refused a socket: callers that treat an unreachable peer as
    down (OSError) do so here too, and the journal says why."""


PRIVATE_MODE = 0o600
PUBLIC_MODE = 0o666


class UnixListener(socket.socket):
    """A listening Unix socket this process bound, and the file it made.

    A plain socket.socket for everyone who uses it (asyncio, aiohttp, accept());
    release() closes it and removes its file if that file is still ours."""

    path: Path
    identity: tuple[int, int, int]  # the file's (device, inode, change time in ns)

    def release(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            if _identity(os.lstat(self.path)) == self.identity:
                os.unlink(self.path)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    # The inode alone is not enough: a successor's socket can get the number
    # of the one it replaced.
    return st.st_dev, st.st_ino, st.st_ctime_ns


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


def claim(path: Path) -> None:
    """Make PATH free to bind: remove a stale socket of ours, refuse anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symbolic link; refusing to listen through a link (remove it)")
    if not stat.S_ISSOCK(st.st_mode):
        raise UnsafePath(f"{path} exists and is not a socket; refusing to replace it (remove it or "
                         "choose another path)")
    if st.st_uid != os.getuid():
        raise UnsafePath(f"{path} is a socket owned by uid {st.st_uid}, not {os.getuid()}; "
                         "refusing to replace another user's socket")
    if _accepts(path):
        raise InUse(f"another process is already serving on {path}; stop it first")
    os.unlink(path)


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return False
        except BlockingIOError:  # EAGAIN: a listener whose backlog is full
            return True
        except FileNotFoundError:  # removed between lstat and connect
            return False
        except OSError as exc:
            raise UnsafePath(f"cannot tell whether {path} is in use: {exc}") from None
    return True


def bind_private(path: Path, backlog: int = 64) -> UnixListener:
    """Listen on PATH (0600) in a private 0700 directory, replacing a stale socket."""
    ensure_private_dir(path.parent)
    return _bind(path, PRIVATE_MODE, backlog)


def bind_public(path: Path, backlog: int = 1024) -> UnixListener:
    """Listen on PATH (0666, as systemd's SocketMode= default) for any local user."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    return _bind(path, PUBLIC_MODE, backlog)


def _bind(path: Path, mode: int, backlog: int) -> UnixListener:
    claim(path)
    sock = UnixListener(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, mode)  # before listen(): nobody can connect in between
        sock.path, sock.identity = path, _identity(os.lstat(path))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def acquire(address: Any, bind: Callable[[Any], socket.socket] = bind_private) -> socket.socket:
    """The listening socket systemd passed this process (LISTEN_FDS), else
    BIND(ADDRESS): by default the Unix socket path ADDRESS, bound private
    (bind_private). release() gives either back."""
    passed = systemd.listen_sockets()
    return passed[0] if passed else bind(address)


def release(listener: socket.socket) -> None:
    """Close LISTENER; remove its file if we bound it and the file is still ours
    (a socket systemd passed us is closed and left alone)."""
    if isinstance(listener, UnixListener):
        listener.release()
    else:
        listener.close()


class ClientSocket(socket.socket):
    """A connected client socket, with the stat of the socket file it reached."""

    file_stat: os.stat_result


def connect(path: Path, timeout: Optional[float] = None, owner: Optional[int] = None) -> ClientSocket:
    """Connect to the Unix socket at PATH, refusing (UnsafeSocket) unless:
    PATH's directory is a real directory no other user may write; PATH is a
    socket (not a symlink) owned by OWNER; its peer (SO_PEERCRED) is OWNER or
    root. OWNER defaults to our uid, for root to the directory's owner."""
    path = Path(path)

    def refuse(why: str) -> UnsafeSocket:
        log.warning("refusing to connect to %s: %s", path, why)
        return UnsafeSocket(f"{path}: {why}; refusing to connect")

    directory = os.lstat(path.parent)
    if not stat.S_ISDIR(directory.st_mode):
        raise refuse("its directory is not a directory (a symlink?)")
    if owner is None:
        owner = os.getuid() or directory.st_uid
    if directory.st_uid not in (owner, 0) or directory.st_mode & 0o022:
        raise refuse(f"its directory is owned by uid {directory.st_uid} with mode "
                     f"{stat.S_IMODE(directory.st_mode):04o}; another user could replace the socket")
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            raise refuse("it is a symbolic link")
        if not stat.S_ISSOCK(st.st_mode):
            raise refuse("it is not a socket")
        if st.st_uid != owner:
            raise refuse(f"the socket is owned by uid {st.st_uid}, not {owner}")
        sock = ClientSocket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(f"/proc/self/fd/{fd}")
            pid, uid, _ = peer_credentials(sock)
            if uid not in (owner, 0):
                raise refuse(f"the peer is pid {pid} of uid {uid}, not {owner}")
        except BaseException:
            sock.close()
            raise
    finally:
        os.close(fd)
    sock.file_stat = st
    return sock


UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    return UCRED.unpack(raw)


def trusted_peer(conn: socket.socket) -> Optional[int]:
    """The PID at the other end of CONN, accepted on a private socket, if it
    runs as our uid or root; else None, and the refusal is logged. Call it
    before reading a byte."""
    pid, uid, _ = peer_credentials(conn)
    if uid in (os.getuid(), 0):
        return pid
    log.warning("refused pid %d on %s: uid %d is neither %d nor root", pid, conn.getsockname(), uid, os.getuid())
    return None
