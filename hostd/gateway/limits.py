"""Bounds on what the public side of the gateway may hold.

One job: keep any number of remote clients, slow or silent, from exhausting
the gateway's memory, file descriptors or drains. Two pieces:

- Connections (Connections, wrapping aiohttp's protocol factory): at most
  max_connections open at once; one more is answered at once with a complete
  503 (JSON body, Connection: close) and closed, without reading from it. A
  connection must finish its request headers within header_timeout of
  connecting or of sending the first byte of its next request, and an idle
  keep-alive connection is closed after idle_timeout; a request in progress
  (body read, admitted, streaming) has no time limit here. Deadlines are a
  float per connection checked by one sweep a second (SWEEP_SECONDS), not a
  timer per request: a request costs two assignments, not two heap pushes.
- Request bodies (BodyBudget, read_body): a body larger than max_body_bytes
  is refused with 413; the bytes of bodies held by the gateway, across all
  connections, stay under body_bytes_in_flight (a body that does not fit gets
  503 at once, before its bytes are read when Content-Length announces them);
  a body that does not arrive within body_timeout gets 408. The gateway admits
  a request (counts it in flight, makes a drain wait for it) only after its
  body has arrived, so a slow sender never holds up a reload.

The control socket is another listener on the same event loop with its own
fds: none of these bounds apply to it, and the connection cap keeps the
public side well below the process's file descriptor limit so that the
control socket can always accept.
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Callable, Optional

from aiohttp import web

FD_RESERVE = 64  # descriptors kept for the engine pool, the control socket, logs
LINGER_SECONDS = 1.0  # how long a refused connection is read (and discarded) before closing
LINGER_MAX = 32  # refused connections lingering at once; beyond, they are closed at once
SWEEP_SECONDS = 1.0  # how often deadlines are checked: a timeout fires up to this much late


def raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard one (no privilege needed);
    return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(configured: int, fd_limit: int) -> int:
    """CONFIGURED, lowered so that the public side leaves FD_RESERVE descriptors
    (each connection costs one on the client side and, while it runs a
    request, one to the engine)."""
    return max(1, min(configured, (fd_limit - FD_RESERVE - LINGER_MAX) // 2))


def error_body(message: str, kind: str, code: str) -> dict:
    """OpenAI's error JSON shape."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def raw_response(status: int, reason: str, body: dict, headers: dict[str, str]) -> bytes:
    """A complete HTTP/1.1 response, written without aiohttp (for refusals made
    before a request is parsed)."""
    payload = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json",
             f"Content-Length: {len(payload)}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


class Connections:
    """A protocol factory for loop.create_server that bounds aiohttp's connections."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], *, max_connections: int,
                 header_timeout: float, idle_timeout: float, refusal: bytes,
                 on_event: Callable[[str], None] = lambda event: None):
        """ON_EVENT is told "refused", "headers" or "idle" (a connection closed
        for slow headers or idleness)."""
        self.factory = factory
        self.on_event = on_event
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.refusal = refusal
        self.open: dict[asyncio.BaseTransport, "_Guarded"] = {}
        self.lingering = 0  # refused connections not closed yet
        self._sweeper: Optional[asyncio.Task] = None

    def __call__(self) -> asyncio.Protocol:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return _Guarded(self)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_SECONDS)
            now = loop.time()
            for conn in [c for c in self.open.values() if c.deadline <= now]:
                conn.expire()

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def started(self, transport: Optional[asyncio.BaseTransport]) -> None:
        """A request's headers have arrived (called by the handler)."""
        conn = self.open.get(transport) if transport is not None else None
        if conn is not None:
            conn.set_phase("active")

    def finished(self, transport: Optional[asyncio.BaseTransport]) -> None:
        """The handler returned; the connection waits for its next request."""
        conn = self.open.get(transport) if transport is not None else None
        if conn is not None:
            conn.set_phase("idle")


