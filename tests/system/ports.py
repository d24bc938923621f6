"""TCP ports for the models' public sockets in the test containers.

The containers share the host's network namespace, and other test runs (and
any program's outgoing connections) share its ports. A port found free by
binding and closing a socket can be taken again before the container's
model@NAME.socket binds it. So the port is held instead: a socket bound with
SO_REUSEADDR and never listening stays open for the whole test process. The
kernel then hands that port to no one else (no bind to port 0, no outgoing
connection, no plain bind), while systemd's socket units, which always set
SO_REUSEADDR, may bind and listen on it, again after every restart (Linux
lets two SO_REUSEADDR sockets share a port while neither listens on it besides
the one that does)."""

from __future__ import annotations

import socket

_HELD: list[socket.socket] = []


def _hold(port: int) -> int:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    _HELD.append(s)
    return s.getsockname()[1]


def reserved_port() -> int:
    """A loopback port held for this process; model@NAME.socket may listen on it."""
    return _hold(0)


def reserve(port: int) -> bool:
    """Hold PORT when no other socket has it (a plain bind succeeds); False if taken."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    try:
        _hold(port)
    except OSError:
        return False
    return True
