"""Accept connections on a weights socket and hand each request to an answer.

One job: the connection discipline every weights socket shares (the builtin
daemon's and the upstream supervisors'): one thread per connection, peers
whose uid is neither ours nor root refused before a byte is read
(SO_PEERCRED, sockets.trusted_peer), a protocol timeout per request, and a malformed, truncated,
oversized or slow frame closing that connection only, with a log line.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from hostd import sockets
from hostd.weights import protocol

log = logging.getLogger("hostd.weights")

Answer = Callable[[socket.socket, protocol.Request, int], None]


def serve(listener: socket.socket, answer: Answer) -> None:
    """Accept until LISTENER is closed; ANSWER(conn, request, peer_pid) replies."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed at shutdown
        threading.Thread(target=handle, args=(conn, answer), daemon=True).start()


def handle(conn: socket.socket, answer: Answer) -> None:
    with conn:
        pid = sockets.trusted_peer(conn)
        if pid is None:
            return
        conn.settimeout(protocol.TIMEOUT)
        try:
            answer(conn, protocol.recv_request(conn), pid)
        except protocol.ProtocolError as exc:
            log.warning("closed connection from pid %d: %s", pid, exc)
        except (socket.timeout, TimeoutError):
            log.warning("closed connection from pid %d: no complete request in %.0f s", pid, protocol.TIMEOUT)
        except OSError as exc:
            log.warning("connection from pid %d failed: %s", pid, exc)
