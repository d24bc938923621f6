"""Promises of docs/gateway.md that had no test, on a real gateway process
(hostd.main gateway, run by hand through harness.local.ModelTree), with a real
builtin engine where one is needed: /health and the `starting` state,
`gateway.admission: queue` (queue_max, queue_timeout and their metrics), the
lowering of max_connections to the file descriptor limit, and the 64 KiB cap
on a control-socket line. Each test asserts what a client or an operator
observes: HTTP status, body and headers, /metrics, the control socket's
answers, the gateway's log."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hostd.gateway import control
from harness.local import Daemon, ModelTree, free_port, wait_for


def gateway_tree(tmp_path: Path, checkpoint: Path, **gateway) -> ModelTree:
    """A model tiny whose gateway settings are GATEWAY; nothing started."""
    port = free_port()
    tree = ModelTree(tmp_path)
    tree.write_config(checkpoint, fixed={"listen": f"127.0.0.1:{port}", "gateway": {"retry_after": 7, **gateway}})
    tree.base_url = f"http://127.0.0.1:{port}"
    return tree


def start_engine(tree: ModelTree) -> None:
    tree.start_weights()
    tree.start_engine()


def post_completion(tree: ModelTree, timeout: float = 600) -> httpx.Response:
    return httpx.post(tree.base_url + "/v1/completions",
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=timeout)


def metrics(tree: ModelTree) -> str:
    response = httpx.get(tree.base_url + "/metrics", timeout=60)
    assert response.status_code == 200
    return response.text


def sample(text: str, name: str, **labels: str) -> float:
    """The value of series NAME with LABELS (among others: every series has
    its model label) in a Prometheus exposition (0 when absent)."""
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, f"{name}{labels}: {found}"
    return found[0] if found else 0.0


def health(tree: ModelTree) -> tuple[int, dict]:
    response = httpx.get(tree.base_url + "/health", timeout=60)
    return response.status_code, response.json()


# ---------------------------------------------------------------- /health and starting


def test_health_is_503_starting_until_the_engine_answers_then_200_and_503_again_while_paused(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    tree = gateway_tree(tmp_path, tiny_checkpoint)
    trees.append(tree)
    tree.start_gateway()  # before any engine: as systemd may order it after a crash
    assert health(tree) == (503, {"model": "tiny", "state": "starting"})
    refused = post_completion(tree)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
    assert refused.json()["error"]["code"] == "model_starting"
    assert tree.control("status")["state"] == "starting"

    start_engine(tree)
    wait_for(lambda: health(tree)[0] == 200, 60, "/health 200 once the engine answers")
    assert health(tree) == (200, {"model": "tiny", "state": "serving"})
    assert post_completion(tree).status_code == 200

    assert tree.control("drain", timeout=30)["state"] == "paused"
    assert health(tree) == (503, {"model": "tiny", "state": "paused"})
    assert tree.control("resume")["state"] == "serving"
    assert health(tree) == (200, {"model": "tiny", "state": "serving"})
    assert sample(metrics(tree), "hostd_gateway_rejected_total", reason="starting") == 1


# ---------------------------------------------------------------- admission: queue


def test_queue_mode_holds_requests_until_serving_refuses_beyond_queue_max_and_counts_them(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    # queue_timeout is far longer than an engine start: nothing here may time out.
    tree = gateway_tree(tmp_path, tiny_checkpoint, admission="queue", queue_max=2, queue_timeout=600)
    trees.append(tree)
    tree.start_gateway()
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(post_completion, tree) for _ in range(2)]
        wait_for(lambda: tree.control("status")["queued"] == 2, 60, "2 requests queued")
        assert sample(metrics(tree), "hostd_gateway_queued") == 2

        full = post_completion(tree)  # a third one: answered at once, not queued
        assert full.status_code == 503 and full.headers["Retry-After"] == "7"
        assert full.json()["error"]["code"] == "model_queue_full"
        assert all(not f.done() for f in waiting)

        start_engine(tree)  # the gateway sees it healthy: serving, and the queue is admitted
        answered = [f.result(600) for f in waiting]
    assert [r.status_code for r in answered] == [200, 200]
    assert all(r.json()["choices"][0]["text"] is not None for r in answered)

    status = tree.control("status")
    assert (status["queued"], status["admitted"], status["completed"]) == (0, 2, 2)
    assert status["rejected"] == {"queue-full": 1}
    text = metrics(tree)
    assert sample(text, "hostd_gateway_queued") == 0
    assert sample(text, "hostd_gateway_admitted_total") == 2
    assert sample(text, "hostd_gateway_rejected_total", reason="queue-full") == 1
    assert sample(text, "hostd_gateway_admission_wait_seconds_count") == 3  # the two admitted and the refused one


def test_queue_mode_answers_503_queue_timeout_once_queue_timeout_has_passed(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    tree = gateway_tree(tmp_path, tiny_checkpoint, admission="queue", queue_max=4, queue_timeout=2)
    trees.append(tree)
    tree.start_gateway()  # no engine: the gateway never serves
    began = time.monotonic()
    response = post_completion(tree)
    waited = time.monotonic() - began
    assert response.status_code == 503 and response.headers["Retry-After"] == "7"
    assert response.json()["error"]["code"] == "model_queue_timeout"
    assert waited >= 2  # it was held for queue_timeout, not refused at once
    text = metrics(tree)
    assert sample(text, "hostd_gateway_rejected_total", reason="queue-timeout") == 1
    assert sample(text, "hostd_gateway_admission_wait_seconds_count") == 1
    assert sample(text, "hostd_gateway_admission_wait_seconds_sum") >= 2
    assert sample(text, "hostd_gateway_queued") == 0


# ---------------------------------------------------------------- max_connections and the fd limit


def spawn_gateway_with_fd_limit(tree: ModelTree, nofile: int) -> Daemon:
    """The gateway under `prlimit --nofile=N:N` (soft and hard: it cannot raise it)."""
    log_path = tree.root / "gateway-prlimit.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["prlimit", f"--nofile={nofile}:{nofile}", sys.executable, "-m", "hostd.main", "gateway", tree.name],
            env=tree.env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    daemon = Daemon(proc, log_path)
    tree.daemons.append(daemon)
    wait_for(lambda: tree._connectable(tree.control_socket), 60, "gateway control socket", proc)
    return daemon


def test_max_connections_is_lowered_to_fit_the_fd_limit_logged_and_enforced(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    if subprocess.run(["prlimit", "--version"], capture_output=True).returncode != 0:
        pytest.skip("prlimit (util-linux) is not installed")
    # header_timeout far above what opening the connections takes: none is closed meanwhile.
    tree = gateway_tree(tmp_path, tiny_checkpoint, max_connections=1024, header_timeout=600)
    trees.append(tree)
    gateway = spawn_gateway_with_fd_limit(tree, 256)
    cap = (256 - 64 - 32) // 2  # limits.connection_cap: FD_RESERVE 64, LINGER_MAX 32, two fds a connection
    log = gateway.log()
    assert f"gateway.max_connections 1024 lowered to {cap}: the file descriptor limit is 256" in log
    assert f"(at most {cap} connections)" in log

    host, port = tree.base_url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port)), timeout=60) for _ in range(cap)]
    try:
        # The kernel hands connections over in order: this one comes after the
        # CAP held ones, so the gateway answers it at the cap.
        with socket.create_connection((host, int(port)), timeout=60) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = extra.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 503 ")
        assert b"too_many_connections" in answer and b"Connection: close" in answer
        assert f"too many open connections ({cap})".encode() in answer
        assert tree.control("status")["state"] == "starting"  # the control socket still answers
    finally:
        for conn in held:
            conn.close()
    wait_for(lambda: health(tree)[0] == 503, 60, "a new connection is served once the held ones closed")
    assert sample(metrics(tree), "hostd_gateway_connections_refused_total") == 1


# ---------------------------------------------------------------- the control socket's line cap


def control_exchange(path: Path, line: bytes, until_closed: bool) -> tuple[bytes, bytes]:
    """Send LINE on a fresh control connection; the answer line and, when
    UNTIL_CLOSED, what follows it until the gateway closes (b'': nothing)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(60)
        conn.connect(str(path))
        conn.sendall(line)
        reader = conn.makefile("rb")
        first = reader.readline()
        if not until_closed:
            return first, b""
        try:
            rest = reader.read()
        except ConnectionResetError:  # closed with the rest of our line unread
            rest = b""
    return first, rest


