"""hostd gateway NAME: the model's front door (model@NAME.service).

One job: proxy the engine's public API from the public socket to the
engine's Unix socket without ever losing an admitted request, and without
letting a remote client reach anything else or hold more than its share.
Admission lives in state.py, the control socket in control.py (what its
requests do in controller.py), routing in
routes.py, resource bounds in limits.py, keys in keys.py, metrics in
metrics.py.

- Routing is on the decoded, normalized path (routes.py). /health and
  /metrics are the gateway's own; every other path must be one of the
  backend's public routes (hostd/backends/<backend>.py, public_routes) and is
  forwarded as normalized. Anything else is 404 (405 for a known path with
  another method) in OpenAI's error shape; the engine's internal endpoints
  are unreachable under any spelling.
- gateway.metrics_listen: a second address serving GET /metrics alone
  (metrics_listener.py): loopback with no key, or any address of the host
  with gateway.metrics_token's bearer token.
- With gateway.api_keys set, every request but GET /health needs
  `Authorization: Bearer KEY` (401 otherwise); the key stops here. Root
  replaces the keys through the control socket (`systemctl reload`: keys.py).
- A request's body is read first, within gateway.body_timeout (408) and the
  size (gateway.max_body_bytes, or the serving engine's smaller
  max_body_bytes from its /health), in-flight and per-client byte caps
  (413, 503), never inflated (a
  Content-Encoding is 415); only then is it admitted. Admitted
  only while the engine serves; otherwise 503 with Retry-After and an
  OpenAI-format error (or, with `gateway.admission: queue`, a wait of up to
  queue_timeout for serving).
- Responses, SSE streams included, pass through chunk by chunk (forward.py).
  A client that disconnects has its engine request closed, so the engine
  cancels it. An engine that dies mid-request ends that request with a clear
  error, and the gateway stops admitting until the engine is healthy again.
- The gateway learns that an engine died from an idle connection it holds
  to each engine socket (watch.py): its end, and a socket that then takes no
  connection, is the death, seen at once with no request in flight; a
  request that cannot reach the engine, and the health monitor (every
  HEALTH_INTERVAL), are the other two ways. A request whose connection
  closes before any answer goes once more to the same engine on a new
  connection first (once_more_if_closed: an engine that rebuilds in place
  closes its old runner's idle keep-alive connections).
- With a warm standby (`standby: true`: engine-standby.sock), an engine that
  dies costs new requests nothing: its death moves new requests to the
  standby, and a request of which the client had received nothing is sent
  there once instead of being answered 503, if the dead engine never took it
  or it is one that may run twice (retry.py: generation without tools).
  Requests whose answer had started fail as above. Once the dead engine's
  slot answers /health again (its unit restarted it and it is warm: an
  engine listens only then), new requests go back to it. A switch from the
  manager ends that failover.
- Connections are capped, in all and per client, and timed (limits.py): slow
  or oversized headers, idle keep-alive connections and clients that stop
  reading are closed; at a cap the longest-idle connection makes room, and
  only with none idle does the new one get 503 at once. A client's protocol
  errors log one debug line (logs.protocol_logger), never a traceback.

Trusts: nobody on the public socket. The engine socket and the control
socket are private (0600 in /run/hostd/NAME, 0700; see control.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Optional

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hostd import backends, forward, logs, paths, sockets, systemd
from hostd import config as hostd_config
from hostd.engine import health as engine_health
from hostd.engine.health import EngineHealth
from hostd.gateway import control, keys, limits, metrics_listener, retry, routes
from hostd.gateway.controller import Controller
from hostd.gateway.metrics import FirstToken, Metrics, ModelFacts, engine_families, numeric_fields
from hostd.gateway.slots import Slots
from hostd.gateway.state import HELD, Admission, State, refusal_message
from hostd.gateway.watch import EngineWatch

log = logging.getLogger("hostd.gateway")

HEALTH_INTERVAL = 0.5
ENGINE_METRICS_TIMEOUT = 5.0
CLIENT_CLOSED = "499"  # status label of a request whose client left before the end (nginx's code)


def dropped_headers(api_keys: Optional[list[bytes]]) -> frozenset[str]:
    """The request headers the engine never sees."""
    # The key was for the gateway. vLLM takes X-Request-Id as its own request
    # id: a client's choice could collide with another's (and aborts go by
    # id), so the engine sees only hostd's, one per request.
    return frozenset({"x-request-id"} | ({"authorization"} if api_keys is not None else set()))


def gateway_metrics(gateway: "Gateway") -> Metrics:
    """GATEWAY's Prometheus metrics, its gauges read from it when scraped."""
    a = gateway.admission
    return Metrics({
        "hostd_gateway_in_flight": ("Requests admitted and not finished", lambda: a.in_flight),
        "hostd_gateway_queued": ("Requests waiting for admission", lambda: a.queued),
        "hostd_gateway_connections": ("Open public connections",
                                      lambda: len(gateway.connections.open) if gateway.connections else 0),
        "hostd_gateway_body_bytes_held": ("Bytes of request bodies the gateway holds", lambda: gateway.budget.used),
    }, ModelFacts(gateway.name, gateway.cfg.backend, gateway.backend.upstream_package,
                  numeric_fields(msgspec.to_builtins(gateway.cfg.gateway)),
                  os.environ.get("HOSTD_GPUS", "")))  # the generator's, from NVML (hostd/generator.py)


