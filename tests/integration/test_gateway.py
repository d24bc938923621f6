"""The gateway as a real process in front of a real builtin engine: drains
lose nothing, a dead engine fails fast, bad control input changes nothing."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import msgspec
import pytest

from hostd.gateway import control
from harness.local import ModelTree, as_other_user, free_port, wait_for


def serve(directory: Path, checkpoint: Path):
    port = free_port()
    tree = ModelTree(directory)
    tree.write_config(
        checkpoint,
        fixed={"listen": f"127.0.0.1:{port}", "gateway": {"retry_after": 7}},
        max_num_seqs=32,
    )
    tree.start_serving(port)
    try:
        yield tree
    finally:
        tree.stop_all()


@pytest.fixture
def served(tmp_path: Path, tiny_checkpoint: Path):
    yield from serve(tmp_path, tiny_checkpoint)


@pytest.fixture(scope="module")
def unchanged(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path):
    """One stack for the tests that send what must change nothing (each
    checks that it did not): a stack per case cost a model start each."""
    yield from serve(tmp_path_factory.mktemp("unchanged"), tiny_checkpoint)


def client(tree: ModelTree) -> openai.OpenAI:
    return openai.OpenAI(base_url=tree.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def stream_chat(tree: ModelTree, max_tokens: int) -> dict:
    """One streaming chat completion; returns what the client saw."""
    stream = client(tree).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks, finish, usage = 0, None, None
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                chunks += 1
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return {"chunks": chunks, "finish": finish, "completion_tokens": usage}


def post_completion(tree: ModelTree) -> httpx.Response:
    return httpx.post(
        tree.base_url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        timeout=60,
    )


def test_drain_during_32_streams_loses_nothing(served: ModelTree):
    # Long enough that the first streams still run when the 32nd is admitted
    # on a loaded 2-core machine (at 48 tokens a full local run, beside other
    # test runs, saw in_flight never reach 32: the first ones had ended).
    max_tokens = 160
    with ThreadPoolExecutor(32) as pool, ThreadPoolExecutor(1) as admin:
        streams = [pool.submit(stream_chat, served, max_tokens) for _ in range(32)]
        wait_for(lambda: served.control("status")["in_flight"] == 32, 60, "32 streams in flight")

        drain = admin.submit(served.control, "drain", timeout=300)
        wait_for(lambda: served.control("status")["state"] in ("draining", "paused"), 10, "draining")
        refused = [post_completion(served) for _ in range(5)]
        with pytest.raises(openai.APIStatusError) as info:
            client(served).completions.create(model="tiny", prompt="Hi", max_tokens=2)

        drained = drain.result(300)
        results = [s.result(300) for s in streams]

    assert drained == {"ok": True, "protocol": control.PROTOCOL, "drained": True, "remaining": 0, "state": "paused"}
    assert all(r == {"chunks": r["chunks"], "finish": "length", "completion_tokens": max_tokens} for r in results), results
    assert all(r["chunks"] > 0 for r in results)
    for response in refused:
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "7"
        assert response.json()["error"]["code"] in ("model_draining", "model_paused")
    assert info.value.status_code == 503

    assert served.control("resume")["state"] == "serving"
    assert post_completion(served).status_code == 200
    status = served.control("status")
    assert status["admitted"] == 33 and status["completed"] == 33 and status["in_flight"] == 0
    assert sum(status["rejected"].values()) == 6


def test_engine_killed_mid_stream_fails_clients_fast_and_gateway_survives(served: ModelTree):
    engine = next(d for d in served.daemons if d.proc.args[3] == "engine")
    gateway = next(d for d in served.daemons if d.proc.args[3] == "gateway")
    errors: list[BaseException] = []
    started = threading.Event()

    def long_stream():
        try:
            stream = client(served).completions.create(
                model="tiny", prompt="Once", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
        except BaseException as exc:  # what the client library raised
            errors.append(exc)
        started.set()

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(60)
    engine.proc.send_signal(signal.SIGKILL)
    thread.join(30)  # a safety bound, not a performance assertion
    assert not thread.is_alive(), "the client hung after the engine died"
    assert errors and isinstance(errors[0], (openai.APIError, httpx.HTTPError)), errors

    wait_for(lambda: post_completion(served).status_code == 503, 10, "503 while the engine is down")
    response = post_completion(served)
    assert response.json()["error"]["code"] == "model_engine_down"
    assert response.headers["Retry-After"] == "7"
    assert gateway.proc.poll() is None

    served.start_engine()
    wait_for(lambda: post_completion(served).status_code == 200, 60, "serving again")


def test_drain_that_times_out_reports_what_still_runs_and_leaves_it_running(served: ModelTree):
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(stream_chat, served, 300) for _ in range(2)]
        wait_for(lambda: served.control("status")["in_flight"] == 2, 60, "2 streams in flight")
        result = served.control("drain", timeout=0.2)
        assert result == {"ok": True, "protocol": control.PROTOCOL, "drained": False, "remaining": 2, "state": "draining"}
        assert post_completion(served).status_code == 503
        finished = [s.result(300) for s in streams]
    assert all(r["finish"] == "length" and r["completion_tokens"] == 300 for r in finished)
    assert served.control("resume")["state"] == "serving"


@pytest.mark.parametrize(
    "line, error",
    [
        (b'{"verb": "reboot"}\n', "expected verb drain, resume, status, switch, settle, keys or mark"),
        (b"not json\n", "not a JSON object"),
        (b'{"verb": "drain", "timeout": "soon"}\n', "Expected `float`"),
        (b'{"verb": "drain", "timeout": -1}\n', "Expected `float` > 0.0"),
        (b'{"verb": "drain"}\n', "missing required field `timeout`"),
        (b'{"verb": "resume", "force": true}\n', "unknown field `force`"),
    ],
)
def test_bad_control_input_is_refused_and_changes_nothing(unchanged: ModelTree, line: bytes, error: str):
    served = unchanged
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(served.control_socket))
        conn.sendall(line)
        answer = conn.makefile("rb").readline()
    refusal = msgspec.json.decode(answer, type=control.Refusal)
    assert not refusal.ok and error in refusal.error, answer
    status = served.control("status")
    assert status["state"] == "serving" and status["drains"] == 0
    assert post_completion(served).status_code == 200


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
def test_control_peer_with_another_uid_is_refused(unchanged: ModelTree):
    served = unchanged
    open_dir = Path(tempfile.mkdtemp(prefix="hostd-ctl-test-"))
    try:
        path = open_dir / "tiny" / "control.sock"
        gateway = served.start_gateway("--control", str(path), "--listen", f"127.0.0.1:{free_port()}")
        os.chmod(open_dir, 0o755)
        os.chmod(path.parent, 0o711)
        os.chmod(path, 0o666)
        def drain_as_nobody() -> str:
            # A raw connection: control.call would refuse a root-owned socket on
            # nobody's side before the gateway's own peer check is reached.
            with socket.socket(socket.AF_UNIX) as conn:
                conn.settimeout(10)
                conn.connect(str(path))
                try:
                    conn.sendall(b'{"verb": "drain", "timeout": 5}\n')
                    return "answered" if conn.recv(4096) else "refused"
                except (BrokenPipeError, ConnectionResetError) as exc:  # closed before a byte is read
                    return f"refused: {exc}"

        outcome = as_other_user(drain_as_nobody)
        assert outcome.startswith("refused"), outcome
        wait_for(lambda: "uid 65534 is neither" in gateway.log(), 10, "refusal log line")
        assert control.call(path, control.Status()).drains == 0
    finally:
        shutil.rmtree(open_dir)
