"""Bounds on what the public side of the gateway may hold.

One job: keep any number of remote clients, slow or silent, from exhausting
the gateway's memory, file descriptors or drains, and keep any one client
(client_of: a source address, an IPv6 /64, or a Unix socket peer's uid) from
holding more than its share. Every bound is charged for what a client really
holds or has sent, never for what it announced. Three pieces:

- Connections (Connections, wrapping aiohttp's protocol factory): at most
  max_connections open at once, at most per_client of them from one client.
  A connection over either cap first makes room by closing the longest-idle
  keep-alive connection (of that client, for its own cap); at the total cap,
  when none is idle, the connection that has been sending an unfinished
  request head the longest is closed instead (heads renewed every
  header_timeout from many addresses would otherwise keep everyone out, and a
  client that sends its head at once is never in that phase for long); only
  when neither is found is it answered at once with a complete 503 (JSON body, Connection:
  close) and closed, without reading from it. A connection must finish its
  request headers within header_timeout of connecting or of sending the first
  byte of its next request, in at most MAX_HEADER_BYTES (431 otherwise), and
  an idle keep-alive connection is closed after idle_timeout. A request in
  progress has no time limit here but one: a client that accepts no byte of
  its response for write_timeout while the gateway's write buffer is full is
  cut off (abort: its unsent bytes are dropped), which ends its request, so a
  drain never waits on a client that stopped reading. Deadlines are floats per
  connection checked by one sweep a second (SWEEP_SECONDS), not a timer per
  request: a request costs two assignments, not two heap pushes.
- Request headers: aiohttp's own limits (HEADER_LIMITS: line, field and count)
  within the byte cap above.
- Request bodies (BodyBudget, read_body): a body larger than max_body_bytes
  (announced or sent) is refused with 413; the bytes of bodies the gateway
  holds, counted as they arrive, stay under body_bytes_in_flight across all
  connections and under per_client for one client (the byte that would go
  over gets 503); a body that does not arrive within body_timeout gets 408.
  The gateway admits a request (counts it in flight, makes a drain wait for
  it) only after its body has arrived, so a slow sender never holds up a
  reload.

The control socket is another listener on the same event loop with its own
fds: none of these bounds apply to it, and the connection cap keeps the
public side well below the process's file descriptor limit so that the
control socket can always accept.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import resource
import socket
import struct
from typing import Callable, Optional

from aiohttp import web

FD_RESERVE = 64  # descriptors kept for the engine pool, the control socket, logs
LINGER_SECONDS = 1.0  # how long a refused connection is read (and discarded) before closing
LINGER_MAX = 32  # refused connections lingering at once; beyond, they are closed at once
SWEEP_SECONDS = 1.0  # how often deadlines are checked: a timeout fires up to this much late
# A request's line and header fields, all of them, in at most this many bytes
# (nginx's large_client_header_buffers default is 4 x 8 KiB): aiohttp's own
# limits alone let one unfinished request hold ~1 MiB (128 fields of 8 KiB).
MAX_HEADER_BYTES = 64 << 10
# aiohttp's per-line limits, stated rather than inherited: a request line or
# one field over 8190 bytes, or more than 100 fields, is answered 400.
HEADER_LIMITS = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 100}
IPV6_PREFIX = 64  # one IPv6 client is its /64: a host gets a /64 and picks addresses in it freely


def client_of(transport: asyncio.BaseTransport) -> str:
    """Who is on the other end, for per-client shares: an IPv4 address, an
    IPv6 /64 (IPv4-mapped addresses as IPv4), or for a Unix socket the peer's
    uid (SO_PEERCRED); '' when the kernel does not say."""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        try:
            address = ipaddress.ip_address(peer[0].split("%", 1)[0])
        except ValueError:
            return str(peer[0])
        if isinstance(address, ipaddress.IPv6Address):
            if address.ipv4_mapped is not None:
                return str(address.ipv4_mapped)
            return str(ipaddress.ip_network(f"{address}/{IPV6_PREFIX}", strict=False))
        return str(address)
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return f"uid {struct.unpack('3i', creds)[1]}"
        except OSError:
            pass
    return ""


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
                 per_client: Optional[int] = None, write_timeout: float = float("inf"),
                 too_large: bytes = b"", on_event: Callable[[str], None] = lambda event: None):
        """ON_EVENT is told "refused", "evicted" (an idle connection, one in
        an unfinished head or the slowest body closed to make room), or the
        phase of a connection closed for its deadline: "headers" (slow or oversized headers), "idle", "write" (its client
        stopped reading). TOO_LARGE answers headers over MAX_HEADER_BYTES."""
        self.factory = factory
        self.on_event = on_event
        self.max_connections = max_connections
        self.per_client = min(per_client or max_connections, max_connections)
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.write_timeout = write_timeout
        self.refusal = refusal
        self.too_large = too_large
        self.open: dict[asyncio.BaseTransport, "_Guarded"] = {}
        self.idle: dict["_Guarded", None] = {}  # idle keep-alive connections, longest idle first
        self.heads: dict["_Guarded", None] = {}  # connections in an unfinished request head, oldest first
        self.bodies: dict["_Guarded", None] = {}  # connections whose request body is being read
        self.clients: dict[str, int] = {}  # open connections per client
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
            for conn in [c for c in self.open.values() if c.write_deadline <= now]:
                conn.write_stalled(now)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    def admit(self, conn: "_Guarded") -> bool:
        """Make room for CONN (a new connection) within both caps, closing
        the longest-idle connection where one is over, else the oldest in an
        unfinished head, else the one reading its body the slowest (a
        trickler holds a connection until body_timeout otherwise); False
        when none is either (every connection is in an admitted request)."""
        if self.clients.get(conn.client, 0) >= self.per_client:
            victim = next((c for c in self.idle if c.client == conn.client), None)
            if victim is None:
                return False
            victim.evict()
        if len(self.open) >= self.max_connections:
            victim = next(iter(self.idle), None)
            if victim is None:
                victim = next(iter(self.heads), None)
            if victim is None:
                victim = self.slowest_body()
            if victim is None:
                return False
            victim.evict()
        self.open[conn.transport] = conn
        self.clients[conn.client] = self.clients.get(conn.client, 0) + 1
        return True

    def slowest_body(self) -> Optional["_Guarded"]:
        """The connection reading its request body at the lowest rate so far."""
        now = asyncio.get_running_loop().time()
        return min(self.bodies, key=lambda c: c.body_bytes / max(now - c.body_since, 1e-3), default=None)

    def forget(self, conn: "_Guarded") -> None:
        if self.open.pop(conn.transport, None) is None:
            return
        self.idle.pop(conn, None)
        self.heads.pop(conn, None)
        self.bodies.pop(conn, None)
        left = self.clients[conn.client] - 1
        if left:
            self.clients[conn.client] = left
        else:
            del self.clients[conn.client]

    def client(self, transport: Optional[asyncio.BaseTransport]) -> str:
        """The client (client_of) on TRANSPORT's end."""
        conn = self.open.get(transport) if transport is not None else None
        return conn.client if conn is not None else ""

    def started(self, transport: Optional[asyncio.BaseTransport]) -> None:
        """A request's headers have arrived (called by the handler), or its
        body has (after reading_body)."""
        conn = self.open.get(transport) if transport is not None else None
        if conn is not None:
            conn.set_phase("active")

    def reading_body(self, transport: Optional[asyncio.BaseTransport]) -> None:
        """The handler reads the request's body from here (read_body, within
        body_timeout) until it calls started again: till then the connection
        may be evicted for a new one, the slowest first."""
        conn = self.open.get(transport) if transport is not None else None
        if conn is not None:
            conn.set_phase("body")

    def finished(self, transport: Optional[asyncio.BaseTransport], keep_alive: bool = True) -> None:
        """The handler returned; the connection waits for its next request,
        or (not KEEP_ALIVE) for aiohttp to close it after the answer: what
        still arrives then (the unread rest of a refused body) is no request."""
        conn = self.open.get(transport) if transport is not None else None
        if conn is not None:
            conn.set_phase("idle" if keep_alive else "closing")


