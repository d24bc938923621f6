"""The gateway's public side under attack and in use (issue 15): a real
gateway process in front of an engine double (tests/doubles/engine_double.py)
on engine.sock, driven over real TCP sockets. Each test names the attack or
the feature it pins."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from hostd import sockets
from hostd.gateway import control
from harness.local import ModelTree, free_port, wait_for

DOUBLE = Path(__file__).resolve().parents[1] / "doubles" / "engine_double.py"
MiB = 1 << 20


class FrontDoor:
    def __init__(self, tree: ModelTree, port: int):
        self.tree, self.port = tree, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.engine_log = tree.root / "engine-requests.jsonl"
        self.engine: subprocess.Popen | None = None

    def start_engine(self) -> None:
        sockets.ensure_private_dir(self.tree.runtime_dir)
        out = open(self.tree.root / "engine-double.log", "ab")
        self.engine = subprocess.Popen(
            [sys.executable, str(DOUBLE), str(self.tree.engine_socket), "--log", str(self.engine_log)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: self.tree._connectable(self.tree.engine_socket), 30, "engine double", self.engine)

    def stop_engine(self) -> None:
        assert self.engine
        self.engine.terminate()
        self.engine.wait(10)

    @property
    def gateway(self):
        return next(d for d in self.tree.daemons if d.proc.args[3] == "gateway")

    def engine_saw(self) -> list[dict]:
        if not self.engine_log.exists():
            return []
        return [json.loads(line) for line in self.engine_log.read_text().splitlines()]

    def raw(self, request: bytes, timeout: float = 10) -> bytes:
        """Send REQUEST as it is (no client library normalizes it); the whole answer."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as conn:
            conn.sendall(request)
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
        return answer

    def get(self, target: str, headers: str = "") -> tuple[int, bytes]:
        answer = self.raw(f"GET {target} HTTP/1.1\r\nHost: x\r\nX-Probe: {target}\r\n{headers}"
                          "Connection: close\r\n\r\n".encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        return int(head.split()[1]), body

    def metrics(self, **kw) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=10, **kw).text

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.gateway.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def still_open(conn: socket.socket) -> bool:
    """CONN has neither been closed nor answered by the gateway: nothing to read yet."""
    readable, _, _ = select.select([conn], [], [], 0)
    return not readable


@contextlib.contextmanager
def front_door(tmp_path: Path, keys: str | None = None, **gateway) -> Iterator[FrontDoor]:
    """A gateway with GATEWAY settings (and KEYS as its keys file) in front of an engine double."""
    port = free_port()
    tree = ModelTree(tmp_path)
    settings = {"retry_after": 3, **gateway}
    if keys is not None:
        key_file = tmp_path / "api.keys"
        key_file.write_text(keys)
        settings["api_keys"] = str(key_file)
    tree.write_config(tmp_path / "no-checkpoint", fixed={"listen": f"127.0.0.1:{port}", "gateway": settings},
                      max_num_seqs=4)
    door = FrontDoor(tree, port)
    door.start_engine()
    try:
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        yield door
    finally:
        tree.stop_all()
        door.stop_engine()


@pytest.fixture
def door(tmp_path: Path):
    with front_door(tmp_path) as door:
        yield door


@pytest.fixture(scope="module")
def read_only_door(tmp_path_factory: pytest.TempPathFactory):
    """One door for the tests that only read through it (each looks at its
    own requests only): a door each cost a gateway and an engine start."""
    with front_door(tmp_path_factory.mktemp("door")) as door:
        yield door


COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}


# ---------------------------------------------------------------- row 1: paths


# Each spelling, and what the gateway answers once it has normalized it: its own
# /health or /metrics (never the engine's), or 404 for the engine-only /sleep.
SPELLINGS = {
    "/v1/../health": "/health", "/v1/%2e%2e/health": "/health", "/v1/%2E%2E/metrics": "/metrics",
    "//health": "/health", "/v1/./../health": "/health", "/%68ealth": "/health", "/v1/..%2fhealth": "/health",
    "/v1/%2e%2e%2fmetrics": "/metrics", "/v1/models/../../health": "/health", "/v1/../sleep": "/sleep",
    "/v1/%2e%2e/sleep": "/sleep", "/sleep": "/sleep", "/health/../sleep": "/sleep",
    "/v1/chat/../../metrics": "/metrics",
}


