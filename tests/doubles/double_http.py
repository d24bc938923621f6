"""TEST DOUBLE support: exists only to test hostd's orchestration of vLLM and SGLang.

A tiny stdlib HTTP server shared by the `vllm` and `sglang` doubles: /health
(and SGLang's /ready), /v1/models and /v1/completions with canned text, on a
Unix socket or a TCP port, and upstream's SIGTERM behaviour (stop at once,
drain up to a timeout, or drain without limit) as observed: vLLM's /health
stays 200 while it drains and new requests get HTTP 500; SGLang's /health runs
a generation (HOSTD_TEST_HEALTH_SECONDS stands for its duration). Nothing here
loads a model or needs a GPU.
"""

from __future__ import annotations

import json
import os
import signal
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Optional

DEFAULT_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"


def gpu_uuids() -> list[str]:
    """One fake UUID per visible GPU: HOSTD_TEST_GPU_UUID with its last four
    digits replaced by the device index, so GPUs 0 and 1 differ."""
    base = os.environ.get("HOSTD_TEST_GPU_UUID", DEFAULT_GPU_UUID)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0")
    return [f"{base[:-4]}{int(index):04x}" for index in visible.split(",") if index.strip()]


def accept_and_close(sock) -> None:
    """Accept connections on a weight cache socket and close them (nothing to serve)."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class State:
    def __init__(self) -> None:
        self.inflight = 0
        self.draining = False
        self.lock = threading.Lock()


class _Unix(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 2048  # uvicorn's default backlog (socketserver's 5 refuses a burst of streams)


class _Tcp(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    request_queue_size = 2048
    allow_reuse_address = True


def serve(address, served_name: str, health: dict, shutdown_timeout: Optional[float]) -> int:
    """Serve until SIGTERM/SIGINT; then drain for SHUTDOWN_TIMEOUT seconds
    (0: abort at once, None: without limit, as SGLang). Returns the exit code."""
    state = State()
    flavour = health.get("double")
    delay = float(os.environ.get("HOSTD_TEST_COMPLETION_SECONDS", "0"))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # no client address on a Unix socket
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _stream(self, request: dict) -> None:
            """SSE as upstream's OpenAI server streams a completion: one event
            per token (max_tokens of them, HOSTD_TEST_TOKEN_SECONDS apart),
            then `data: [DONE]`, in HTTP/1.1 chunks."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            pause = float(os.environ.get("HOSTD_TEST_TOKEN_SECONDS", "0"))
            tokens = int(request.get("max_tokens", 16))
            try:
                self._events(served_name, tokens, pause)
            except (BrokenPipeError, ConnectionResetError):  # the client left mid-stream
                self.close_connection = True

        def _events(self, served_name: str, tokens: int, pause: float) -> None:
            for index in range(tokens + 1):
                if index < tokens:
                    time.sleep(pause)
                    event = {"id": "cmpl-double", "object": "text_completion", "model": served_name,
                             "choices": [{"index": 0, "text": " tok",
                                          "finish_reason": "length" if index == tokens - 1 else None}]}
                    data = f"data: {json.dumps(event)}\n\n".encode()
                else:
                    data = b"data: [DONE]\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")

        def do_GET(self) -> None:
            if self.path == "/health" and flavour == "vllm":
                self._send(200, health)  # vLLM: still 200 while it drains
            elif self.path == "/health":
                # SGLang's /health runs a one-token generation (up to 20 s).
                time.sleep(float(os.environ.get("HOSTD_TEST_HEALTH_SECONDS", "0")))
                self._send(503 if state.draining else 200, health)
            elif self.path == "/ready" and flavour == "sglang":
                self._send(503 if state.draining else 200, health)
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": served_name, "object": "model"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b"{}"
            if self.path != "/v1/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            with state.lock:
                if state.draining:  # vLLM answers 500 to new requests while it drains
                    self._send(500 if flavour == "vllm" else 503, {"error": {"message": "server is shutting down"}})
                    return
                state.inflight += 1
            try:
                try:
                    request = json.loads(raw or b"{}")
                except ValueError:  # vLLM and SGLang answer a body that is not JSON 400
                    self._send(400, {"error": {"message": "the request body is not valid JSON"}})
                    return
                if request.get("model") != served_name:
                    self._send(404, {"error": {"message": f"model {request.get('model')!r} does not exist"}})
                    return
                time.sleep(delay)
                if request.get("stream"):
                    self._stream(request)
                    return
                self._send(200, {
                    "id": "cmpl-double", "object": "text_completion", "model": served_name,
                    "choices": [{"index": 0, "text": " from the test double", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5},
                })
            finally:
                with state.lock:
                    state.inflight -= 1

    if isinstance(address, str):
        try:
            os.unlink(address)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            server = _Unix(address, Handler)
        finally:
            os.umask(old)
    else:
        server = _Tcp(address, Handler)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(f"serving {served_name} on {address}")
    while not stop.wait(0.2):
        pass
    with state.lock:
        state.draining = True
    if shutdown_timeout != 0:
        deadline = None if shutdown_timeout is None else time.monotonic() + shutdown_timeout
        while state.inflight and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)
    log(f"shutting down with {state.inflight} request(s) in flight")
    server.shutdown()
    server.server_close()
    if isinstance(address, str):
        try:
            os.unlink(address)
        except FileNotFoundError:
            pass
    return 0