class _Guarded(asyncio.Protocol):
    """aiohttp's RequestHandler behind two caps and three deadlines."""

    def __init__(self, guard: Connections):
        self.guard = guard
        self.inner: Optional[asyncio.Protocol] = None
        self.transport: Optional[asyncio.Transport] = None
        self.client = ""
        self.phase = "headers"
        self.deadline = float("inf")
        self.header_bytes = 0  # bytes of this request's head so far (phase headers)
        self.tail = b""  # the last bytes seen in phase headers, to find a head's end across reads
        self.write_deadline = float("inf")  # set while the write buffer is full
        self.write_backlog = 0  # bytes buffered when that deadline was set
        self.timer: Optional[asyncio.TimerHandle] = None  # a refused connection's lingering close
        self.body_bytes, self.body_since = 0, 0.0  # phase body: bytes received since when

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.client = client_of(transport)
        if not self.guard.admit(self):
            self._refuse(transport, self.guard.refusal, "refused")
            return
        self.inner = self.guard.factory()
        self.inner.connection_made(transport)
        self.set_phase("headers")

    def _refuse(self, transport, answer: bytes, event: str) -> None:
        # Answer, stop writing, and read (discarding) for a moment before
        # closing: closing a socket with the client's request unread sends a
        # TCP reset that can destroy the answer before the client reads it.
        self.guard.on_event(event)
        transport.write(answer)
        if self.guard.lingering >= LINGER_MAX or not transport.can_write_eof():
            transport.close()
            return
        self.guard.lingering += 1
        self.phase = "refused"
        transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)

    def set_phase(self, phase: str) -> None:
        self.guard.idle.pop(self, None)
        self.guard.heads.pop(self, None)
        self.guard.bodies.pop(self, None)
        self.phase = phase
        if phase in ("active", "body"):
            self.deadline = float("inf")  # a body's own deadline is read_body's body_timeout
            if phase == "body":
                self.guard.bodies[self] = None
                self.body_bytes, self.body_since = 0, asyncio.get_running_loop().time()
            return
        if phase == "idle":
            self.guard.idle[self] = None
        elif phase == "headers":
            self.guard.heads[self] = None
            self.header_bytes, self.tail = 0, b""
        timeout = self.guard.idle_timeout if phase == "idle" else self.guard.header_timeout
        self.deadline = asyncio.get_running_loop().time() + timeout

    def expire(self) -> None:
        self.deadline = float("inf")
        if self.transport is not None and not self.transport.is_closing():
            if self.phase != "closing":  # a close aiohttp did not get to is no client's timeout
                self.guard.on_event(self.phase)
            self.transport.close()

    def evict(self) -> None:
        """Close this connection (idle, in an unfinished head, or the slowest
        body) to make room for a new one; no request of it was admitted."""
        self.guard.forget(self)
        self.guard.on_event("evicted")
        if self.transport is not None:
            self.transport.close()

    def write_stalled(self, now: float) -> None:
        """The write buffer has been full for write_timeout: cut the client
        off unless it accepted some bytes meanwhile (then wait again)."""
        assert self.transport is not None
        backlog = self.transport.get_write_buffer_size()
        if backlog < self.write_backlog:
            self.write_backlog = backlog
            self.write_deadline = now + self.guard.write_timeout
            return
        self.write_deadline = float("inf")
        self.guard.on_event("write")
        self.transport.abort()  # close() would wait for the buffer to drain: forever

    def data_received(self, data: bytes) -> None:
        if self.inner is None or self.phase == "refused":
            return  # read and discarded until closed
        if self.phase == "idle":
            self.set_phase("headers")
        elif self.phase == "body":
            self.body_bytes += len(data)
        if self.phase == "headers" and self.header_bytes >= 0:
            # Count the head's bytes until its blank line; after it come body bytes.
            end = (self.tail + data).find(b"\r\n\r\n")
            if end >= 0:
                self.header_bytes = -1  # this request's head is complete
            else:
                self.header_bytes += len(data)
                self.tail = data[-3:]
                if self.header_bytes > MAX_HEADER_BYTES:
                    # aiohttp never sees these bytes; it learns of the close as usual.
                    self.guard.forget(self)
                    self._refuse(self.transport, self.guard.too_large, "headers")
                    return
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received() if self.inner is not None else False  # False: close

    def pause_writing(self) -> None:
        if self.transport is not None and self.guard.write_timeout != float("inf"):
            self.write_backlog = self.transport.get_write_buffer_size()
            self.write_deadline = asyncio.get_running_loop().time() + self.guard.write_timeout
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.write_deadline = float("inf")
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.timer is not None:  # refused and lingering
            self.timer.cancel()
            self.guard.lingering -= 1
        if self.inner is None:
            return
        self.guard.forget(self)
        self.inner.connection_lost(exc)


