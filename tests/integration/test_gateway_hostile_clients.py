"""The gateway's front door against cheap attackers (issue 22, items 1, 3, 4,
5, 10, 11, 12): a real gateway process in front of the engine double, driven
over real TCP sockets. An attacker connects from 127.0.0.1; a legitimate
client, where one must be told apart, from another loopback address
(127.0.0.2, 127.0.0.3), as two hosts would. Each test names the attack and
what everyone else still sees."""

from __future__ import annotations

import gzip
import json
import socket
import time
from pathlib import Path

import httpx

from test_gateway_front_door import COMPLETION, FrontDoor, door, front_door, still_open  # noqa: F401 (door: a fixture)
from harness.local import ModelTree, free_port, wait_for

MiB = 1 << 20
LEGIT, WATCHER = "127.0.0.2", "127.0.0.3"  # the other clients' source addresses


def client(address: str) -> httpx.Client:
    """An HTTP client whose connections come from ADDRESS."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=10)


def metrics(door: FrontDoor) -> str:
    with client(WATCHER) as http:
        return http.get(door.base_url + "/metrics").text


def connect(door: FrontDoor, request: bytes = b"") -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", door.port), timeout=10)
    if request:
        conn.sendall(request)
    return conn


def answer_of(conn: socket.socket) -> bytes:
    """The gateway's answer on CONN: up to its Content-Length, or until it
    closes CONN (b"" when it closes without answering)."""
    answer = b""
    try:
        while chunk := conn.recv(65536):
            answer += chunk
            head, _, body = answer.partition(b"\r\n\r\n")
            lengths = [line.split(b":", 1)[1] for line in head.lower().split(b"\r\n")
                       if line.startswith(b"content-length:")]
            if lengths and len(body) >= int(lengths[0]):
                break
    except ConnectionResetError:
        pass
    return answer


def head(length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


# ---------------------------------------------------------------- item 1: bodies


def test_announced_bodies_that_never_arrive_do_not_fill_the_body_budget(tmp_path: Path):
    # The defaults: 128 MiB of bodies in flight, 32 MiB a body. Four clients
    # announcing 32 MiB each and sending nothing used to hold all of it.
    with front_door(tmp_path) as door:
        silent = [connect(door, head(32 * MiB)) for _ in range(4)]
        time.sleep(0.5)
        response = httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10)
        assert response.status_code == 200, response.text
        assert 'hostd_gateway_body_bytes_held{model="tiny"} 0.0' in metrics(door)
        assert all(still_open(conn) for conn in silent)  # still waiting for their bytes (body_timeout)
        for conn in silent:
            conn.close()


def test_one_client_holds_its_share_of_the_body_budget_and_others_are_served(tmp_path: Path):
    with front_door(tmp_path, max_body_bytes=1 * MiB, body_bytes_in_flight=8 * MiB,
                    body_bytes_per_client=2 * MiB, body_timeout=30) as door:
        senders = []
        for _ in range(3):  # each sends all but one byte of its 1 MiB body and stops
            conn = connect(door, head(MiB))
            conn.sendall(b" " * (MiB - 1))
            senders.append(conn)
            time.sleep(0.3)
        third = answer_of(senders[2])  # 2 MiB are held: the third is over its client's share
        assert third.startswith(b"HTTP/1.1 503 "), third[:200]
        error = json.loads(third.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "too_many_bodies" and "per client" in error["message"]
        assert all(still_open(conn) for conn in senders[:2])
        with client(LEGIT) as http:  # another client's bodies still fit
            body = {**COMPLETION, "prompt": "x" * (MiB // 2)}
            assert http.post(door.base_url + "/v1/completions", json=body).status_code == 200
        for conn in senders:
            conn.close()
        wait_for(lambda: 'hostd_gateway_body_bytes_held{model="tiny"} 0.0' in metrics(door), 10, "budget released")


# ---------------------------------------------------------------- item 3: a client that stops reading


def test_a_client_that_stops_reading_is_cut_off_and_does_not_hold_a_drain(tmp_path: Path):
    with front_door(tmp_path, write_timeout=2) as door:
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        conn.connect(("127.0.0.1", door.port))
        body = json.dumps({**COMPLETION, "stream": True, "max_tokens": 4000, "pad": 65536}).encode()
        conn.sendall(head(len(body)) + body)
        wait_for(lambda: door.tree.control("status")["in_flight"] == 1, 10, "the stream admitted")
        # The drain ends because the stalled stream is cut off write_timeout
        # after its client stopped reading, not at the drain's own timeout.
        drained = door.tree.control("drain", timeout=30)
        assert drained["drained"] is True and drained["remaining"] == 0, drained
        door.tree.control("resume")
        assert 'hostd_gateway_connections_timed_out_total{model="tiny",phase="write"} 1.0' in metrics(door)
        conn.close()


def test_a_slow_reader_that_keeps_reading_is_not_cut_off(tmp_path: Path):
    with front_door(tmp_path, write_timeout=2) as door:
        body = {**COMPLETION, "stream": True, "max_tokens": 40, "pad": 65536}
        received = 0
        with httpx.stream("POST", door.base_url + "/v1/completions", json=body, timeout=30) as response:
            for chunk in response.iter_raw(65536):
                received += len(chunk)
                time.sleep(0.05)  # reads 64 KiB every 50 ms: slow, but it accepts bytes
        assert received > 40 * 65536
        assert 'phase="write"' not in metrics(door)


# ---------------------------------------------------------------- item 4: the connection cap


def keep_alive_health(door: FrontDoor) -> socket.socket:
    """A connection that asked GET /health, read the answer and stays open (keep-alive)."""
    conn = connect(door, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    answer = b""
    while not answer.endswith(b"}"):
        answer += conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200 ")
    return conn


def test_idle_keep_alive_connections_at_the_cap_make_room_for_a_new_client(tmp_path: Path):
    with front_door(tmp_path, max_connections=20) as door:
        held = [keep_alive_health(door) for _ in range(20)]  # the whole cap, idle between requests
        with client(LEGIT) as http:
            assert http.post(door.base_url + "/v1/completions", json=COMPLETION).status_code == 200
        assert held[0].recv(4096) == b""  # the longest idle was closed to make room
        assert all(still_open(conn) for conn in held[2:])
        assert "hostd_gateway_connections_evicted_total" in metrics(door)
        assert 'hostd_gateway_connections_refused_total{model="tiny"} 0.0' in metrics(door)
        for conn in held:
            conn.close()


def test_unfinished_heads_at_the_cap_make_room_for_a_new_client_oldest_first(tmp_path: Path):
    # Issue 33, M2: heads still arriving were never evicted, so heads renewed
    # every header_timeout (from enough addresses) kept every new client out.
    with front_door(tmp_path, max_connections=20, max_connections_per_client=20, header_timeout=30) as door:
        slow = [connect(door, b"GET /v1/mod") for _ in range(20)]  # the whole cap, none idle
        with client(LEGIT) as http:
            assert http.post(door.base_url + "/v1/completions", json=COMPLETION).status_code == 200
        assert slow[0].recv(4096) == b""  # the oldest unfinished head was closed to make room
        assert all(still_open(conn) for conn in slow[2:])
        assert 'hostd_gateway_connections_refused_total{model="tiny"} 0.0' in metrics(door)
        for conn in slow:
            conn.close()


def test_bodies_trickling_at_the_cap_make_room_for_a_new_client_slowest_first(tmp_path: Path):
    """Issue 52, M2: a connection that had sent its head and trickled its
    body was never evicted: 40 of them answered every new client 503 until
    body_timeout. Now the slowest body makes room; none of them was admitted."""
    with front_door(tmp_path, max_connections=20, max_connections_per_client=20, body_timeout=30) as door:
        tricklers = [connect(door, head(1000) + b'{"pro') for _ in range(20)]  # the whole cap, bodies unfinished
        time.sleep(0.5)
        for conn in tricklers[1:]:
            conn.sendall(b"m")  # the first one stays the slowest
        time.sleep(0.2)
        with client(LEGIT) as http:
            assert http.post(door.base_url + "/v1/completions", json=COMPLETION).status_code == 200
        assert answer_of(tricklers[0]) == b""  # the slowest body was closed unanswered to make room
        assert all(still_open(conn) for conn in tricklers[2:])
        text = metrics(door)
        assert 'hostd_gateway_connections_refused_total{model="tiny"} 0.0' in text
        assert "hostd_gateway_connections_evicted_total" in text
        for conn in tricklers:
            conn.close()
        posts = [r for r in door.engine_saw() if r["method"] == "POST"]
        assert len(posts) == 1  # the legitimate request alone reached the engine
        assert "Traceback" not in door.gateway.log(), door.gateway.log()[-3000:]


def test_one_client_holds_at_most_its_share_of_connections(tmp_path: Path):
    with front_door(tmp_path, max_connections=20, max_connections_per_client=5, header_timeout=30) as door:
        slow = [connect(door, b"GET /v1/mod") for _ in range(5)]  # unfinished headers: never idle
        refused = answer_of(connect(door, b"GET /v1/mod"))
        assert refused.startswith(b"HTTP/1.1 503 "), refused[:200]
        assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["code"] == "too_many_connections"
        assert all(still_open(conn) for conn in slow)
        with client(LEGIT) as http:
            assert http.post(door.base_url + "/v1/completions", json=COMPLETION).status_code == 200
        for conn in slow:
            conn.close()


# ---------------------------------------------------------------- item 5: compressed bodies


def test_a_compressed_request_body_is_refused_415_and_never_inflated_or_forwarded(door: FrontDoor):
    body = gzip.compress(json.dumps(COMPLETION).encode())
    response = httpx.post(door.base_url + "/v1/completions", content=body, timeout=10,
                          headers={"Content-Encoding": "gzip", "Content-Type": "application/json",
                                   "X-Probe": "gzip"})
    assert response.status_code == 415, response.text
    assert response.json()["error"]["code"] == "unsupported_content_encoding"
    assert not [r for r in door.engine_saw() if r["probe"] == "gzip"]
    assert httpx.post(door.base_url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200


def test_two_content_encoding_fields_are_refused_415_and_the_field_is_never_forwarded(door: FrontDoor):
    # Issue 33, M3: the gateway read the first field (identity) and passed both
    # on; the engine's parser took the last (gzip) and inflated a bomb.
    bomb = gzip.compress(b" " * (8 * MiB))
    answer = door.raw(head(len(bomb))[:-2] + b"X-Probe: two\r\nContent-Encoding: identity\r\n"
                      b"Content-Encoding: gzip\r\nConnection: close\r\n\r\n" + bomb)
    assert answer.startswith(b"HTTP/1.1 415 "), answer[:300]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unsupported_content_encoding"
    body = json.dumps(COMPLETION).encode()
    one = door.raw(head(len(body))[:-2] + b"X-Probe: identity\r\nContent-Encoding: identity\r\n"
                   b"Connection: close\r\n\r\n" + body)
    assert one.startswith(b"HTTP/1.1 200 "), one[:300]
    seen = door.engine_saw()
    assert not [r for r in seen if r["probe"] == "two"]
    assert [r["content_encoding"] for r in seen if r["probe"] == "identity"] == [[]]  # dropped on the way


# ---------------------------------------------------------------- item 10: headers


def test_request_headers_over_64_kib_are_answered_431_and_a_large_body_is_not_headers(door: FrontDoor):
    conn = connect(door, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    for i in range(12):  # 12 fields of 8000 bytes, each within aiohttp's own 8190, the head never ends
        conn.sendall(f"X-Pad-{i}: {'a' * 8000}\r\n".encode())
    answer = answer_of(conn)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"
    # A body sent with its headers in one burst is body, not headers.
    body = json.dumps({**COMPLETION, "prompt": "x" * (2 * MiB)}).encode()
    with connect(door, head(len(body))[:-2] + b"Connection: close\r\n\r\n" + body) as conn:
        assert answer_of(conn).startswith(b"HTTP/1.1 200 ")


# ---------------------------------------------------------------- item 11: keys


def test_an_authorization_header_that_is_not_utf8_is_401(tmp_path: Path):
    with front_door(tmp_path, keys="sk-first\n") as door:
        answer = door.raw(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                          b"Connection: close\r\n\r\n")  # bytes that are not UTF-8
        assert answer.startswith(b"HTTP/1.1 401 "), answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_api_key"
        assert "Traceback" not in door.gateway.log()


# ---------------------------------------------------------------- item 12: logging


def test_malformed_requests_log_no_traceback_and_no_error(door: FrontDoor):
    for request in (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n",
                    b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
                    b"GET /v1/models HTTP/9.9 Traceback (most recent call last):\r\n\r\n"):
        answer = door.raw(request)
        assert answer.split(b" ", 2)[1] == b"400", answer[:200]
    assert httpx.get(door.base_url + "/health", timeout=10).status_code == 200
    log = door.gateway.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-2000:]


# ---------------------------------------------------------------- issue 33, H2: a chat's size


def test_a_huge_role_or_a_million_empty_messages_are_refused_unread_and_another_client_is_served(
        tmp_path: Path, tiny_checkpoint: Path):
    # Through the gateway to the builtin engine, no key. A 30 MiB role used to
    # reach the template uncounted (minutes of one preparation thread, everyone
    # waiting behind it), and 1M messages {"role": "u"} counted as no content.
    # Issue 52: both are larger than any request this model can take, so the
    # gateway refuses them by their length, with the engine's own cap (its
    # /health's max_body_bytes), before a byte of them is read; under that cap
    # the engine's decoding still caps a role and the count of messages.
    port = free_port()
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=2)
    try:
        tree.start_serving(port)
        url = tree.base_url + "/v1/chat/completions"
        cap = tree.health()["max_body_bytes"]
        role = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u" * (30 * MiB)}]})
        many = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u"}] * 1_000_000})
        long_role = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u" * (cap // 2)}]})
        some = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "u"}] * 2049})
        answers = {}
        with httpx.Client(timeout=120) as attacker:
            for name, body in (("role", role), ("many", many), ("long_role", long_role), ("some", some)):
                answers[name] = attacker.post(url, content=body, headers={"Content-Type": "application/json"})
        with client(LEGIT) as http:
            small = http.post(url, json={"model": "tiny", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "hi"}]})

        assert cap < 30 * MiB  # and the gateway's own max_body_bytes is the default 32 MiB
        for name in ("role", "many"):
            refused = answers[name]
            assert refused.status_code == 413, refused.text[:300]
            assert refused.json()["error"]["code"] == "body_too_large"
            assert f"at most {cap} are accepted" in refused.json()["error"]["message"]
        engine_log = next(d for d in tree.daemons if d.proc.args[3] == "engine").log()
        refusals = [line for line in engine_log.splitlines() if "refused a request body" in line]
        assert len(refusals) == 2, refusals  # long_role's and some's: the engine never saw the two larger ones
        assert answers["long_role"].status_code == 400, answers["long_role"].text[:300]
        assert answers["long_role"].json()["error"]["param"] == "messages"
        assert "messages[0].role" in answers["long_role"].json()["error"]["message"]
        assert answers["some"].status_code == 400, answers["some"].text[:300]
        assert "length <= 2048" in answers["some"].json()["error"]["message"]
        assert small.status_code == 200, small.text
        assert tree.control("status")["state"] == "serving"
    finally:
        tree.stop_all()