@pytest.mark.parametrize("target", sorted(SPELLINGS))
def test_engine_internals_are_unreachable_under_any_spelling(read_only_door: FrontDoor, target: str):
    door = read_only_door
    status, body = door.get(target)
    assert b"weights_pid" not in body and b"python_gc" not in body, body
    assert not [r for r in door.engine_saw() if r["probe"] == target and r["path"] != "/v1/models"]
    route = SPELLINGS[target]
    if route == "/health":  # the gateway's own health
        assert status == 200 and json.loads(body) == {"model": "tiny", "state": "serving"}, (status, body)
    elif route == "/metrics":  # the gateway's own metrics
        assert status == 200 and b"hostd_gateway_in_flight" in body, (status, body[:200])
    else:
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found", (status, body)


def test_public_paths_reach_the_engine_normalized(door: FrontDoor):
    status, body = door.get("/v1/./chat/../models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny"
    assert [r["path"] for r in door.engine_saw() if r["probe"] == "/v1/./chat/../models"] == ["/v1/models"]


def test_unknown_path_is_404_and_wrong_method_405_in_openai_shape(door: FrontDoor):
    response = httpx.get(door.base_url + "/v1/nothing-here", timeout=10)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "no route /v1/nothing-here" in error["message"]
    response = httpx.get(door.base_url + "/v1/completions", timeout=10)
    assert response.status_code == 405 and response.headers["Allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_a_path_that_is_not_utf8_is_400(door: FrontDoor):
    status, body = door.get("/v1/%ff%fe")
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_path"


# ---------------------------------------------------------------- row 2: bodies


def test_bodies_in_flight_are_capped_across_connections(tmp_path: Path):
    with front_door(tmp_path, max_body_bytes=4 * MiB, body_bytes_in_flight=8 * MiB, body_timeout=30) as door:
        before = door.rss_kib()
        senders = []
        for _ in range(12):  # each sends 3 of its 4 announced MiB, then stops
            conn = socket.create_connection(("127.0.0.1", door.port), timeout=10)
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % (4 * MiB))
            senders.append(conn)
        refused = 0
        for conn in senders:
            try:
                conn.sendall(b" " * (3 * MiB))
            except OSError:  # refused and closed while sending
                pass
        for conn in senders:
            conn.settimeout(0.5)
            try:
                if b" 503 " in conn.recv(4096).split(b"\r\n", 1)[0]:
                    refused += 1
            except (TimeoutError, socket.timeout, ConnectionResetError):
                pass
        grown = door.rss_kib() - before
        assert refused == 10, refused  # two 4 MiB bodies fit in 8 MiB
        assert grown < 40 * 1024, f"gateway RSS grew by {grown} KiB"
        status = door.tree.control("status")
        assert status["in_flight"] == 0  # nothing admitted before its body arrived
        assert 'hostd_gateway_refused_total{model="tiny",status="503"} 10.0' in door.metrics()
        for conn in senders:
            conn.close()
        wait_for(lambda: 'hostd_gateway_body_bytes_held{model="tiny"} 0.0' in door.metrics(), 10, "budget released")


def test_a_body_over_the_size_cap_is_413(tmp_path: Path):
    with front_door(tmp_path, max_body_bytes=1 * MiB) as door:
        response = httpx.post(door.base_url + "/v1/completions", content=b"x" * (2 * MiB), timeout=10)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "body_too_large"
        response = httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10)
        assert response.status_code == 200


