"""The weights protocol: what the weight cache daemon and an engine say.

Trust model: the socket lives in the model's private runtime directory
(/run/hostd/NAME, 0700) and is itself 0600; the daemon also checks every peer
with SO_PEERCRED (same uid or root) and refuses the rest. Even so, nothing a
peer sends can make either side run code: messages are msgspec msgpack
structs decoded against a fixed schema (no pickle), frames carry a 4-byte
big-endian length and are capped at MAX_FRAME, and a malformed, truncated or
oversized frame closes that one connection and nothing else.

Exchange: the engine sends one request per connection; the daemon answers
with one response. Both carry PROTOCOL (absent: 1, the hostd before it was
sent) and the sender's hostd version: the daemon refuses an attach of
another protocol and the engine an answer of another, each saying that the
model must be restarted, so that after an upgrade an engine never maps a
table laid out by a different hostd. An Attach response carries the shared memory: on CPU one
sealed memfd passed as SCM_RIGHTS ancillary data with the frame; on CUDA the
IPC handle of one device allocation inside the message.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Optional, Union

import msgspec

from hostd import sockets

# The layout of these messages: raised when a change would let an engine
# of one hostd misread a daemon of another (tests/unit/test_weights_protocol_version.py).
PROTOCOL = 2
MAX_FRAME = 16 << 20  # the largest tensor table of a real model is < 1 MiB
HEADER = struct.Struct(">I")
TIMEOUT = 30.0


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame or message."""


# ---------------------------------------------------------------- fingerprint


class Fingerprint(msgspec.Struct, frozen=True, kw_only=True):
    """What the weights are (not where they came from): a cache serves an
    engine only when every field is equal."""

    model_path: str  # resolved, symlinks followed
    content_digest: str  # over the weight files and config.json (fingerprint.py)
    architecture: str
    dtype: str
    device: str  # "cpu", or "cuda:<GPU UUID>"
    tensor_parallel_size: int
    backend: str
    torch_version: str
    transformers_version: str

    def differences(self, other: "Fingerprint") -> list[str]:
        """Names of the fields whose values differ from OTHER's."""
        return [
            name
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


# ---------------------------------------------------------------- requests


class StatusRequest(msgspec.Struct, tag="status"):
    pass


class AttachRequest(msgspec.Struct, tag="attach"):
    fingerprint: Fingerprint
    protocol: int = 1
    hostd_version: str = ""


Request = Union[StatusRequest, AttachRequest]


# ---------------------------------------------------------------- responses


class TensorEntry(msgspec.Struct, array_like=True):
    """One tensor inside the shared allocation. `aliases` are other module
    paths that name the same tensor (tied weights)."""

    name: str
    kind: str  # "parameter" | "buffer"
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: list[int]
    offset: int  # bytes from the start of the allocation
    aliases: list[str] = []


class MemfdStorage(msgspec.Struct, tag="memfd"):
    """A sealed memfd of `size` bytes, passed as the frame's one SCM_RIGHTS fd."""

    size: int
    inode: int


class CudaStorage(msgspec.Struct, tag="cuda"):
    """The fields of torch's UntypedStorage._share_cuda_() for one allocation."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_uuid: str


Storage = Union[MemfdStorage, CudaStorage]


class Status(msgspec.Struct, tag="status"):
    fingerprint: Fingerprint
    pid: int
    socket_inode: int
    tensors: int
    bytes_by_device: dict[str, int]
    loaded_at: float
    clients_served: int
    upstream_pids: list[int] = []
    upstream_socket_inodes: dict[str, int] = {}
    # Empty while the weights are held here or upstream; else why they are not
    # (an upstream backend without its weight cache: the engine loads from disk).
    not_retained: str = ""
    protocol: int = 1
    hostd_version: str = ""
    # The version of the upstream installation the daemon started (vllm,
    # sglang; '' for builtin or when it cannot be told): an engine of another
    # refuses it (hostd/engine/upstream.py), as vLLM's cache key would later.
    upstream_version: str = ""


class Attach(msgspec.Struct, tag="attach"):
    status: Status
    storage: Storage
    tensors: list[TensorEntry]


class Mismatch(msgspec.Struct, tag="mismatch"):
    fields: list[str]
    daemon: Fingerprint
    message: str


class Error(msgspec.Struct, tag="error"):
    message: str


Response = Union[Status, Attach, Mismatch, Error]

def version_problem(theirs: int, their_version: str, model: str) -> str:
    """Why a peer speaking protocol THEIRS cannot be served, or ""."""
    if theirs == PROTOCOL:
        return ""
    from hostd import __version__

    return (f"the engine and the weights daemon run different hostd versions (weights protocol {theirs}, "
            f"hostd {their_version or 'from before the protocol had a version'}, against protocol {PROTOCOL}, hostd {__version__}): "
            f"restart the model so that both run the installed hostd: systemctl restart model@{model}.service")


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_response_decoder = msgspec.msgpack.Decoder(Response)


# ---------------------------------------------------------------- framing


def send_frame(sock: socket.socket, message: msgspec.Struct, fds: tuple[int, ...] = ()) -> None:
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte cap")
    data = HEADER.pack(len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


class _Received:
    """What came with a response besides its bytes: passed file descriptors and
    the sender's kernel-verified PID (SCM_CREDENTIALS)."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.sender_pid: Optional[int] = None

    def take(self, ancillary) -> None:
        for level, kind, data in ancillary:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_RIGHTS:
                usable = len(data) - len(data) % 4
                self.fds.extend(struct.unpack(f"{usable // 4}i", data[:usable]))
            elif kind == socket.SCM_CREDENTIALS and self.sender_pid is None:
                self.sender_pid = sockets.UCRED.unpack(data[: sockets.UCRED.size])[0]


_ANCILLARY = socket.CMSG_SPACE(4 * 4) + socket.CMSG_SPACE(sockets.UCRED.size)


def _recv_exact(sock: socket.socket, n: int, received: Optional[_Received]) -> bytes:
    chunks, have = [], 0
    while have < n:
        if received is not None:
            data, ancillary, _flags, _addr = sock.recvmsg(n - have, _ANCILLARY)
            received.take(ancillary)
        else:
            data = sock.recv(n - have)
        if not data:
            raise ProtocolError(f"connection closed after {have} of {n} bytes (truncated frame)")
        chunks.append(data)
        have += len(data)
    return b"".join(chunks)


def _recv_payload(sock: socket.socket, received: Optional[_Received]) -> bytes:
    header = _recv_exact(sock, HEADER.size, received)
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte cap")
    return _recv_exact(sock, length, received)


def recv_request(sock: socket.socket) -> Request:
    payload = _recv_payload(sock, None)
    try:
        return _request_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"not a valid request: {exc}") from None


def recv_response(sock: socket.socket) -> tuple[Response, list[int], Optional[int]]:
    """A response, the file descriptors that came with it (caller closes them)
    and the sender's PID as the kernel vouches for it. The caller must have set
    SO_PASSCRED on SOCK before the daemon answered (see client.py): with socket
    activation, SO_PEERCRED names systemd, which created the listening socket,
    not the daemon."""
    received = _Received()
    try:
        payload = _recv_payload(sock, received)
        return _response_decoder.decode(payload), received.fds, received.sender_pid
    except BaseException as exc:
        for fd in received.fds:  # a memfd must not outlive a failed exchange
            os.close(fd)
        if isinstance(exc, msgspec.DecodeError):
            raise ProtocolError(f"not a valid response: {exc}") from None
        raise
