"""hostd.forward between a real aiohttp client, a proxy and an engine double,
all on real Unix sockets: SSE passes event by event, connection fields stop
at each hop, a client's disconnect reaches the engine, an engine failure ends
the client's response visibly."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from hostd import forward, sockets


class Engine:
    """An engine double that records what it saw."""

    def __init__(self) -> None:
        self.seen_headers: dict[str, list[str]] = {}
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/echo", self.echo)
        app.router.add_get("/v1/stream", self.stream)
        app.router.add_get("/v1/hang", self.hang)
        app.router.add_get("/v1/die", self.die)
        return app

    async def echo(self, request: web.Request) -> web.Response:
        self.seen_headers = {k.lower(): request.headers.getall(k) for k in request.headers}
        response = web.Response(body=await request.read(), content_type="application/json")
        response.headers.add("Set-Cookie", "a=1")
        response.headers.add("Set-Cookie", "b=2")
        response.headers["Connection"] = "keep-alive, X-Hop"
        response.headers["X-Hop"] = "engine-side connection field"
        response.headers["Trailer"] = "X-Checksum"
        return response

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await self.release.wait()  # the client must see the first event before this
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def hang(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: started\n\n")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return response

    async def die(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: partial\n\n")
        request.transport.abort()
        return response


async def start(app: web.Application, path: Path) -> web.AppRunner:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.SockSite(runner, sockets.bind_private(path)).start()
    return runner


def proxy_app(engine_path: Path, outcomes: list[str]) -> web.Application:
    state = {}

    async def startup(app):
        state["session"] = forward.session(aiohttp.UnixConnector(path=str(engine_path)), 5)

    async def cleanup(app):
        await state["session"].close()

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        try:
            response = await forward.forward(
                state["session"], f"http://engine{request.rel_url}", request, body,
                stream_error={"message": "engine stopped mid-stream", "code": "engine_down"},
            )
        except forward.Unreachable:
            outcomes.append("unreachable")
            return web.json_response({"error": {"message": "engine down"}}, status=503)
        except forward.Broken as exc:
            outcomes.append("broken")
            return exc.response
        outcomes.append("ok")
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    return app


@pytest.fixture
def run(tmp_path: Path):
    """Run an async test body with an engine double and a proxy in front of it."""
    directory = tmp_path / "run"

    def runner(body):
        async def main():
            engine = Engine()
            outcomes: list[str] = []
            engine_runner = await start(engine.app(), directory / "engine.sock")
            proxy_runner = await start(proxy_app(directory / "engine.sock", outcomes), directory / "proxy.sock")
            client = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(directory / "proxy.sock")))
            try:
                await asyncio.wait_for(body(client, engine, outcomes), 30)
            finally:
                await client.close()
                await proxy_runner.cleanup()
                await engine_runner.cleanup()

        asyncio.run(main())

    return runner


def test_hop_by_hop_fields_stop_at_the_proxy_in_both_directions(run):
    async def body(client, engine, outcomes):
        async with client.post(
            "http://gw/v1/echo", data=b'{"x": 1}',
            headers={"Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "1", "TE": "trailers",
                     "Proxy-Authorization": "Basic eA==", "Trailer": "X", "X-End-To-End": "kept"},
        ) as response:
            assert await response.read() == b'{"x": 1}'
            assert response.headers.getall("Set-Cookie") == ["a=1", "b=2"]
            assert response.headers["Content-Length"] == "8"
            assert "X-Hop" not in response.headers and "Trailer" not in response.headers
        seen = engine.seen_headers
        for name in ("x-client-hop", "te", "proxy-authorization", "trailer"):
            assert name not in seen, (name, seen)
        assert seen["x-end-to-end"] == ["kept"]
        assert outcomes == ["ok"]

    run(body)


def test_sse_events_reach_the_client_as_the_engine_writes_them(run):
    async def body(client, engine, outcomes):
        async with client.get("http://gw/v1/stream") as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            assert "Content-Length" not in response.headers
            assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
            engine.release.set()
            assert await response.read() == b"data: [DONE]\n\n"

    run(body)


def test_client_disconnect_cancels_the_engine_request(run):
    async def body(client, engine, outcomes):
        response = await client.get("http://gw/v1/hang")
        assert await response.content.readuntil(b"\n\n") == b"data: started\n\n"
        response.close()  # the client goes away mid-stream
        await asyncio.wait_for(engine.cancelled.wait(), 10)

    run(body)


def test_engine_failure_mid_stream_ends_the_response_with_an_error_event(run):
    async def body(client, engine, outcomes):
        async with client.get("http://gw/v1/die") as response:
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in response.content.iter_any():
                    received += chunk
        events = [e for e in received.split(b"\n\n") if e]
        assert events[0] == b"data: partial"
        assert json.loads(events[-1][len(b"data: "):])["error"]["code"] == "engine_down"
        assert outcomes == ["broken"]

    run(body)


def test_unreachable_engine_lets_the_caller_answer(run, tmp_path: Path):
    async def body(client, engine, outcomes):
        (tmp_path / "run" / "engine.sock").unlink()
        async with client.get("http://gw/v1/stream") as response:
            assert response.status == 503
        assert outcomes == ["unreachable"]

    run(body)


def test_forwarded_headers_drop_fields_named_by_connection():
    from multidict import CIMultiDict

    headers = CIMultiDict([("Connection", "close, X-A"), ("Connection", "x-b"), ("X-A", "1"), ("X-B", "2"),
                           ("Keep-Alive", "timeout=5"), ("Host", "h"), ("Content-Length", "3"), ("Accept", "*/*")])
    assert list(forward.forwarded_headers(headers).items()) == [("Accept", "*/*")]


def test_upstream_connections_idle_longer_than_hostds_keepalive_are_dropped_before_upstream_drops_them(tmp_path: Path):
    """vLLM's and SGLang's uvicorn close a connection idle for 5 s; a POST
    sent on one as it closes fails as taken, which the gateway would count as
    the engine lost (forward.UPSTREAM_KEEPALIVE_S). A request after hostd's
    keep-alive and before upstream's goes out on a new connection."""
    assert forward.UPSTREAM_KEEPALIVE_S < 5

    async def main():
        peers: list[object] = []

        async def echo(request: web.Request) -> web.Response:
            if request.transport not in peers:
                peers.append(request.transport)
            return web.Response(body=await request.read())

        app = web.Application()
        app.router.add_post("/v1/echo", echo)
        runner = await start(app, tmp_path / "vllm.sock")
        session = forward.session(forward.upstream_connector(tmp_path / "vllm.sock"), 5)
        try:
            for pause in (0.0, 0.2, forward.UPSTREAM_KEEPALIVE_S + 0.8):
                await asyncio.sleep(pause)
                async with session.post("http://engine/v1/echo", data=b"{}") as response:
                    assert response.status == 200
            assert len(peers) == 2  # the second request reused the first connection, the third did not
        finally:
            await session.close()
            await runner.cleanup()

    asyncio.run(main())