def chunked(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\nConnection: close\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


def test_a_chunked_body_that_arrives_whole_is_capped_and_passed_whole(tmp_path: Path):
    # A body that is all there with its headers (one small write) takes the
    # path without a read deadline: the size cap and the byte count hold there
    # too (tests/unit/test_front_door_rules.py pins that path alone).
    with front_door(tmp_path, max_body_bytes=1024) as door:
        answer = door.raw(chunked(b" " * 4096))
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"body_too_large" in answer
        body = json.dumps(COMPLETION).encode() + b" " * 900
        answer = door.raw(chunked(body))
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        completions = [r for r in door.engine_saw() if r["path"] == "/v1/completions"]
        assert [r["body_bytes"] for r in completions] == [len(body)]
        wait_for(lambda: 'hostd_gateway_body_bytes_held{model="tiny"} 0.0' in door.metrics(), 10, "budget released")


# ---------------------------------------------------------------- row 3: slow bodies


def test_a_slow_body_is_not_admitted_does_not_hold_a_drain_and_gets_408(tmp_path: Path):
    with front_door(tmp_path, body_timeout=3) as door:
        conn = socket.create_connection(("127.0.0.1", door.port), timeout=10)
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.5)
        conn.sendall(b" ")
        # Drained with nothing remaining while the body is still incomplete: a
        # slow body held no admission (a held drain would end at its 5 s
        # timeout with remaining 1 and drained false).
        drained = door.tree.control("drain", timeout=5)
        assert drained == {"ok": True, "protocol": control.PROTOCOL, "drained": True, "remaining": 0, "state": "paused"}
        door.tree.control("resume")
        answer = conn.recv(4096)  # the gateway's body_timeout (3 s) fires inside the socket's 10 s
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "body_timeout"
        conn.close()


# ---------------------------------------------------------------- row 4: connections


def test_silent_connections_are_capped_timed_out_and_never_block_the_control_socket(tmp_path: Path):
    with front_door(tmp_path, max_connections=20, header_timeout=2, idle_timeout=30) as door:
        silent = []
        for _ in range(30):  # connect, send half a request line, never finish
            conn = socket.create_connection(("127.0.0.1", door.port), timeout=10)
            conn.sendall(b"GET /v1/mod")
            silent.append(conn)
        # The control socket answers while the 20 admitted connections are held:
        # none of them has been closed yet (their header_timeout has not fired).
        assert door.tree.control("status")["state"] == "serving"
        assert all(still_open(conn) for conn in silent[:20])
        refusals = 0
        for conn in silent[20:]:
            answer = conn.recv(4096)
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
            refusals += 1
        assert refusals == 10
        for conn in silent[:20]:  # closed by the gateway after header_timeout, without an answer
            conn.settimeout(10)
            assert conn.recv(4096) == b""
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
        text = door.metrics()
        assert 'hostd_gateway_connections_refused_total{model="tiny"} 10.0' in text
        assert 'hostd_gateway_connections_timed_out_total{model="tiny",phase="headers"} 20.0' in text
        for conn in silent:
            conn.close()


def test_an_idle_keep_alive_connection_is_closed(tmp_path: Path):
    with front_door(tmp_path, idle_timeout=1) as door:
        with socket.create_connection(("127.0.0.1", door.port), timeout=10) as conn:
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):  # the whole JSON answer
                answer += conn.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200")
            assert conn.recv(4096) == b""  # closed by the gateway's 1 s idle_timeout inside the socket's 10 s


# ---------------------------------------------------------------- metrics


def test_metrics_carry_histograms_and_only_the_engines_own_families(door: FrontDoor):
    for _ in range(3):
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    text = door.metrics()
    assert 'hostd_gateway_request_duration_seconds_count{model="tiny",status="200"} 3.0' in text
    assert 'hostd_gateway_time_to_first_byte_seconds_count{model="tiny",status="200"} 3.0' in text
    assert 'hostd_gateway_admitted_total{model="tiny"} 3.0' in text
    assert 'hostd_engine_requests_running{model="tiny"} 0.0' in text  # the builtin engine's families pass
    assert "python_gc" not in text and "vllm:" not in text  # the engine's process series and others' do not


