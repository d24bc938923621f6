"""The weights sockets' accept loop and request deadline (hostd/weights/listener.py)."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import pytest

from hostd.weights import listener, protocol


class _ExhaustedThenClosed:
    """A listener whose accept() fails with ERRORS first, then hands out CONN, then is closed."""

    def __init__(self, errors: list[int], conn: socket.socket) -> None:
        self._errors = list(errors)
        self._conn = conn

    def accept(self):
        if self._errors:
            code = self._errors.pop(0)
            raise OSError(code, __import__("os").strerror(code))
        if self._conn is not None:
            conn, self._conn = self._conn, None
            return conn, ""
        raise OSError(errno.EBADF, "closed")


@pytest.mark.parametrize("code", [errno.EMFILE, errno.ENFILE])
def test_running_out_of_descriptors_is_logged_and_the_next_connection_is_answered(code, monkeypatch, caplog):
    monkeypatch.setattr(listener, "ACCEPT_RETRY", 0.01)
    ours, theirs = socket.socketpair()
    answered = []
    caplog.set_level(logging.INFO, logger="hostd.weights")
    worker = threading.Thread(
        target=listener.serve,
        args=(_ExhaustedThenClosed([code, code, code], theirs), lambda c, r, p: answered.append(r)),
    )
    worker.start()
    protocol.send_frame(ours, protocol.StatusRequest())
    worker.join(5)
    deadline = time.monotonic() + 5
    while not answered and time.monotonic() < deadline:
        time.sleep(0.01)
    ours.close()
    assert not worker.is_alive(), "serve() did not end when its listener was closed"
    assert [type(r) for r in answered] == [protocol.StatusRequest]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot accept a connection now" in warnings[0], warnings


def test_a_peer_trickling_bytes_is_closed_at_one_deadline_per_request(monkeypatch, caplog):
    """A byte every 0.1 s never lets a per-recv timeout of 0.5 s fire; the
    request's one deadline closes the connection before the frame is complete."""
    monkeypatch.setattr(protocol, "TIMEOUT", 0.5)
    ours, theirs = socket.socketpair()
    answered = []
    frame = protocol.HEADER.pack(40) + b"x" * 40  # 4 s at a byte per 0.1 s
    done = threading.Thread(target=listener.handle, args=(theirs, lambda c, r, p: answered.append(r)))
    done.start()
    sent = 0
    try:
        for byte in frame:
            if not done.is_alive():
                break
            ours.send(bytes([byte]))
            sent += 1
            time.sleep(0.1)
    except OSError:
        pass  # closed by the daemon: what this test wants
    done.join(5)
    ours.close()
    assert sent < len(frame), "the daemon read a whole trickled frame"
    assert not answered
    assert any("no complete request" in r.getMessage() for r in caplog.records)
