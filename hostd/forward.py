"""Streaming HTTP forwarding from an aiohttp server request to an engine.

One job: pass one request on and its response back, chunk by chunk, for the
gateway (public socket -> engine.sock, or vLLM's own Unix socket) and for the
upstream engine proxy (engine.sock -> SGLang's loopback port, or vLLM's
socket for what the gateway does not send there itself). Both hops behave
the same way:

- Headers: the hop-by-hop fields of RFC 9110 section 7.6.1 (and any field the
  Connection header names) are dropped in both directions, as are the fields
  the next hop's client library sets for its own connection (Host,
  Content-Length). Repeated fields (Set-Cookie) pass as they are.
- Bodies: the request body is read once by the caller (it decides limits) and
  sent as bytes, without its Content-Encoding field (REQUEST_FIELDS_STOPPED:
  the gateway accepts identity bodies only, so a second field that slipped by
  could only tell the next hop to inflate); the response is never decoded or parsed (auto_decompress is
  off), and passes through as it arrives, so SSE events reach the client when
  the engine writes them. A non-streaming response keeps its Content-Length;
  one of at most WHOLE_BYTES is read whole and sent with its headers in one
  write (one system call instead of two: most of the cost of a hop).
- A client that goes away (its handler is cancelled, or a write finds its
  connection closed) closes the engine connection, so the engine sees the
  disconnect and cancels the request.
- An engine that fails before any byte reached the client raises
  Unreachable, so the caller chooses the answer (503, 502, or the request
  once more elsewhere): its `taken` says whether the engine may have taken
  the request (it died after the connection was made: before its response
  headers, or in a whole answer, or before a streamed answer's first chunk;
  a streamed response's headers wait for that chunk, so they go out in one
  write with it) or surely did not (no connection: refused, no such
  socket). An engine that fails after the response started ends it: an SSE
  response gets one OpenAI error event, the client connection is closed (a
  client library then reports an error instead of a truncated success), and
  Broken is raised.

Trusts: neither side; it only copies bytes and drops connection fields.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Callable, Optional

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

# RFC 9110 7.6.1: fields that describe one connection and must not be
# forwarded: Connection, Proxy-Connection, Keep-Alive, TE, Transfer-Encoding,
# Upgrade. Proxy-Authenticate and Proxy-Authorization (RFC 9110 11.7) are
# addressed to the proxy itself. Trailer announces trailer fields, which
# aiohttp does not forward, so passing it on would promise fields that never
# come. Host and Content-Length are end-to-end but are set by the client
# library for the next hop's connection and body.
HOP_BY_HOP = frozenset({
    "connection", "proxy-connection", "keep-alive", "te", "transfer-encoding", "upgrade",
    "proxy-authenticate", "proxy-authorization", "trailer",
})
SET_PER_HOP = frozenset({"host", "content-length"})
# Request fields never passed on. Content-Encoding: the body is sent as the
# caller read it, and an engine's parser takes the last of several fields
# (aiohttp's does), so "identity" followed by "gzip" had the engine inflate a
# bomb the gateway thought uncompressed (issue 33, M3).
REQUEST_FIELDS_STOPPED = frozenset({"content-encoding"})
WHOLE_BYTES = 256 << 10

# Failures of the engine side while a response streams.
ENGINE_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


class Unreachable(Exception):
    """Nothing was sent to the client; TAKEN: the engine may have taken the request."""

    def __init__(self, message: str, taken: bool = False):
        super().__init__(message)
        self.taken = taken


class Broken(Exception):
    """The engine failed after the response started; the client connection is closed."""

    def __init__(self, response: web.StreamResponse, cause: BaseException):
        super().__init__(str(cause))
        self.response = response


def forwarded_headers(headers, drop: frozenset[str] = frozenset()) -> CIMultiDict:
    """HEADERS without hop-by-hop fields, those Connection names, and DROP."""
    named = {token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")}
    skip = HOP_BY_HOP | SET_PER_HOP | named | drop
    return CIMultiDict((key, value) for key, value in headers.items() if key.lower() not in skip)


def is_event_stream(headers) -> bool:
    return "text/event-stream" in headers.get("Content-Type", "")


def session(connector: aiohttp.BaseConnector, connect_timeout: float) -> aiohttp.ClientSession:
    """A pooled keep-alive session to an engine: no total timeout (streams run
    as long as they run), no decompression (bytes pass unchanged)."""
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout),
    )


# Upstream's servers (uvicorn) close a keep-alive connection idle for 5 s
# (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, vllm/envs.py:1143; SGLang's
# SGLANG_TIMEOUT_KEEP_ALIVE, sglang/srt/environ.py:337). A POST sent on one
# as they close it fails as taken (aiohttp resends only idempotent methods),
# which the gateway counts as the engine lost: hostd drops idle ones first.
UPSTREAM_KEEPALIVE_S = 2.0


def upstream_connector(path: Optional[Path] = None) -> aiohttp.BaseConnector:
    """A connection pool to upstream's server: on its Unix socket PATH, else
    over TCP; unlimited, idle connections closed before upstream closes them."""
    if path is not None:
        return aiohttp.UnixConnector(path=str(path), limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)


async def forward(
    session: aiohttp.ClientSession,
    url: str,
    request: web.Request,
    body: bytes | bytearray,
    *,
    drop: frozenset[str] = frozenset(),
    add: Optional[dict[str, str]] = None,
    on_start: Optional[Callable[[int, CIMultiDictProxy], None]] = None,
    on_chunk: Optional[Callable[[bytes], None]] = None,
    stream_error: Optional[dict] = None,
) -> web.StreamResponse:
    """Send REQUEST (with BODY, already read) to URL and stream the answer back.

    DROP names request fields (lower case) that stop here besides the
    hop-by-hop ones; ADD are fields the sender sets in their place;
    ON_START(status, headers) is called when the engine's response headers
    arrive; ON_CHUNK(chunk) with every chunk written to the client (a whole
    response's body once, before it is sent);
    STREAM_ERROR is the OpenAI error object sent as a last SSE event when the
    engine fails mid-stream. Raises Unreachable or Broken (see the module)."""
    headers = forwarded_headers(request.headers, drop | REQUEST_FIELDS_STOPPED)
    if add:
        headers.update(add)
    try:
        upstream = await session.request(request.method, url, headers=headers, data=body or None)
    except aiohttp.ClientConnectorError as exc:  # no connection: the engine took nothing
        raise Unreachable(str(exc)) from exc
    except (aiohttp.ClientConnectionError, OSError) as exc:  # reset or EOF once sent: it may have
        raise Unreachable(f"the engine went away before it answered: {exc}", taken=True) from exc
    if on_start is not None:
        on_start(upstream.status, upstream.headers)
    try:
        sse = is_event_stream(upstream.headers)
        length = upstream.content_length
        if not sse and length is not None and length <= WHOLE_BYTES:
            try:
                whole = await upstream.read()
            except ENGINE_ERRORS as exc:
                raise Unreachable(f"the engine's answer broke off: {exc}", taken=True) from exc
            response = web.Response(status=upstream.status, reason=upstream.reason, body=whole,
                                    headers=forwarded_headers(upstream.headers))
            if on_chunk is not None and whole:
                on_chunk(whole)
            return response
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(forwarded_headers(upstream.headers))
        if length is not None and not sse:
            response.content_length = length
        while True:
            try:
                chunk = await upstream.content.readany()
            except ENGINE_ERRORS as exc:
                if not response.prepared:  # the client has nothing of it yet
                    raise Unreachable(f"the engine's answer broke off before its first chunk: {exc}",
                                      taken=True) from exc
                await _end_broken(request, response, sse, stream_error)
                raise Broken(response, exc) from exc
            if not response.prepared:
                await response.prepare(request)
            if not chunk:
                break
            try:
                await response.write(chunk)
            except ConnectionResetError:  # the client went away
                return response
            if on_chunk is not None:
                on_chunk(chunk)
        await response.write_eof()
        return response
    finally:
        # Closing (not releasing) an unfinished response drops its connection,
        # which is how the engine learns that the client left.
        if not upstream.content.at_eof():
            upstream.close()
        else:
            upstream.release()


async def _end_broken(request: web.Request, response: web.StreamResponse, sse: bool,
                      stream_error: Optional[dict]) -> None:
    if sse and stream_error is not None:
        try:
            await response.write(f"data: {json.dumps({'error': stream_error})}\n\n".encode())
        except ConnectionResetError:
            pass
    if request.transport is not None:
        request.transport.close()