def test_gateway_counters_survive_an_engine_restart(door: FrontDoor):
    for _ in range(2):
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    door.stop_engine()
    wait_for(lambda: door.tree.control("status")["state"] == "engine-down", 10, "engine down")
    door.start_engine()
    wait_for(lambda: door.tree.control("status")["state"] == "serving", 10, "serving again")
    assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    assert 'hostd_gateway_request_duration_seconds_count{model="tiny",status="200"} 3.0' in door.metrics()


def histogram(text: str, name: str) -> dict[str, float]:
    """NAME's series in TEXT: '_count{...}' / '_sum' / '_bucket{le="0.0"}' -> value
    (their model label, tiny, left out)."""
    unlabelled = text.replace(',model="tiny"', "").replace('model="tiny",', "").replace('{model="tiny"}', "")
    return {line.split()[0][len(name):]: float(line.split()[1]) for line in unlabelled.splitlines()
            if line.startswith(name)}


def test_a_restart_reload_is_measured_from_drain_to_serving_by_outcome(door: FrontDoor):
    door.tree.control("drain", timeout=5)
    time.sleep(0.3)
    door.tree.control("resume", outcome="rolled-back")
    text = door.metrics()
    assert histogram(text, "hostd_gateway_reload_duration_seconds")['_count{outcome="rolled-back"}'] == 1
    unavailable = histogram(text, "hostd_gateway_reload_unavailable_seconds")
    assert unavailable["_count"] == 1 and unavailable["_sum"] >= 0.3  # at least the 0.3 s it was paused
    door.tree.control("drain", timeout=5)
    door.tree.control("resume")  # by hand, no outcome: labelled with the state it led to
    assert histogram(door.metrics(), "hostd_gateway_reload_duration_seconds")['_count{outcome="serving"}'] == 1


def start_next_engine(door: FrontDoor) -> subprocess.Popen:
    """A second engine double on engine-next.sock, as model-engine-next@NAME is."""
    next_socket = door.tree.runtime_dir / "engine-next.sock"
    out = open(door.tree.root / "engine-next-double.log", "ab")
    second = subprocess.Popen([sys.executable, str(DOUBLE), str(next_socket), "--log", str(door.engine_log)],
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_for(lambda: door.tree._connectable(next_socket), 30, "second engine double", second)
    return second


def test_a_stream_broken_on_the_engine_a_switch_left_does_not_stop_admission(door: FrontDoor):
    # An overlap reload restarts the old main engine while the next one serves:
    # a request that fails on the old one must not turn new requests away.
    second = start_next_engine(door)
    try:
        with httpx.stream("POST", door.base_url + "/v1/completions", timeout=30,
                          json={**COMPLETION, "stream": True, "max_tokens": 100, "chunk_delay": 0.1}) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")  # running on main
            assert door.tree.control("switch", slot="next")["slot"] == "next"
            door.engine.kill()  # the old main engine goes away mid-stream
            door.engine.wait(10)
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        assert door.tree.control("status")["state"] == "serving"
        response = httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10)
        assert response.status_code == 200  # served by the next engine
        assert 'hostd_gateway_upstream_errors_total{model="tiny"} 1.0' in door.metrics()
    finally:
        second.terminate()
        second.wait(10)
        door.start_engine()  # the fixture stops it again


def test_an_overlap_reload_is_measured_from_switch_to_switch_back_with_no_503(door: FrontDoor):
    second = start_next_engine(door)
    try:
        assert door.tree.control("switch", slot="next")["slot"] == "next"
        time.sleep(0.3)
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
        assert door.tree.control("switch", slot="main", outcome="done")["slot"] == "main"
    finally:
        second.terminate()
        second.wait(10)
    text = door.metrics()
    duration = histogram(text, "hostd_gateway_reload_duration_seconds")
    assert duration['_count{outcome="done"}'] == 1 and duration['_sum{outcome="done"}'] >= 0.3  # the 0.3 s on next
    unavailable = histogram(text, "hostd_gateway_reload_unavailable_seconds")
    assert unavailable["_count"] == 1 and unavailable["_sum"] == 0
    assert unavailable['_bucket{le="0.0"}'] == 1  # the overlap's zero has a bucket of its own


