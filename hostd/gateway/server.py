"""hostd gateway NAME: the model's front door (model@NAME.service).

One job: proxy the OpenAI API from the public socket to the engine's Unix
socket without ever losing an admitted request. Admission lives in state.py,
the control socket in control.py.

- Requests are admitted only while the engine serves; otherwise they get 503,
  a Retry-After header and an OpenAI-format error (or, with
  `gateway.admission: queue`, wait up to queue_timeout for serving).
- Responses, SSE streams included, pass through chunk by chunk. A client that
  disconnects has its upstream request closed, so the engine cancels it.
- An engine that dies mid-request ends that request with a clear error (an
  SSE error event on streams), and the gateway stops admitting until the
  engine is healthy again; the gateway itself keeps running.
- /health answers 200 only while serving; /metrics is Prometheus text.

Trusts: nobody on the public socket (bodies are capped, paths are passed
through as they are to the engine, which is the gateway's own peer); the
control socket is private (see control.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from pathlib import Path
from typing import Optional

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hostd import forward, paths, sockets, systemd
from hostd import config as hostd_config
from hostd.gateway import control
from hostd.gateway.state import HELD, Admission, State

log = logging.getLogger("hostd.gateway")

MAX_BODY = 32 << 20
HEALTH_INTERVAL = 0.5


class Metrics:
    def __init__(self, admission: Admission):
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("hostd_gateway_in_flight", "Requests admitted and not finished", registry=r).set_function(
            lambda: admission.in_flight
        )
        Gauge("hostd_gateway_queued", "Requests waiting for admission", registry=r).set_function(
            lambda: admission.queued
        )
        self.admitted = Counter("hostd_gateway_admitted", "Requests admitted", registry=r)
        self.rejected = Counter("hostd_gateway_rejected", "Requests answered 503", ["reason"], registry=r)
        self.proxied_bytes = Counter("hostd_gateway_proxied_bytes", "Response bytes passed to clients", registry=r)
        self.drains = Counter("hostd_gateway_drains", "Drains requested", registry=r)
        self.state = Gauge("hostd_gateway_state", "1 for the current state", ["state"], registry=r)
        self.errors = Counter("hostd_gateway_upstream_errors", "Requests the engine failed mid-way", registry=r)

    def set_state(self, state: State) -> None:
        for s in State:
            self.state.labels(s.value).set(1 if s == state else 0)


class Gateway:
    def __init__(self, name: str, cfg, engine_sockets: dict[str, Path], control_socket: Path):
        self.name = name
        self.cfg = cfg
        self.engine_sockets = engine_sockets  # slot -> socket (paths.ENGINE_SOCKETS)
        self.slot = "main"  # where new requests go; `switch` moves it
        self.sessions: dict[str, aiohttp.ClientSession] = {}
        self.control_socket = control_socket
        self.admission = Admission(cfg.gateway.admission, cfg.gateway.queue_timeout, cfg.gateway.queue_max)
        self.metrics = Metrics(self.admission)
        self._last_status = ""
        self.stream_error = {"message": f"model {name}'s engine stopped mid-stream",
                             "type": "engine_error", "code": "engine_down"}

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_route("*", "/v1/{tail:.*}", self.proxy)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    @property
    def engine_socket(self) -> Path:
        return self.engine_sockets[self.slot]

    @property
    def session(self) -> Optional[aiohttp.ClientSession]:
        """The serving slot's session. A request keeps the session it started
        on, so a switch never moves a running request."""
        return self.sessions.get(self.slot)

    async def _startup(self, app: web.Application) -> None:
        for slot, path in self.engine_sockets.items():
            self.sessions[slot] = forward.session(aiohttp.UnixConnector(path=str(path), limit=0), 5)
        app["monitor"] = asyncio.create_task(self.monitor())

    async def _cleanup(self, app: web.Application) -> None:
        app["monitor"].cancel()
        for session in self.sessions.values():
            await session.close()

    # ------------------------------------------------------------ handlers

    async def health(self, request: web.Request) -> web.Response:
        snapshot = self.admission.snapshot()
        status = 200 if self.admission.state == State.SERVING else 503
        return web.json_response({"model": self.name, **snapshot}, status=status)

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.set_state(self.admission.state)
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def unavailable(self, reason: str) -> web.Response:
        self.metrics.rejected.labels(reason).inc()
        retry = self.cfg.gateway.retry_after
        messages = {
            "draining": f"model {self.name} is reloading; retry after {retry} s",
            "paused": f"model {self.name} is reloading; retry after {retry} s",
            "starting": f"model {self.name} is starting; retry after {retry} s",
            "engine-down": f"model {self.name}'s engine is not running; retry after {retry} s",
            "queue-full": f"model {self.name} has too many waiting requests; retry after {retry} s",
            "queue-timeout": f"model {self.name} did not become available in time; retry after {retry} s",
        }
        body = {
            "error": {
                "message": messages.get(reason, f"model {self.name} is unavailable ({reason})"),
                "type": "service_unavailable",
                "param": None,
                "code": f"model_{reason.replace('-', '_')}",
            }
        }
        return web.json_response(body, status=503, headers={"Retry-After": str(retry)})

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        refusal = await self.admission.admit()
        if refusal:
            return self.unavailable(refusal)
        self.metrics.admitted.inc()
        self._report()
        try:
            return await self._forward(request)
        finally:
            await self.admission.done()
            self._report()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session
        body = await request.read()
        try:
            return await forward.forward(
                self.session, f"http://engine{request.rel_url}", request, body,
                on_chunk=self._count_bytes, stream_error=self.stream_error,
            )
        except forward.Unreachable as exc:
            log.warning("engine unreachable: %s", exc)
            await self.admission.engine_lost()
            return self.unavailable("engine-down")
        except forward.Broken as exc:
            # The engine died mid-response: the client's library reports an
            # error; stop admitting new requests until it is healthy again.
            self.metrics.errors.inc()
            log.warning("engine failed mid-response: %s", exc)
            await self.admission.engine_lost()
            return exc.response

    def _count_bytes(self, n: int) -> None:
        self.admission.counters.proxied_bytes += n
        self.metrics.proxied_bytes.inc(n)

    # ------------------------------------------------------------ monitor

    async def engine_ok(self, slot: Optional[str] = None) -> bool:
        session = self.sessions[slot or self.slot]
        try:
            async with session.get("http://engine/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def monitor(self) -> None:
        while True:
            if self.admission.state not in HELD:
                await self.admission.engine_healthy(await self.engine_ok())
            self._report()
            await asyncio.sleep(HEALTH_INTERVAL)

    def _report(self) -> None:
        a = self.admission
        text = f"{a.state.value}: {a.in_flight} in flight, {a.counters.admitted} admitted, {sum(a.counters.rejected.values())} rejected"
        if text != self._last_status:
            self._last_status = text
            systemd.status(text)

    # ------------------------------------------------------------ control

    async def control(self, request: control.Request) -> dict:
        if isinstance(request, control.Drain):
            self.metrics.drains.inc()
            log.info("drain requested (timeout %.1f s), %d in flight", request.timeout, self.admission.in_flight)
            result = await self.admission.drain(request.timeout)
            log.info("drain %s", "complete" if result["drained"] else f"timed out, {result['remaining']} still running")
        elif isinstance(request, control.Resume):
            result = await self.admission.resume(await self.engine_ok())
            log.info("resumed: %s", result["state"])
        elif isinstance(request, control.Switch):
            result = {**await self.switch(request.slot), "slot": self.slot}
        else:
            result = {**self.admission.snapshot(), "slot": self.slot}
        self._report()
        return result

    async def switch(self, slot: str) -> dict:
        """New requests go to SLOT's engine from now on (an overlap reload);
        running ones finish where they are. Refused while that engine does
        not answer /health, so a switch never sends traffic into the void."""
        if slot != self.slot:
            if not await self.engine_ok(slot):
                raise control.ControlError(
                    f"the engine in slot {slot} ({self.engine_sockets[slot]}) does not answer /health; not switching"
                )
            log.info("switch: new requests go to the %s engine (%s); %d in flight stay where they are",
                     slot, self.engine_sockets[slot], self.admission.in_flight)
            self.slot = slot
        return self.admission.snapshot()


def listener_from_config(listen: str) -> socket.socket:
    """Bind the configured public address (used when not socket-activated)."""
    if listen.startswith("/"):
        return sockets.bind_public(Path(listen), backlog=1024)
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(port)), family=family, backlog=1024)


async def serve(gateway: Gateway, listener: socket.socket, stop_timeout: float) -> None:
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    listener.setblocking(False)
    site = web.SockSite(runner, listener, shutdown_timeout=stop_timeout)
    await site.start()
    ctl_listener = sockets.bind_private(gateway.control_socket)
    ctl = await control.serve(ctl_listener, gateway.control)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s; engine %s; control %s", listener.getsockname(), gateway.engine_socket, gateway.control_socket)
    systemd.notify("READY=1", f"STATUS={gateway.admission.state.value}")
    await stop.wait()
    systemd.notify("STOPPING=1")
    log.info("stopping: draining %d in-flight request(s) for up to %.0f s", gateway.admission.in_flight, stop_timeout)
    result = await gateway.admission.drain(stop_timeout)
    if not result["drained"]:
        log.warning("stopping with %d request(s) still running", result["remaining"])
    ctl.close()
    await runner.cleanup()
    sockets.release(ctl_listener)
    sockets.release(listener)


def run(args: argparse.Namespace) -> int:
    from hostd import logs

    logs.setup(args.name, "gateway")
    cfg = hostd_config.load_model(args.name, hostd_config.config_root(args.config_dir)).config
    main = Path(args.engine) if args.engine else paths.engine_socket(args.name)
    engine_sockets = {"main": main, "next": main.with_name(paths.ENGINE_SOCKETS["next"])}
    control_socket = Path(args.control) if args.control else paths.control_socket(args.name)
    passed = systemd.listen_sockets()
    listener = passed[0] if passed else listener_from_config(args.listen or cfg.listen)
    gateway = Gateway(args.name, cfg, engine_sockets, control_socket)
    # Leave a margin inside the unit's stop timeout for the process to exit.
    stop_timeout = max(1.0, cfg.timeouts.stop - 10.0)
    asyncio.run(serve(gateway, listener, stop_timeout))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--listen", metavar="ADDRESS", help="public address when not socket-activated (default: the model's listen:)")
    parser.add_argument("--engine", metavar="PATH", help="engine socket (default /run/hostd/NAME/engine.sock; "
                        "the overlap slot's is engine-next.sock beside it)")
    parser.add_argument("--control", metavar="PATH", help="control socket (default /run/hostd/NAME/control.sock)")
