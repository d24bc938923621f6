"""Accept connections on a weights socket and hand each request to an answer.

One job: the connection discipline every weights socket shares (the builtin
daemon's and the upstream supervisors'): one thread per connection, peers
whose uid is neither ours nor root refused before a byte is read
(SO_PEERCRED, sockets.trusted_peer), one protocol deadline per request (a
peer trickling a byte at a time gets no more time than one that sends
nothing), and a malformed, truncated, oversized or slow frame closing that
connection only, with a log line.

Running out of descriptors (EMFILE, ENFILE) or kernel memory while accepting
is transient: it is logged once per episode and the accept loop waits and
goes on. Only a closed listener (shutdown) ends it.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Callable

from hostd import sockets
from hostd.weights import protocol

log = logging.getLogger("hostd.weights")

Answer = Callable[[socket.socket, protocol.Request, int], None]

# accept() errors that say "not now", not "closed": waiting frees what the
# running connections hold (descriptors, socket buffers). ECONNABORTED: the peer
# gave up while queued.
TRANSIENT_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED,
                           errno.EPROTO, errno.EINTR}
ACCEPT_RETRY = 0.1  # seconds between accept attempts while descriptors are exhausted


def serve(listener: socket.socket, answer: Answer) -> None:
    """Accept until LISTENER is closed; ANSWER(conn, request, peer_pid) replies."""
    exhausted = False
    while True:
        try:
            conn, _ = listener.accept()
        except OSError as exc:
            if exc.errno not in TRANSIENT_ACCEPT_ERRORS:
                return  # closed at shutdown
            if not exhausted and exc.errno != errno.ECONNABORTED:
                log.warning("cannot accept a connection now (%s); retrying until the running ones "
                            "free what they hold", exc.strerror or exc)
                exhausted = True
            time.sleep(ACCEPT_RETRY)
            continue
        if exhausted:
            log.info("accepting connections again")
            exhausted = False
        threading.Thread(target=handle, args=(conn, answer), daemon=True).start()


class _Deadline:
    """CONN as protocol.recv_request reads it: every recv gets only the time
    left until one deadline, so a whole request has protocol.TIMEOUT seconds."""

    def __init__(self, conn: socket.socket, seconds: float) -> None:
        self._conn = conn
        self._end = time.monotonic() + seconds

    def recv(self, n: int) -> bytes:
        left = self._end - time.monotonic()
        if left <= 0:
            raise socket.timeout("request deadline passed")
        self._conn.settimeout(left)
        return self._conn.recv(n)


def handle(conn: socket.socket, answer: Answer) -> None:
    with conn:
        pid = sockets.trusted_peer(conn)
        if pid is None:
            return
        try:
            request = protocol.recv_request(_Deadline(conn, protocol.TIMEOUT))
            conn.settimeout(protocol.TIMEOUT)  # the answer's writes: the peer must read
            answer(conn, request, pid)
        except protocol.ProtocolError as exc:
            log.warning("closed connection from pid %d: %s", pid, exc)
        except (socket.timeout, TimeoutError):
            log.warning("closed connection from pid %d: no complete request in %.0f s", pid, protocol.TIMEOUT)
        except OSError as exc:
            log.warning("connection from pid %d failed: %s", pid, exc)