def test_an_in_place_reload_is_marked_begin_to_end_and_the_gateway_serves_throughout(door: FrontDoor):
    before = door.tree.control("status")
    assert door.tree.control("mark")["state"] == "serving"  # the begin: nothing drains, nothing switches
    time.sleep(0.3)
    assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
    after = door.tree.control("mark", outcome="done")
    assert (after["state"], after["slot"], after["drains"]) == ("serving", "main", before["drains"])
    text = door.metrics()
    duration = histogram(text, "hostd_gateway_reload_duration_seconds")
    assert duration['_count{outcome="done"}'] == 1 and duration['_sum{outcome="done"}'] >= 0.3
    unavailable = histogram(text, "hostd_gateway_reload_unavailable_seconds")
    assert unavailable["_count"] == 1 and unavailable["_sum"] == 0


def test_a_reload_outcome_outside_the_known_set_is_refused_and_changes_nothing(door: FrontDoor):

    door.tree.control("drain", timeout=5)
    with pytest.raises(control.ControlError, match="outcome"):
        door.tree.control("resume", outcome="x" * 20)  # a label is one of the manager's end states
    assert door.tree.control("status")["state"] == "paused"
    with pytest.raises(control.ControlError, match="switch back to main"):
        door.tree.control("switch", slot="next", outcome="done")  # an outcome ends a reload, never starts one
    assert door.tree.control("status")["slot"] == "main"
    with pytest.raises(control.ControlError, match="outcome"):
        door.tree.control("mark", outcome="sideways")
    door.tree.control("resume", outcome="done")
    assert histogram(door.metrics(), "hostd_gateway_reload_duration_seconds")['_count{outcome="done"}'] == 1


