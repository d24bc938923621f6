"""The weights protocol carries its version (issue 27 item 6): after an
upgrade, an engine of one hostd and a weights daemon of another refuse each
other, saying which unit to restart, instead of mapping a tensor table laid
out by a different hostd. Real sockets; the daemon's answer() itself."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from hostd.weights import client, listener, protocol
from hostd.weights.daemon import WeightDaemon

FINGERPRINT = protocol.Fingerprint(
    model_path="/srv/m", content_digest="d", architecture="LlamaForCausalLM", dtype="float32", device="cpu",
    tensor_parallel_size=1, backend="builtin", torch_version="2.13.0", transformers_version="5.24.0")


def daemon() -> WeightDaemon:
    """A daemon past its load (its answer() reads only these)."""
    d = WeightDaemon.__new__(WeightDaemon)
    d.name, d.fingerprint, d.shared, d.clients_served = "m", FINGERPRINT, object(), 0
    d._lock = threading.Lock()
    return d


@pytest.mark.parametrize("sent", [{}, {"protocol": 1, "hostd_version": "0.0.9"}, {"protocol": protocol.PROTOCOL + 1}])
def test_the_daemon_refuses_an_engine_of_another_protocol_saying_what_to_restart(sent):
    ours, theirs = socket.socketpair()
    with ours, theirs:
        daemon().answer(ours, protocol.AttachRequest(fingerprint=FINGERPRINT, **sent), pid=1234)
        answer, fds, _ = protocol.recv_response(theirs)
    assert fds == [] and isinstance(answer, protocol.Error), answer
    assert "different hostd versions" in answer.message
    assert "systemctl restart model@m.service" in answer.message
    assert f"protocol {sent.get('protocol', 1)}" in answer.message


def test_an_engine_refuses_an_older_daemons_attach_before_mapping_anything(tmp_path: Path):
    """An older daemon does not check the engine's protocol: the engine checks
    the answer's (absent: 1) and maps nothing."""
    run = tmp_path / "m"
    run.mkdir(mode=0o700)
    path = run / "weights.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    inode = os.stat(path).st_ino

    def old_daemon(conn, request, pid):
        status = protocol.Status(fingerprint=FINGERPRINT, pid=os.getpid(), socket_inode=inode, tensors=0,
                                 bytes_by_device={}, loaded_at=0.0, clients_served=0)  # no protocol: 1
        protocol.send_frame(conn, protocol.Attach(status=status, storage=protocol.MemfdStorage(size=0, inode=0),
                                                  tensors=[]))

    threading.Thread(target=listener.serve, args=(server, old_daemon), daemon=True).start()
    try:
        with pytest.raises(client.WeightsRefused, match=r"weights protocol 1, hostd from before .*"
                                                        r"systemctl restart model@m\.service"):
            client.attach(path, FINGERPRINT)
    finally:
        server.close()


def test_the_daemons_status_says_its_protocol_and_version():
    import hostd

    d = daemon()
    d.shared = type("S", (), {"table": [], "device": "cpu", "size": 0})()
    d.socket_inode, d.loaded_at = 1, 0.0
    status = d.status()
    assert (status.protocol, status.hostd_version) == (protocol.PROTOCOL, hostd.__version__)


def test_an_attach_answer_with_the_wrong_number_of_fds_is_refused_and_every_fd_is_closed(monkeypatch):
    """weights/client.py (issue 53): an engine never keeps a descriptor a
    daemon passed with an answer it refuses: here two memfds where the
    answer has room for one, every one closed before the refusal reaches
    the caller."""
    fingerprint = protocol.Fingerprint(model_path="/m", content_digest="d", architecture="a", dtype="float32",
                                       device="cpu", tensor_parallel_size=1, backend="builtin", torch_version="t",
                                       transformers_version="t")
    status = protocol.Status(fingerprint=fingerprint, pid=1, socket_inode=2, tensors=0, bytes_by_device={},
                             loaded_at=0.0, clients_served=0, protocol=protocol.PROTOCOL)
    answer = protocol.Attach(status=status, storage=protocol.MemfdStorage(size=0, inode=0), tensors=[])
    passed = list(os.pipe())
    monkeypatch.setattr(client, "_exchange", lambda path, request: (answer, passed, 1))
    with pytest.raises(client.WeightsRefused, match="expected one memfd with the answer, got 2"):
        client.attach(Path("/run/hostd/tiny/weights.sock"), fingerprint)
    for fd in passed:
        with pytest.raises(OSError):
            os.fstat(fd)