class BodyRefused(Exception):
    """The request body was refused; STATUS and the OpenAI error say why."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


class BodyBudget:
    """Bytes of request bodies the gateway holds, across all connections and per client."""

    def __init__(self, limit: int, per_client: Optional[int] = None):
        self.limit = limit
        self.per_client = min(per_client or limit, limit)
        self.used = 0
        self.clients: dict[str, int] = {}

    def take(self, n: int, client: str = "") -> bool:
        held = self.clients.get(client, 0)
        if self.used + n > self.limit or held + n > self.per_client:
            return False
        self.used += n
        self.clients[client] = held + n
        return True

    def give(self, n: int, client: str = "") -> None:
        self.used -= n
        left = self.clients.get(client, 0) - n
        if left > 0:
            self.clients[client] = left
        else:
            self.clients.pop(client, None)


class Body:
    """One request's body and the budget it holds until release()."""

    def __init__(self, budget: BodyBudget, client: str = ""):
        self.budget = budget
        self.client = client
        self.held = 0
        self.data = bytearray()

    def _hold(self, n: int) -> None:
        if n > self.held:
            if not self.budget.take(n - self.held, self.client):
                budget = self.budget
                if budget.used + n - self.held > budget.limit:
                    message = f"the gateway holds {budget.limit} bytes of request bodies at most and is full; retry"
                else:
                    message = (f"the gateway holds {budget.per_client} bytes of request bodies per client at "
                               "most, and this client's are in use; retry")
                raise BodyRefused(503, "too_many_bodies", message)
            self.held = n

    def add(self, chunk: bytes, max_bytes: int) -> None:
        """Append CHUNK, within MAX_BYTES and the budget (BodyRefused otherwise)."""
        size = len(self.data) + len(chunk)
        if size > max_bytes:
            raise BodyRefused(413, "body_too_large", f"the request body is over {max_bytes} bytes")
        self._hold(size)
        self.data += chunk

    def release(self) -> None:
        self.budget.give(self.held, self.client)
        self.held = 0
        self.data = bytearray()