def test_client_disconnect_mid_stream_is_counted_and_frees_admission(door: FrontDoor):
    body = {**COMPLETION, "stream": True, "max_tokens": 200, "chunk_delay": 0.05}
    with httpx.stream("POST", door.base_url + "/v1/completions", json=body, timeout=10) as response:
        lines = response.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: {")
        assert door.tree.control("status")["in_flight"] == 1
    wait_for(lambda: door.tree.control("status")["in_flight"] == 0, 10, "the stream ended at the disconnect")
    assert 'hostd_gateway_request_duration_seconds_count{model="tiny",status="499"} 1.0' in door.metrics()


# ---------------------------------------------------------------- API keys


def test_api_keys_are_required_checked_and_never_reach_the_engine(tmp_path: Path):
    with front_door(tmp_path, keys="# keys of tiny\nsk-first\n\nsk-second\n") as door:
        url = door.base_url + "/v1/completions"
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "sk-first"},
                        {"Authorization": "Basic c2stZmlyc3Q="}):
            response = httpx.post(url, json=COMPLETION, headers=headers, timeout=10)
            assert response.status_code == 401, headers
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert httpx.get(door.base_url + "/v1/nothing", timeout=10).status_code == 401  # routes stay hidden
        assert httpx.get(door.base_url + "/metrics", timeout=10).status_code == 401
        for key in ("sk-first", "sk-second"):
            response = httpx.post(url, json=COMPLETION, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert response.status_code == 200
        assert httpx.get(door.base_url + "/health", timeout=10).json() == {"model": "tiny", "state": "serving"}
        assert httpx.get(door.base_url + "/metrics", headers={"Authorization": "Bearer sk-first"},
                         timeout=10).status_code == 200
        assert all(r["authorization"] is None for r in door.engine_saw())
        assert 'hostd_gateway_refused_total{model="tiny",status="401"} 6.0' in door.metrics(
            headers={"Authorization": "Bearer sk-second"})


@pytest.mark.parametrize("content, words", [(None, "cannot read the keys file"), ("# none\n\n", "holds no key")])
def test_a_model_with_keys_it_cannot_read_does_not_start(tmp_path: Path, content, words):
    tree = ModelTree(tmp_path)
    key_file = tmp_path / "api.keys"
    if content is not None:
        key_file.write_text(content)
    tree.write_config(tmp_path / "no-checkpoint", fixed={
        "listen": f"127.0.0.1:{free_port()}", "gateway": {"api_keys": str(key_file)}})
    daemon = tree._spawn("gateway")
    assert daemon.proc.wait(60) == 1
    assert words in daemon.log() and "refusing to serve model tiny without its keys" in daemon.log()


# ---------------------------------------------------------------- the metrics listener


def test_the_metrics_listener_serves_metrics_without_a_key_and_nothing_else(tmp_path: Path):
    """gateway.metrics_listen: Prometheus scrapes with no key there, while the
    public /metrics still wants one, and the listener reaches nothing else."""
    metrics_port = free_port()
    metrics_socket = tmp_path / "scrape" / "tiny.sock"
    with front_door(tmp_path, keys="sk-first\n", metrics_listen=f"127.0.0.1:{metrics_port}") as door:
        scrape = f"http://127.0.0.1:{metrics_port}"
        assert httpx.get(door.base_url + "/metrics", timeout=10).status_code == 401
        response = httpx.get(scrape + "/metrics", timeout=10)
        assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
        assert 'hostd_gateway_in_flight{model="tiny"}' in response.text
        assert 'hostd_gateway_refused_total{model="tiny",status="401"} 1.0' in response.text  # the public one's
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health"),
                             ("GET", "/v1/../metrics/x")):
            refused = httpx.request(method, scrape + path, json=COMPLETION, timeout=10)
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found", (method, path)
        assert httpx.post(scrape + "/metrics", timeout=10).status_code == 405
        assert {r["path"] for r in door.engine_saw()} <= {"/health", "/metrics"}  # the gateway's own asks
    # A Unix socket path serves the same, and goes away with the gateway.
    (tmp_path / "unix").mkdir()
    with front_door(tmp_path / "unix", metrics_listen=str(metrics_socket)) as door:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(metrics_socket))) as client:
            assert "hostd_gateway_in_flight" in client.get("http://metrics/metrics", timeout=10).text
    assert not metrics_socket.exists()


PROMETHEUS_CONFIG = """
global: {{scrape_interval: 1s, scrape_timeout: 1s}}
scrape_configs:
  - job_name: with-token
    authorization: {{credentials_file: {token}}}
    static_configs: [{{targets: ["{target}"]}}]
  - job_name: without
    static_configs: [{{targets: ["{target}"]}}]
"""