async def once_more_if_closed(send: Callable[[], Awaitable[web.StreamResponse]], slot: str, method: str, path: str,
                              body: bytes) -> web.StreamResponse:
    """SEND()'s answer; when the engine's connection closed before an answer
    and the request was not taken or may run twice (retry.py), SEND() once
    more on a new connection before anyone calls the engine lost: an engine
    that replaced its runner (a rebuild in place) closes the old one's idle
    keep-alive connections, and one may close as a request is sent on it."""
    try:
        return await send()
    except forward.Unreachable as exc:
        if exc.taken and not retry.retried(method, path, body):
            raise
        log.info("engine connection lost before an answer (%s slot): %s; once more", slot, exc)
    return await send()


class Gateway:
    def __init__(self, name: str, cfg, engine_sockets: dict[str, Path], control_socket: Path,
                 api_keys: Optional[list[bytes]] = None, metrics_token: Optional[list[bytes]] = None):
        self.name = name
        self.cfg = cfg
        self.limits = cfg.gateway
        self.engine_sockets = engine_sockets  # slot -> socket (paths.ENGINE_SOCKETS)
        # Where new requests go (slots.py); set up once the metrics exist.
        self.slots = Slots(engine_sockets, self.engine_ok, on_failover=lambda: self.metrics.failovers.inc())
        self.sessions: dict[str, aiohttp.ClientSession] = {}  # each slot's engine socket: /health, /metrics
        self.upstream_sessions: dict[str, aiohttp.ClientSession] = {}  # public requests to vLLM's own socket
        # The engines' deaths, seen from a connection held to each (watch.py).
        self.watch = EngineWatch(engine_sockets, on_lost=self._engine_lost, on_up=self._engine_up)
        self.control_socket = control_socket
        self.backend = backends.for_config(cfg)
        self.routes = routes.Table(self.backend.public_routes)
        self.token_routes = frozenset(self.backend.token_routes)
        self.api_keys = api_keys
        self.metrics_token = metrics_token  # what a scrape of gateway.metrics_listen presents (metrics_listener.py)
        self.drop_headers = dropped_headers(api_keys)
        self.admission = Admission(cfg.gateway.admission, cfg.gateway.queue_timeout, cfg.gateway.queue_max)
        g = cfg.gateway
        # One client may always send one body of the largest size.
        self.budget = limits.BodyBudget(g.body_bytes_in_flight, max(g.body_bytes_per_client, g.max_body_bytes))
        self.body_caps = limits.EngineBodyCaps(g.max_body_bytes)  # and each engine's own, from its /health
        self.connections: Optional[limits.Connections] = None
        self.metrics = gateway_metrics(self)
        self._last_status = ""
        # The control socket's requests (drain, resume, switch, keys, ...) and the reload clock.
        self.controller = Controller(self)
        self.admission.on_change = self.controller.state_changed
        self.stream_error = {"message": f"model {name}'s engine stopped mid-stream",
                             "type": "engine_error", "code": "engine_down"}

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.dispatch)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    @property
    def engine_socket(self) -> Path:
        return self.engine_sockets[self.slots.current]

    async def _startup(self, app: web.Application) -> None:
        for slot, path in self.engine_sockets.items():
            self.sessions[slot] = forward.session(aiohttp.UnixConnector(path=str(path), limit=0), 5)
            upstream = self.backend.engine_socket(self.name, slot)  # vLLM's: one proxy less per token
            if upstream is not None:
                self.upstream_sessions[slot] = forward.session(forward.upstream_connector(upstream), 5)
        app["monitor"] = asyncio.create_task(self.monitor())
        self.watch.start()

    async def _cleanup(self, app: web.Application) -> None:
        app["monitor"].cancel()
        await self.watch.stop()
        for session in [*self.sessions.values(), *self.upstream_sessions.values()]:
            await session.close()

    # ------------------------------------------------------------ routing

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        if self.connections is not None:
            self.connections.started(request.transport)
        keep_alive = True
        try:
            response = await self._route(request)
            keep_alive = response.keep_alive is not False  # False: force_close(), the rest is not read
            return response
        finally:
            if self.connections is not None:
                self.connections.finished(request.transport, keep_alive)

    async def _route(self, request: web.Request) -> web.StreamResponse:
        try:
            path = routes.normalize(request.raw_path)
        except routes.BadPath as exc:
            return self.refuse(400, "invalid_request_error", "invalid_path", str(exc))
        if path == "/health" and request.method in ("GET", "HEAD"):
            return self.health()
        if self.api_keys is not None and not keys.authorized(self.api_keys, request.headers.get("Authorization")):
            return self.refuse(401, "invalid_request_error", "invalid_api_key",
                               "missing or wrong API key: send 'Authorization: Bearer KEY'",
                               {"WWW-Authenticate": 'Bearer realm="hostd"'})
        if path == "/metrics" and request.method in ("GET", "HEAD"):
            return await self.prometheus()
        route, allowed = self.routes.match(request.method, path)
        if route is None:
            if allowed:
                return self.refuse(405, "invalid_request_error", "method_not_allowed",
                                   f"{request.method} is not allowed on {path}; use {', '.join(allowed)}",
                                   {"Allow": ", ".join(allowed)})
            return self.refuse(404, "invalid_request_error", "not_found",
                               f"no route {path} on model {self.name} (docs/gateway.md lists the public routes)")
        return await self.proxy(request, path)

    def refuse(self, status: int, kind: str, code: str, message: str,
               headers: Optional[dict] = None) -> web.Response:
        self.metrics.refused.labels(str(status)).inc()
        return web.json_response(limits.error_body(message, kind, code), status=status, headers=headers)

    # ------------------------------------------------------------ gateway's own routes

    def health(self) -> web.Response:
        """Open to everyone: the state only (counters are on the key-protected /metrics)."""
        status = 200 if self.admission.state == State.SERVING else 503
        return web.json_response({"model": self.name, "state": self.admission.state.value}, status=status)

    async def prometheus(self) -> web.Response:
        engine_text, health = await asyncio.gather(self.engine_metrics(), self.engine_health())
        self.metrics.facts.update(health)
        self.metrics.set_state(self.admission.state.value, (s.value for s in State))
        body = self.metrics.exposition() + engine_text.encode()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def engine_health(self) -> Optional[EngineHealth]:
        """The serving engine's /health (its engine_config, weights and
        upstream_version: hostd_limit, hostd_weights_retained and
        hostd_build_info); None when it does not answer with one."""
        return (await read_health(self.sessions[self.slots.current], ENGINE_METRICS_TIMEOUT))[1]

    async def engine_metrics(self) -> str:
        """The engine's own families (backend.metrics_prefixes), '' when it does not answer."""
        try:
            async with self.sessions[self.slots.current].get(
                    "http://engine/metrics", timeout=aiohttp.ClientTimeout(total=ENGINE_METRICS_TIMEOUT)) as r:
                if r.status != 200:
                    return ""
                text = await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return ""
        return engine_families(text, self.backend.metrics_prefixes, self.name)

    # ------------------------------------------------------------ proxying

    def unavailable(self, reason: str) -> web.Response:
        self.metrics.rejected.labels(reason).inc()
        retry = self.cfg.gateway.retry_after
        body = limits.error_body(refusal_message(reason, self.name, retry),
                                 "service_unavailable", f"model_{reason.replace('-', '_')}")
        return web.json_response(body, status=503, headers={"Retry-After": str(retry)})

    async def proxy(self, request: web.Request, path: str) -> web.StreamResponse:
        g = self.limits
        encodings = request.headers.getall("Content-Encoding", [])
        if len(encodings) > 1 or any(e.strip().lower() != "identity" for e in encodings):
            # Inflating is work on the only event loop that a few bytes can
            # multiply (a "bomb"), and the engines take no encoded bodies.
            # Every field counts, not the first: a parser behind us may read the last.
            shown = ", ".join(repr(e) for e in encodings)
            response = self.refuse(415, "invalid_request_error", "unsupported_content_encoding",
                                   f"Content-Encoding {shown} is not accepted: send one body uncompressed, "
                                   "with no Content-Encoding field or one field 'identity'")
            response.force_close()  # the body is not read
            return response
        try:
            body = await limits.read_body(request, self.budget, self.body_caps.of(self.slots.current), g.body_timeout,
                                          self.connections)
        except limits.BodyRefused as exc:
            response = self.refuse(exc.status, "invalid_request_error", exc.code, str(exc),
                                   {"Retry-After": "1"} if exc.status == 503 else None)
            response.force_close()  # the rest of the body is not read
            return response
        try:
            return await self._admitted(request, path, body.data)
        finally:
            body.release()

    async def _admitted(self, request: web.Request, path: str, body: bytearray) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        refusal = await self.admission.admit()
        if self.admission.mode == "queue":
            self.metrics.admission_wait.observe(loop.time() - arrived)
        if refusal:
            return self.unavailable(refusal)
        self.metrics.admitted.inc()
        admitted = loop.time()
        status = CLIENT_CLOSED
        target = "http://engine" + routes.quoted(path)
        if request.rel_url.raw_query_string:
            target += "?" + request.rel_url.raw_query_string

        # Time to first token: the first SSE event that carries one, or a
        # whole 200 body, of a route that generates (backend.token_routes).
        tokens = (request.method, path) in self.token_routes
        scan: Optional[FirstToken] = None

        def first_byte(code: int, headers) -> None:
            nonlocal scan
            self.metrics.ttfb.labels(str(code)).observe(loop.time() - admitted)
            if tokens and code == 200 and forward.is_event_stream(headers):
                scan = FirstToken()

        def chunk(data: bytes) -> None:
            self._count_bytes(len(data))
            if scan is not None and scan.feed(data):
                self.metrics.first_token(True, loop.time() - admitted)

        slot = self.slots.current  # the engine this request goes to, whatever a switch does meanwhile
        self.admission.sent(slot)

        async def send() -> web.StreamResponse:
            return await forward.forward(
                self.upstream_sessions.get(slot, self.sessions[slot]), target, request, body, drop=self.drop_headers,
                add={"X-Request-Id": uuid.uuid4().hex},
                on_start=first_byte, on_chunk=chunk, stream_error=self.stream_error,
            )

        try:
            for attempt in range(2):
                try:
                    response = await once_more_if_closed(send, slot, request.method, path, body)
                    break
                except forward.Unreachable as exc:
                    log.warning("engine unreachable (%s slot): %s", slot, exc)
                    await self._engine_lost(slot)
                    if attempt or self.slots.current == slot or self.admission.state != State.SERVING or (
                            exc.taken and not retry.retried(request.method, path, body)):
                        status = "503"
                        return self.unavailable("engine-down")
                    # Failed over to the standby; the client has nothing of this
                    # request, and the dead engine took none of it or it may run twice.
                    self.admission.moved(slot, self.slots.current)
                    slot = self.slots.current
            gone = request.transport is None or request.transport.is_closing()
            status = CLIENT_CLOSED if gone else str(response.status)
            if tokens and status == "200" and not forward.is_event_stream(response.headers):
                self.metrics.first_token(False, loop.time() - admitted)  # the whole body: its tokens came at once
            return response
        except forward.Broken as exc:
            # The engine died mid-response: the client's library reports an
            # error; stop admitting new requests until it is healthy again.
            self.metrics.errors.inc()
            log.warning("engine failed mid-response (%s slot): %s", slot, exc)
            await self._engine_lost(slot)
            status = str(exc.response.status)
            return exc.response
        finally:
            self.metrics.duration.labels(status).observe(loop.time() - admitted)
            await self.admission.done(slot)

    async def _engine_lost(self, slot: str) -> None:
        """Stop admitting when the engine new requests go to is gone, unless
        the standby takes them (slots.fail_over); one that failed on the engine a
        switch left (an overlap reload restarting it) says nothing about the
        one that serves."""
        if slot == self.slots.current and not await self._fail_over(slot):
            await self.admission.engine_lost()

    async def _engine_up(self, slot: str) -> None:
        """SLOT's engine takes connections again (watch.py): end a failover from it now."""
        if self.slots.failed_over == slot and self.admission.state not in HELD and await self.slots.fail_back(
                self.admission.on_slot.get("standby", 0)):
            self.report()

    async def _fail_over(self, slot: str) -> bool:
        moved = await self.slots.fail_over(slot, held=self.admission.state in HELD)
        if moved:
            self.report()
        return moved

    def _count_bytes(self, n: int) -> None:
        self.admission.counters.proxied_bytes += n
        self.metrics.proxied_bytes.inc(n)

    # ------------------------------------------------------------ monitor

    async def engine_ok(self, slot: Optional[str] = None) -> bool:
        """Does SLOT's engine (the current one's by default) answer /health
        with 200? Its answer's max_body_bytes becomes that slot's body cap."""
        slot = slot or self.slots.current
        ok, health = await read_health(self.sessions[slot], 5)
        self.body_caps.heard(slot, health if ok else None)
        return ok

    async def monitor(self) -> None:
        while True:
            if self.admission.state not in HELD:
                healthy = await self.engine_ok()
                if not healthy and await self._fail_over(self.slots.current):
                    healthy = True
                await self.admission.engine_healthy(healthy)
                if self.slots.failed_over and healthy and await self.slots.fail_back(
                        self.admission.on_slot.get("standby", 0)):
                    self.report()
            self.report()
            await asyncio.sleep(HEALTH_INTERVAL)

    def report(self) -> None:
        a = self.admission
        text = f"{a.state.value}: {a.in_flight} in flight, {a.counters.admitted} admitted, {sum(a.counters.rejected.values())} rejected"
        text += self.slots.status_line()
        if text != self._last_status:
            self._last_status = text
            systemd.status(text)


