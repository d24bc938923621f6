"""The gateway's metrics listener (gateway.metrics_listen): GET /metrics, with no API key.

One job: serve the public /metrics' content (Gateway.prometheus) on a second
address so that Prometheus needs no client key; nothing else is served there
(404 for every other path, 405 for another method on /metrics), so the key
check of the public socket is not needed here and nothing can be proxied.

Trusts: whoever can reach the address when no token is set, and for that the
config allows only loopback TCP or a Unix socket path (config/values.py,
metrics_listen_problem): local users may read the metrics, as they may with
`hostctl status`. With gateway.metrics_token (a fleet's central Prometheus,
`authorization: credentials_file`) the address may be any of the host's, and
every request must present one of that file's tokens as a bearer token (401
otherwise, before its path is looked at), compared as the API keys are
(keys.authorized). Its connections are capped (MAX_CONNECTIONS) and timed as
the public ones are, so a client that opens many holds only this listener,
never the public one.

The gateway binds it itself at start (bind()), not systemd: model@NAME.socket
would start the whole model on a scrape, and its addresses cannot change while
it runs (hostd/generator.py); this listener follows the gateway, so a changed
address takes effect at the gateway's next start.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Awaitable, Callable, Optional

from aiohttp import web

from hostd import logs
from hostd.gateway import keys, limits

MAX_CONNECTIONS = 16  # Prometheus holds one; a few more for people with curl


class MetricsListenError(Exception):
    """gateway.metrics_listen cannot be listened on."""


def bind(address: str, bind_address: Callable[[str], socket.socket]) -> socket.socket:
    """BIND_ADDRESS(ADDRESS) (the gateway's own binder), its failure naming the key."""
    try:
        return bind_address(address)
    except OSError as exc:
        raise MetricsListenError(
            f"gateway.metrics_listen {address!r}: cannot listen there: {exc}; free the address or "
            "choose another (a Unix socket's directory must exist and be writable by the model's user)") from None


class MetricsListener:
    """The running listener: start() once, close() at the gateway's stop."""

    def __init__(self, model: str, prometheus: Callable[[], Awaitable[web.StreamResponse]],
                 token: Callable[[], Optional[list[bytes]]], gateway_limits, log) -> None:
        self.model = model
        self.prometheus = prometheus
        self.token = token  # the gateway's metrics tokens now (a reload replaces them); None: no check
        self.limits = gateway_limits
        self.log = log
        self.runner: web.AppRunner | None = None
        self.server: asyncio.AbstractServer | None = None
        self.connections: limits.Connections | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.connections.started(request.transport)
        try:
            token = self.token()
            if token is not None and not keys.authorized(token, request.headers.get("Authorization")):
                return web.json_response(limits.error_body(
                    f"the metrics listener of model {self.model} needs a token (gateway.metrics_token): "
                    "send 'Authorization: Bearer TOKEN'", "invalid_request_error", "invalid_api_key"),
                    status=401, headers={"WWW-Authenticate": 'Bearer realm="hostd-metrics"'})
            if request.path != "/metrics":
                return web.json_response(limits.error_body(
                    f"the metrics listener of model {self.model} serves only GET /metrics",
                    "invalid_request_error", "not_found"), status=404)
            if request.method not in ("GET", "HEAD"):
                return web.json_response(limits.error_body(
                    f"{request.method} is not allowed on /metrics; use GET", "invalid_request_error",
                    "method_not_allowed"), status=405, headers={"Allow": "GET, HEAD"})
            return await self.prometheus()
        finally:
            self.connections.finished(request.transport)

    async def start(self, listener: socket.socket) -> None:
        app = web.Application(client_max_size=1024)  # no request here has a body
        app.router.add_route("*", "/{tail:.*}", self.handle)
        g = self.limits
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    keepalive_timeout=g.idle_timeout, auto_decompress=False,
                                    logger=logs.protocol_logger(self.log), **limits.HEADER_LIMITS)
        await self.runner.setup()
        refusal = limits.raw_response(
            503, "Service Unavailable",
            limits.error_body(f"the metrics listener of model {self.model} has too many open connections "
                              f"({MAX_CONNECTIONS}); retry", "service_unavailable", "too_many_connections"),
            {"Retry-After": "1"})
        self.connections = limits.Connections(
            self.runner.server, max_connections=MAX_CONNECTIONS, header_timeout=g.header_timeout,
            idle_timeout=g.idle_timeout, write_timeout=g.write_timeout, refusal=refusal)
        listener.setblocking(False)
        self.server = await asyncio.get_running_loop().create_server(self.connections, sock=listener)
        self.log.info("metrics listener on %s (GET /metrics, %s)", listener.getsockname(),
                      "no key" if self.token() is None else "bearer token of gateway.metrics_token")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.connections is not None:
            self.connections.close()
        if self.runner is not None:
            await self.runner.cleanup()