class _Guarded(asyncio.Protocol):
    """aiohttp's RequestHandler behind a cap and two deadlines."""

    def __init__(self, guard: Connections):
        self.guard = guard
        self.inner: Optional[asyncio.Protocol] = None
        self.transport: Optional[asyncio.Transport] = None
        self.phase = "headers"
        self.deadline = float("inf")
        self.timer: Optional[asyncio.TimerHandle] = None  # a refused connection's lingering close

    def connection_made(self, transport) -> None:
        self.transport = transport
        if len(self.guard.open) >= self.guard.max_connections:
            self._refuse(transport)
            return
        self.guard.open[transport] = self
        self.inner = self.guard.factory()
        self.inner.connection_made(transport)
        self.set_phase("headers")

    def _refuse(self, transport) -> None:
        # Answer, stop writing, and read (discarding) for a moment before
        # closing: closing a socket with the client's request unread sends a
        # TCP reset that can destroy the answer before the client reads it.
        self.guard.on_event("refused")
        transport.write(self.guard.refusal)
        if self.guard.lingering >= LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        self.guard.lingering += 1
        self.phase = "refused"
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if phase == "active":
            self.deadline = float("inf")
        else:
            timeout = self.guard.header_timeout if phase == "headers" else self.guard.idle_timeout
            self.deadline = asyncio.get_running_loop().time() + timeout

    def expire(self) -> None:
        self.deadline = float("inf")
        if self.transport is not None and not self.transport.is_closing():
            self.guard.on_event(self.phase)
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.phase == "idle":
            self.set_phase("headers")
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received() if self.inner is not None else False  # False: close

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.phase == "refused":
            self.guard.lingering -= 1
        if self.inner is None:
            return
        self.guard.open.pop(self.transport, None)
        self.inner.connection_lost(exc)


class BodyRefused(Exception):
    """The request body was refused; STATUS and the OpenAI error say why."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


class BodyBudget:
    """Bytes of request bodies the gateway holds, across all connections."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Body:
    """One request's body and the budget it holds until release()."""

    def __init__(self, budget: BodyBudget):
        self.budget = budget
        self.held = 0
        self.data = bytearray()

    def _hold(self, n: int) -> None:
        if n > self.held:
            if not self.budget.take(n - self.held):
                raise BodyRefused(
                    503, "too_many_bodies",
                    f"the gateway holds {self.budget.limit} bytes of request bodies at most and is full; retry",
                )
            self.held = n

    def add(self, chunk: bytes, max_bytes: int) -> None:
        """Append CHUNK, within MAX_BYTES and the budget (BodyRefused otherwise)."""
        size = len(self.data) + len(chunk)
        if size > max_bytes:
            raise BodyRefused(413, "body_too_large", f"the request body is over {max_bytes} bytes")
        self._hold(size)
        self.data += chunk

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0
        self.data = bytearray()


async def read_body(request: web.Request, budget: BodyBudget, max_bytes: int, timeout: float) -> Body:
    """REQUEST's whole body within TIMEOUT, holding budget for it; BodyRefused
    (413, 503 or 408) otherwise. The caller releases the returned Body."""
    body = Body(budget)
    if not request.body_exists:
        return body
    length = request.content_length
    try:
        if length is not None:
            if length > max_bytes:
                raise BodyRefused(413, "body_too_large",
                                  f"the request body is {length} bytes; at most {max_bytes} are accepted")
            body._hold(length)
        if request.content.is_eof():
            # The whole body came with the headers (most API calls): take it
            # without arming a deadline, which costs a timer per request.
            body.add(request.content.read_nowait(-1), max_bytes)
            return body
        try:
            async with asyncio.timeout(timeout):
                while chunk := await request.content.readany():
                    body.add(chunk, max_bytes)
        except TimeoutError:
            raise BodyRefused(408, "body_timeout",
                              f"the request body did not arrive within {timeout:g} s") from None
    except BaseException:
        body.release()
        raise
    return body