def test_a_control_line_over_64_kib_is_refused_the_connection_closed_and_nothing_changes(
        tmp_path: Path, tiny_checkpoint: Path, trees):
    tree = gateway_tree(tmp_path, tiny_checkpoint)
    trees.append(tree)
    tree.start_gateway()
    assert control.MAX_LINE == 64 << 10

    def drain_padded_to(size: int) -> bytes:
        head, tail = b'{"verb": "drain", "timeout": 5, "pad": "', b'"}\n'
        return head + b"x" * (size - len(head) - len(tail)) + tail

    # Under the cap: the line is read whole and refused for what it says.
    # (The connection stays open for the next line: not read to its end.)
    first, _ = control_exchange(tree.control_socket, drain_padded_to(control.MAX_LINE - 1024), until_closed=False)
    refusal = json.loads(first)
    assert refusal["ok"] is False and "unknown field `pad`" in refusal["error"], first[:300]

    first, rest = control_exchange(tree.control_socket, drain_padded_to(control.MAX_LINE + 1024), until_closed=True)
    assert first.endswith(b"\n") and json.loads(first) == {
        "ok": False, "protocol": control.PROTOCOL, "error": "request longer than 65536 bytes"}
    assert rest == b""  # and the gateway closed the connection
    assert f"sent a line over {control.MAX_LINE} bytes; closing" in tree.daemons[-1].log()

    status = tree.control("status")  # a new connection is served as before
    assert status["drains"] == 0 and status["state"] == "starting"