def test_a_host_bound_metrics_listener_answers_only_the_token_and_a_real_prometheus_scrapes_it(tmp_path: Path):
    """Issue 55, item 5 (acceptance 4): with gateway.metrics_token the listener
    binds every address of the host (0.0.0.0), and Debian's Prometheus scrapes
    it with `authorization: credentials_file`: that job is up and reads the
    model's series, the same target without the token is down on a 401. A
    wrong token, none, or the public API key are 401 before any path is
    looked at; `systemctl reload`'s push (hostd.gateway.keys) replaces the
    token in the running gateway."""
    metrics_port, prometheus_port = free_port(), free_port()
    token = tmp_path / "metrics.token"
    token.write_text("# the fleet's scrape token\ntok-first\n")
    with front_door(tmp_path, keys="sk-first\n", metrics_listen=f"0.0.0.0:{metrics_port}",
                    metrics_token=str(token)) as door:
        scrape = f"http://127.0.0.1:{metrics_port}"
        for headers in ({}, {"Authorization": "Bearer tok-wrong"}, {"Authorization": "Bearer sk-first"}):
            for path in ("/metrics", "/v1/models"):
                refused = httpx.get(scrape + path, headers=headers, timeout=10)
                assert refused.status_code == 401, (headers, path, refused.text)
                assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        good = httpx.get(scrape + "/metrics", headers={"Authorization": "Bearer tok-first"}, timeout=10)
        assert good.status_code == 200 and 'hostd_gateway_in_flight{model="tiny"}' in good.text

        credentials = tmp_path / "prometheus.token"  # Prometheus's credentials_file: the token alone
        credentials.write_text("tok-first\n")
        (tmp_path / "prometheus.yml").write_text(PROMETHEUS_CONFIG.format(token=credentials,
                                                                         target=f"127.0.0.1:{metrics_port}"))
        prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"), stdin=subprocess.DEVNULL)
        try:
            def targets() -> dict:
                try:
                    answer = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/targets", timeout=5).json()
                except httpx.HTTPError:
                    return {}
                return {t["labels"]["job"]: t for t in answer["data"]["activeTargets"] if t["health"] != "unknown"}

            scraped = wait_for(lambda: len(t := targets()) == 2 and t, 60, "two scrapes by prometheus", prometheus)
            assert scraped["with-token"]["health"] == "up", scraped["with-token"]["lastError"]
            assert scraped["without"]["health"] == "down", scraped["without"]
            assert "401" in scraped["without"]["lastError"], scraped["without"]["lastError"]
            query = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/query", timeout=5,
                              params={"query": 'hostd_build_info{job="with-token"}'}).json()
            assert [r["metric"]["model"] for r in query["data"]["result"]] == ["tiny"]
        finally:
            prometheus.terminate()
            prometheus.wait(30)

        # A new token, as `systemctl reload model@tiny` hands it over (ExecReload= runs this push as root).
        token.write_text("tok-second\n")
        pushed = push_keys(door.tree)
        assert pushed.returncode == 0 and f"1 key(s) from {token}" in pushed.stdout, pushed.stderr
        assert "1 key(s) from " + str(tmp_path / "api.keys") in pushed.stdout
        assert httpx.get(scrape + "/metrics", headers={"Authorization": "Bearer tok-first"}, timeout=10).status_code == 401
        assert httpx.get(scrape + "/metrics", headers={"Authorization": "Bearer tok-second"}, timeout=10).status_code == 200
        assert httpx.get(door.base_url + "/metrics", headers={"Authorization": "Bearer sk-first"},
                         timeout=10).status_code == 200  # the API keys are the API keys still
        assert "metrics tokens replaced from" in door.gateway.log() and "tok-second" not in door.gateway.log()


def test_a_metrics_listener_that_cannot_listen_stops_the_gateway_naming_the_key(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tree = ModelTree(tmp_path)
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        tree.write_config(tmp_path / "no-checkpoint", fixed={
            "listen": f"127.0.0.1:{free_port()}", "gateway": {"metrics_listen": address}})
        daemon = tree._spawn("gateway")
        assert daemon.proc.wait(60) == 1
    assert f"gateway.metrics_listen '{address}': cannot listen there" in daemon.log()


def test_streams_through_the_gateway_arrive_chunk_by_chunk(door: FrontDoor):
    body = {**COMPLETION, "stream": True, "max_tokens": 5, "chunk_delay": 0.2}
    arrivals = []
    with httpx.stream("POST", door.base_url + "/v1/completions", json=body, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5 and arrivals[-1] - arrivals[0] > 0.6  # not buffered to the end


def test_many_clients_at_once_are_all_served(door: FrontDoor):
    with ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda _: httpx.post(door.base_url + "/v1/completions", json=COMPLETION,
                                                   timeout=30).status_code, range(64)))
    assert codes == [200] * 64


def test_the_engine_sees_hostds_own_request_id_never_the_clients(tmp_path: Path):
    """vLLM takes X-Request-Id as its request id: a client must not choose it
    (another client's id, or one id for many requests)."""
    with front_door(tmp_path) as door:
        for _ in range(2):
            response = httpx.post(door.base_url + "/v1/completions", json=COMPLETION,
                                  headers={"X-Request-Id": "victim-request"}, timeout=10)
            assert response.status_code == 200
        ids = [r["request_id"] for r in door.engine_saw() if r["path"] == "/v1/completions"]
    assert len(ids) == 2 and all(len(one) == 1 for one in ids), ids
    assert ids[0] != ids[1] and "victim-request" not in ids[0] + ids[1]