async def read_health(session: aiohttp.ClientSession, timeout: float) -> tuple[bool, Optional[EngineHealth]]:
    """An engine's GET /health through SESSION: whether it answered 200, and
    its answer decoded under engine/health.py's cap (None: no answer, or not one)."""
    try:
        async with session.get("http://engine/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status == 200, engine_health.parse(await r.content.read(engine_health.MAX_BYTES + 1))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False, None


def listener_from_config(listen: str) -> socket.socket:
    """Bind the configured public address (used when not socket-activated)."""
    if listen.startswith("/"):
        return sockets.bind_public(Path(listen), backlog=1024)
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, int(port)), family=family, backlog=1024)


async def serve(gateway: Gateway, listener: socket.socket, stop_timeout: float,
                metrics: Optional[socket.socket] = None) -> None:
    # auto_decompress off: request bodies are never inflated (proxy() answers
    # an encoded one 415); a client's protocol errors log one line (logs.py).
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=gateway.limits.idle_timeout, auto_decompress=False,
                           logger=logs.protocol_logger(log), **limits.HEADER_LIMITS)
    await runner.setup()
    g = gateway.limits
    fd_limit = limits.raise_fd_limit()
    cap = limits.connection_cap(g.max_connections, fd_limit)
    if cap < g.max_connections:
        log.warning("gateway.max_connections %d lowered to %d: the file descriptor limit is %d "
                    "(raise LimitNOFILE= in model@.service)", g.max_connections, cap, fd_limit)
    refusal = limits.raw_response(
        503, "Service Unavailable",
        limits.error_body(f"model {gateway.name} has too many open connections ({cap}); retry",
                          "service_unavailable", "too_many_connections"),
        {"Retry-After": str(g.retry_after)})
    too_large = limits.raw_response(
        431, "Request Header Fields Too Large",
        limits.error_body(f"the request's headers are over {limits.MAX_HEADER_BYTES} bytes",
                          "invalid_request_error", "headers_too_large"), {})
    gateway.connections = limits.Connections(
        runner.server, max_connections=cap, per_client=g.max_connections_per_client,
        header_timeout=g.header_timeout, idle_timeout=g.idle_timeout, write_timeout=g.write_timeout,
        refusal=refusal, too_large=too_large, on_event=gateway.metrics.connection_event)
    listener.setblocking(False)
    public = await asyncio.get_running_loop().create_server(gateway.connections, sock=listener, backlog=1024)
    ctl_listener = sockets.bind_private(gateway.control_socket)
    ctl = await control.serve(ctl_listener, gateway.controller)
    scrape = metrics_listener.MetricsListener(gateway.name, gateway.prometheus, lambda: gateway.metrics_token, g, log)
    if metrics is not None:  # gateway.metrics_listen: GET /metrics, with gateway.metrics_token's bearer token if set
        await scrape.start(metrics)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s (at most %d connections); engine %s; control %s",
             listener.getsockname(), cap, gateway.engine_socket, gateway.control_socket)
    systemd.notify("READY=1", f"STATUS={gateway.admission.state.value}")
    await stop.wait()
    systemd.notify("STOPPING=1")
    log.info("stopping: draining %d in-flight request(s) for up to %.0f s", gateway.admission.in_flight, stop_timeout)
    public.close()  # no new connections; admitted requests finish
    gateway.connections.close()
    result = await gateway.admission.drain(stop_timeout)
    if not result.drained:
        log.warning("stopping with %d request(s) still running", result.remaining)
    ctl.close()
    await scrape.close()
    await runner.cleanup()
    sockets.release(ctl_listener)
    sockets.release(listener)
    if metrics is not None:
        sockets.release(metrics)


