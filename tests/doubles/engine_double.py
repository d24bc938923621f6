"""TEST DOUBLE: an engine on engine.sock for the gateway's front-door tests.

Serves what the gateway talks to, quickly and without a model: /health with
the internal details a real engine's health carries (PIDs, weights socket
inode), /metrics with the engine's own families and process series the
gateway must filter, /v1/models, and /v1/completions that echoes the body
length and streams SSE when asked (chunk_delay seconds between chunks, pad
bytes added to each). Every request it receives is appended to --log as one JSON line, so a test can
assert what reached the engine.

    python tests/doubles/engine_double.py SOCKET --log FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from aiohttp import web

from hostd import sockets


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("socket")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    log = open(args.log, "a", buffering=1)

    @web.middleware
    async def record(request: web.Request, handler):
        log.write(json.dumps({"method": request.method, "path": request.raw_path,
                              "probe": request.headers.get("X-Probe"),
                              "authorization": request.headers.get("Authorization"),
                              "request_id": request.headers.getall("X-Request-Id", []),
                              "content_encoding": request.headers.getall("Content-Encoding", []),
                              "body_bytes": len(await request.read())}) + "\n")
        return await handler(request)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "weights_pid": 4242, "weights_socket_inode": 77,
                                  "engine_config": {"max_num_seqs": 4}})

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=(
            "# HELP python_gc_objects_collected_total Objects collected during gc\n"
            "# TYPE python_gc_objects_collected_total counter\n"
            'python_gc_objects_collected_total{generation="0"} 1.0\n'
            "# HELP hostd_engine_requests_running Requests generating now\n"
            "# TYPE hostd_engine_requests_running gauge\n"
            "hostd_engine_requests_running 0.0\n"
            "# HELP vllm:num_requests_running Requests running\n"
            "# TYPE vllm:num_requests_running gauge\n"
            'vllm:num_requests_running{model_name="tiny"} 0.0\n'
        ))

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw or b"{}")
        if not body.get("stream"):
            return web.json_response({"object": "text_completion", "body_bytes": len(raw),
                                      "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        pad = "x" * int(body.get("pad", 0))  # bytes added to each event's text, for a large stream
        for i in range(int(body.get("max_tokens", 4))):
            event = {"object": "text_completion",
                     "choices": [{"index": 0, "text": f"t{i}{pad}", "finish_reason": None}]}
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            await asyncio.sleep(float(body.get("chunk_delay", 0)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application(middlewares=[record], client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", models)
    app.router.add_post("/sleep", models)  # an admin route: must never be reached
    listener = sockets.bind_private(Path(args.socket))
    print(f"engine double pid {os.getpid()} on {args.socket}", flush=True)
    web.run_app(app, sock=listener, print=None, handler_cancellation=True)


if __name__ == "__main__":
    main()