class EngineBodyCaps:
    """The largest body the gateway reads for each engine slot: the
    configured gateway.max_body_bytes, or the engine's own smaller cap (the
    builtin engine's max_body_bytes on /health: what a request of its model
    can take to write), since a larger body could only be refused there,
    after the gateway had taken all of it. An engine that did not answer, or
    sent none, leaves the configured one."""

    def __init__(self, configured: int) -> None:
        self.configured = configured
        self.engines: dict[str, int] = {}

    def heard(self, slot: str, health) -> None:
        """SLOT's engine answered /health with HEALTH (an EngineHealth), or not (None)."""
        cap = getattr(health, "max_body_bytes", None)
        if isinstance(cap, int) and cap > 0:
            self.engines[slot] = cap
        else:
            self.engines.pop(slot, None)

    def of(self, slot: str) -> int:
        return min(self.configured, self.engines.get(slot, self.configured))


async def read_body(request: web.Request, budget: BodyBudget, max_bytes: int, timeout: float,
                    connections: Optional[Connections] = None) -> Body:
    """REQUEST's whole body within TIMEOUT, holding budget (its client's
    share of it, by CONNECTIONS) for the bytes that arrived; BodyRefused
    (413, 503 or 408) otherwise. While it waits for more bytes the
    connection may be evicted for a new one at CONNECTIONS' cap, the slowest
    body first (reading_body). The caller releases the returned Body."""
    body = Body(budget, connections.client(request.transport) if connections is not None else "")
    if not request.body_exists:
        return body
    length = request.content_length
    try:
        if length is not None and length > max_bytes:
            raise BodyRefused(413, "body_too_large",
                              f"the request body is {length} bytes; at most {max_bytes} are accepted")
        if request.content.is_eof():
            # The whole body came with the headers (most API calls): take it
            # without arming a deadline, which costs a timer per request.
            body.add(request.content.read_nowait(-1), max_bytes)
            return body
        if connections is not None:
            connections.reading_body(request.transport)
        try:
            async with asyncio.timeout(timeout):
                while chunk := await request.content.readany():
                    body.add(chunk, max_bytes)
        except TimeoutError:
            raise BodyRefused(408, "body_timeout",
                              f"the request body did not arrive within {timeout:g} s") from None
        finally:
            if connections is not None:
                connections.started(request.transport)  # the body is in (or refused): not evictable
    except BaseException:
        body.release()
        raise
    return body