def run(args: argparse.Namespace) -> int:
    logs.setup(args.name, "gateway")
    root = hostd_config.config_root(args.config_dir)
    cfg = hostd_config.load_model(args.name, root).config
    logs.apply_level(hostd_config.load_daemon(root).log_level)  # hostd.yaml once more, at start only
    try:
        api_keys = keys.load(cfg.gateway.api_keys)
        metrics_token = keys.load(cfg.gateway.metrics_token, keys.METRICS_TOKEN)
    except keys.KeysError as exc:
        log.error("%s; refusing to serve model %s without its keys", exc, args.name)
        systemd.status(f"failed: {exc}")
        return 1
    main = Path(args.engine) if args.engine else paths.engine_socket(args.name)
    engine_sockets = {"main": main, "next": main.with_name(paths.ENGINE_SOCKETS["next"])}
    if getattr(cfg, "standby", False):
        engine_sockets["standby"] = main.with_name(paths.ENGINE_SOCKETS["standby"])
    control_socket = Path(args.control) if args.control else paths.control_socket(args.name)
    listener = sockets.acquire(args.listen or cfg.listen, bind=listener_from_config)
    try:
        metrics = (metrics_listener.bind(cfg.gateway.metrics_listen, listener_from_config)
                   if cfg.gateway.metrics_listen else None)
    except metrics_listener.MetricsListenError as exc:
        log.error("%s; refusing to serve model %s", exc, args.name)
        systemd.status(f"failed: {exc}")
        return 1
    gateway = Gateway(args.name, cfg, engine_sockets, control_socket, api_keys, metrics_token)
    # Leave a margin inside the unit's stop timeout for the process to exit.
    stop_timeout = max(1.0, cfg.timeouts.stop - 10.0)
    asyncio.run(serve(gateway, listener, stop_timeout, metrics))
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--listen", metavar="ADDRESS", help="public address when not socket-activated (default: the model's listen:)")
    parser.add_argument("--engine", metavar="PATH", help="engine socket (default /run/hostd/NAME/engine.sock; "
                        "the overlap slot's is engine-next.sock beside it; a vLLM model's public "
                        "requests go to vLLM's own socket, /run/hostd/NAME/vllm-engine.sock, wherever this is)")
    parser.add_argument("--control", metavar="PATH", help="control socket (default /run/hostd/NAME/control.sock)")
