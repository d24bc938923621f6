"""The engine's side of the weights protocol.

One job: ask a weight cache daemon for status, or attach its weights after
checking, before and after mapping, that the daemon is who it says it is: the
sender PID of its answer (SCM_CREDENTIALS, filled in by the kernel, which the
sender cannot forge) equals the PID the daemon reports, the socket path's inode equals the one it reports, and a
second status after mapping names the same PID, inode and fingerprint. A cache
that changed in between is refused.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import hostd
from hostd import sockets
from hostd.weights import protocol

if TYPE_CHECKING:  # status() serves the root manager and the upstream engine supervisors: no torch there
    import torch


class WeightsRefused(Exception):
    """The daemon's weights cannot be used; the message says why and what to do."""


@dataclass
class Attached:
    status: protocol.Status
    tensors: list[tuple[str, str, torch.Tensor, list[str]]]
    block: torch.Tensor  # the whole shared allocation
    socket_path: Path


def _exchange(path: Path, request) -> tuple[protocol.Response, list[int], int]:
    with sockets.connect(path, protocol.TIMEOUT) as conn:
        st = conn.file_stat
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # before we send: the answer carries it
        protocol.send_frame(conn, request)
        response, fds, peer_pid = protocol.recv_response(conn)
    if isinstance(response, (protocol.Status, protocol.Attach)):
        status = response if isinstance(response, protocol.Status) else response.status
        if status.pid != peer_pid or status.socket_inode != st.st_ino:
            for fd in fds:
                os.close(fd)
            raise WeightsRefused(
                f"{path}: the daemon reports pid {status.pid} and socket inode "
                f"{status.socket_inode}, but the peer is pid {peer_pid} on inode {st.st_ino}"
            )
    return response, fds, peer_pid


def status(path: Path) -> protocol.Status:
    response, fds, _ = _exchange(path, protocol.StatusRequest())
    for fd in fds:
        os.close(fd)
    if not isinstance(response, protocol.Status):
        raise WeightsRefused(f"{path}: unexpected answer to status: {type(response).__name__}")
    return response


def attach(path: Path, expected: protocol.Fingerprint) -> Attached:
    from hostd.weights import shared  # torch: only in the engine that maps the weights

    request = protocol.AttachRequest(fingerprint=expected, protocol=protocol.PROTOCOL, hostd_version=hostd.__version__)
    response, fds, _ = _exchange(path, request)
    try:
        if isinstance(response, protocol.Attach):  # an older daemon does not check ours
            problem = protocol.version_problem(response.status.protocol, response.status.hostd_version,
                                               path.parent.name)
            if problem:
                raise WeightsRefused(f"{path}: {problem}")
        if isinstance(response, protocol.Mismatch):
            details = "; ".join(
                f"{field}: daemon {getattr(response.daemon, field)!r}, engine {getattr(expected, field)!r}"
                for field in response.fields
            )
            raise WeightsRefused(
                f"fingerprint mismatch in {', '.join(response.fields)} ({details}): "
                f"{response.message}"
            )
        if isinstance(response, protocol.Error):
            raise WeightsRefused(f"{path}: the daemon refused: {response.message}")
        if not isinstance(response, protocol.Attach):
            raise WeightsRefused(f"{path}: unexpected answer to attach: {type(response).__name__}")
        storage = response.storage
        if isinstance(storage, protocol.MemfdStorage):
            if len(fds) != 1:
                raise WeightsRefused(f"{path}: expected one memfd with the answer, got {len(fds)}")
            block = shared.map_memfd(fds[0], storage)
        else:
            block = shared.open_cuda(storage)
    finally:
        for fd in fds:
            os.close(fd)
    tensors = [
        (entry.name, entry.kind, shared.tensor_at(block, entry), list(entry.aliases))
        for entry in response.tensors
    ]
    after = status(path)
    before = response.status
    if (after.pid, after.socket_inode, after.fingerprint) != (
        before.pid, before.socket_inode, before.fingerprint
    ):
        raise WeightsRefused(
            f"{path}: the weight cache changed while attaching (pid {before.pid} -> "
            f"{after.pid}, inode {before.socket_inode} -> {after.socket_inode}); retry"
        )
    return Attached(status=before, tensors=tensors, block=block, socket_path=path)