# ---------------------------------------------------------------- key rotation (issue 22 item 18)


def push_keys(tree: ModelTree) -> subprocess.CompletedProcess:
    """What `systemctl reload model@NAME` runs first, as root (model@.service's ExecReload=)."""
    return subprocess.run([sys.executable, "-m", "hostd.gateway.keys", tree.name], env=tree.env(),
                          capture_output=True, text=True, timeout=60)


def test_a_key_rotation_takes_effect_without_a_restart_and_admitted_streams_finish(tmp_path: Path):
    with front_door(tmp_path, keys="sk-old\n") as door:
        url = door.base_url + "/v1/completions"
        pid = door.gateway.pid
        body = {**COMPLETION, "stream": True, "max_tokens": 8, "chunk_delay": 0.25}
        lines: list[str] = []
        started = time.monotonic()

        def stream() -> int:
            with httpx.stream("POST", url, json=body, headers={"Authorization": "Bearer sk-old"},
                              timeout=30) as response:
                for line in response.iter_lines():
                    lines.append(line)
                return response.status_code

        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(stream)
            wait_for(lambda: any(line.startswith("data: {") for line in lines), 10, "the stream's first chunk")
            (tmp_path / "api.keys").write_text("# rotated\nsk-new\nsk-other\n")
            pushed = push_keys(door.tree)
            assert pushed.returncode == 0, pushed.stderr
            assert "2 key(s)" in pushed.stdout
            old = httpx.post(url, json=COMPLETION, headers={"Authorization": "Bearer sk-old"}, timeout=10)
            assert old.status_code == 401
            for key in ("sk-new", "sk-other"):
                assert httpx.post(url, json=COMPLETION, headers={"Authorization": f"Bearer {key}"},
                                  timeout=10).status_code == 200
            assert streaming.result(30) == 200
        assert time.monotonic() - started > 1.5  # the stream was in flight across the rotation
        events = [line for line in lines if line]
        assert sum(line.startswith("data: {") for line in events) == 8 and events[-1] == "data: [DONE]"
        assert door.gateway.pid == pid and door.gateway.proc.poll() is None  # no restart
        assert "API keys replaced" in door.gateway.log() and "sk-new" not in door.gateway.log()


@pytest.mark.parametrize("content, words", [("# emptied\n", "holds no key"), (None, "cannot read the keys file")])
def test_a_broken_keys_file_is_refused_and_the_old_keys_stay(tmp_path: Path, content, words):
    with front_door(tmp_path, keys="sk-old\n") as door:
        key_file = tmp_path / "api.keys"
        if content is None:
            key_file.unlink()
        else:
            key_file.write_text(content)
        pushed = push_keys(door.tree)
        assert pushed.returncode == 1 and words in pushed.stderr and str(key_file) in pushed.stderr
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION,
                          headers={"Authorization": "Bearer sk-old"}, timeout=10).status_code == 200


def test_keys_on_for_a_gateway_started_without_them_take_a_restart(tmp_path: Path):
    with front_door(tmp_path) as door:
        pushed = push_keys(door.tree)
        assert pushed.returncode == 0 and "no gateway.api_keys" in pushed.stdout  # nothing to do
        key_file = tmp_path / "late.keys"
        key_file.write_text("sk-late\n")
        path = door.tree.config_dir / "models" / "tiny.yaml"
        data = yaml.safe_load(path.read_text())
        data["gateway"]["api_keys"] = str(key_file)
        path.write_text(yaml.safe_dump(data))
        pushed = push_keys(door.tree)
        assert pushed.returncode == 1 and "systemctl restart model@tiny" in pushed.stderr
        assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
