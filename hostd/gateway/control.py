"""The gateway's control socket: drain, resume, status, switch.

Trust model: /run/hostd/NAME/control.sock is 0600 in the private 0700 runtime
directory, and every peer is checked with SO_PEERCRED (the gateway's uid or
root); others are logged and disconnected before a byte is read. Clients
connect through sockets.connect (no symlinks; the owner and the peer
checked). Requests are single JSON lines (at most MAX_LINE bytes) decoded
against fixed msgspec
types; anything else (bad JSON, an unknown verb, a wrong type) gets an error
answer naming the problem and changes nothing.

    -> {"verb": "drain", "timeout": 30}
    <- {"ok": true, "drained": false, "remaining": 2, "state": "draining"}
    -> {"verb": "resume"}  (optionally "outcome": "done")    -> {"verb": "status"}
    -> {"verb": "switch", "slot": "next"}   (overlap reload: new requests to engine-next.sock)
    -> {"verb": "switch", "slot": "main", "outcome": "done"}   (and back: the overlap reload ended)
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from pathlib import Path
from typing import Annotated, Any, Awaitable, Callable, Literal, Optional, Union

import msgspec

from hostd import sockets

log = logging.getLogger("hostd.gateway.control")

MAX_LINE = 64 << 10


class Drain(msgspec.Struct, tag_field="verb", tag="drain", forbid_unknown_fields=True):
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)]


# How a reload ended, for the gateway's reload histogram (label `outcome`):
# the manager's end states, and `recovered` for its crash recovery. A fixed
# set, so a peer cannot grow the label's series without bound.
Outcome = Literal["done", "rolled-back", "failed", "cancelled", "recovered"]


class Resume(msgspec.Struct, tag_field="verb", tag="resume", forbid_unknown_fields=True):
    # Unset (a resume by hand): the label is the state the resume leads to.
    outcome: Optional[Outcome] = None


class Status(msgspec.Struct, tag_field="verb", tag="status", forbid_unknown_fields=True):
    pass


class Switch(msgspec.Struct, tag_field="verb", tag="switch", forbid_unknown_fields=True):
    """Send new requests to the engine in SLOT (paths.ENGINE_SOCKETS); requests
    already running stay on their engine. A slot name, never a path."""

    slot: Literal["main", "next"]
    # Switching back to main ends an overlap reload: how it ended (as Resume).
    outcome: Optional[Outcome] = None


Request = Union[Drain, Resume, Status, Switch]
_decoder = msgspec.json.Decoder(Request)

Handler = Callable[[Request], Awaitable[dict]]


class ControlError(Exception):
    """The gateway refused a control request, or could not be reached."""


def parse(line: bytes) -> Request:
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "Invalid value" in message and "$.verb" in message:
            message = f"{message}; expected verb drain, resume, status or switch"
        raise ControlError(message) from None
    except msgspec.DecodeError as exc:
        raise ControlError(f"not a JSON object: {exc}") from None


async def serve(listener: socket.socket, handle: Handler) -> asyncio.AbstractServer:
    """Answer requests on LISTENER (from sockets.bind_private)."""
    return await asyncio.start_unix_server(
        lambda r, w: _connection(r, w, handle), sock=listener, limit=MAX_LINE
    )


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler) -> None:
    pid = sockets.trusted_peer(writer.get_extra_info("socket"))
    try:
        if pid is None:
            return
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return
            except asyncio.LimitOverrunError:
                log.warning("control: pid %d sent a line over %d bytes; closing", pid, MAX_LINE)
                await _answer(writer, {"ok": False, "error": f"request longer than {MAX_LINE} bytes"})
                return
            try:
                request = parse(line)
            except ControlError as exc:
                log.warning("control: refused request from pid %d: %s", pid, exc)
                await _answer(writer, {"ok": False, "error": str(exc)})
                continue
            try:
                answer = {"ok": True, **await handle(request)}
            except ControlError as exc:  # the gateway refused: it says why, nothing changed
                answer = {"ok": False, "error": str(exc)}
            await _answer(writer, answer)
    except (ConnectionError, OSError):
        return
    finally:
        writer.close()


async def _answer(writer: asyncio.StreamWriter, answer: dict) -> None:
    writer.write(json.dumps(answer).encode() + b"\n")
    await writer.drain()


# ---------------------------------------------------------------- clients


def _request_line(verb: str, args: dict) -> bytes:
    return json.dumps({"verb": verb, **args}).encode() + b"\n"


def _answer_of(path: Path, answer: bytes) -> dict:
    if not answer:
        raise ControlError(f"{path}: the gateway closed the connection without answering")
    try:
        data = json.loads(answer)
    except ValueError:
        raise ControlError(f"{path}: not a JSON answer: {answer[:200]!r}") from None
    if not isinstance(data, dict) or not data.get("ok"):
        raise ControlError(data.get("error", "refused") if isinstance(data, dict) else "refused")
    return data


def call(path: Path, verb: str, **args: Any) -> dict:
    """Send one request (ARGS are its fields) and return the answer;
    ControlError when refused or unreachable."""
    try:
        with sockets.connect(path, args.get("timeout", 0) + 30.0) as conn:
            conn.sendall(_request_line(verb, args))
            answer = conn.makefile("rb").readline(MAX_LINE + 1)
    except OSError as exc:
        raise ControlError(f"{path}: {exc}") from None
    return _answer_of(path, answer)


async def call_async(path: Path, verb: str, **args: Any) -> dict:
    """call() for an event loop: the checked connect runs in a thread."""
    conn = await asyncio.to_thread(sockets.connect, path, 10.0)
    conn.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_LINE)
    try:
        writer.write(_request_line(verb, args))
        await writer.drain()
        answer = await reader.readline()
    finally:
        writer.close()
    return _answer_of(path, answer)
