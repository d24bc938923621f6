"""The gateway's control socket: drain, resume, status, switch, settle, keys, mark.

Trust model: /run/hostd/NAME/control.sock is 0600 in the private 0700 runtime
directory, and every peer is checked with SO_PEERCRED (the gateway's uid or
root); others are logged and disconnected before a byte is read. The verb
`keys` (new API keys) is root's alone: the engine and weights units run as the
gateway's uid and run upstream code fed by the network, and a key they could
set would open the public port to whoever they chose. Clients
connect through sockets.connect (no symlinks; the owner and the peer
checked). Requests are single JSON lines (at most MAX_LINE bytes) decoded
against fixed msgspec
types; anything else (bad JSON, an unknown verb, a wrong type) gets an error
answer naming the problem and changes nothing.

Answers are msgspec types too, one per verb (ANSWERS), all carrying `ok`
and the gateway's PROTOCOL; a refusal is a Refusal. The clients decode them
as those types; a field a later gateway adds is ignored by an earlier client,
and a field an earlier gateway lacks has a default.

    -> {"verb": "drain", "timeout": 30}
    <- {"ok": true, "protocol": 2, "drained": false, "remaining": 2, "state": "draining"}
    -> {"verb": "resume"}  (optionally "outcome": "done")    <- Resumed
    -> {"verb": "status"}                                    <- GatewayStatus
    -> {"verb": "switch", "slot": "next"}   (overlap reload: new requests to engine-next.sock)
    -> {"verb": "switch", "slot": "main", "outcome": "done"}   (and back: the overlap reload ended)
    <- GatewayStatus, for either switch
    -> {"verb": "settle", "slot": "main", "timeout": 120}   (overlap reload: wait until the requests
    <- {"ok": true, "protocol": 3, "settled": true, "remaining": 0}   running on that engine end)
    -> {"verb": "keys", "source": "/etc/hostd/keys/qwen", "keys": ["sk-..."]}   (root only: new API keys,
    <- {"ok": true, "protocol": 5, "keys": 2}                 read from SOURCE by hostd.gateway.keys)
    -> {"verb": "mark"}   (an in-place reload begins: nothing here changes but the reload clock)
    -> {"verb": "mark", "outcome": "done"}   (and ends)       <- GatewayStatus
    <- {"ok": false, "protocol": 2, "error": "..."}          a refusal, for any request

PROTOCOL: 1 (no `protocol` in answers): a gateway from before switch took an
`outcome`; 2: switch takes one; 3: settle; 4: keys; 5: the standby slot
(switch and settle take "standby"; status says `failed_over` when the
gateway itself moved new requests to the standby because their engine
died); 6: mark (a reload the gateway takes no part in, an in-place
rebuild behind the same engine socket, begins and ends on its reload
clock). The gateway and the manager ship together, but
a model's gateway keeps running across an upgrade of hostd.service, so the
manager asks before it sends a field an older gateway would refuse
(manager/probe.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Annotated, Awaitable, Callable, Literal, Optional, Union

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


# omit_defaults: an unset outcome is not sent, so a gateway that has no such
# field (PROTOCOL 1, for switch) takes the request.
class Resume(msgspec.Struct, tag_field="verb", tag="resume", forbid_unknown_fields=True, omit_defaults=True):
    # Unset (a resume by hand): the label is the state the resume leads to.
    outcome: Optional[Outcome] = None


class Status(msgspec.Struct, tag_field="verb", tag="status", forbid_unknown_fields=True):
    pass


class Switch(msgspec.Struct, tag_field="verb", tag="switch", forbid_unknown_fields=True, omit_defaults=True):
    """Send new requests to the engine in SLOT (paths.ENGINE_SOCKETS); requests
    already running stay on their engine. A slot name, never a path."""

    slot: Literal["main", "next", "standby"]
    # Switching back to main ends an overlap reload: how it ended (as Resume).
    outcome: Optional[Outcome] = None


class Settle(msgspec.Struct, tag_field="verb", tag="settle", forbid_unknown_fields=True):
    """Wait until no request sent to the engine in SLOT still runs, or TIMEOUT
    passes; admission is untouched (an overlap reload, before it stops the
    engine a switch left)."""

    slot: Literal["main", "next", "standby"]
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)]


class Keys(msgspec.Struct, tag_field="verb", tag="keys", forbid_unknown_fields=True):
    """Serve with KEYS from now on (each one line of the keys file SOURCE,
    which must be the file the gateway was started with); requests already
    admitted are not touched. Root only (the module docstring)."""

    source: Annotated[str, msgspec.Meta(min_length=1)]
    keys: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1)]


class Mark(msgspec.Struct, tag_field="verb", tag="mark", forbid_unknown_fields=True, omit_defaults=True):
    """A reload the gateway takes no part in (in-place: the engine rebuilds
    behind the same socket) begins (no OUTCOME) or ends (OUTCOME), for the
    gateway's reload histograms; admission and slots are untouched."""

    outcome: Optional[Outcome] = None


Request = Union[Drain, Resume, Status, Switch, Settle, Keys, Mark]
ROOT_ONLY = (Keys,)  # verbs a peer of the gateway's own uid may not send
_decoder = msgspec.json.Decoder(Request)

PROTOCOL = 6  # see the module docstring


class Answer(msgspec.Struct, kw_only=True):
    """What every answer carries. Unknown fields are ignored when decoding:
    a later gateway may say more."""

    ok: bool = True
    protocol: int = 1  # a gateway that does not say is a protocol 1 gateway


class Refusal(Answer, kw_only=True):
    ok: bool = False
    error: str = "refused"


class Drained(Answer, kw_only=True):
    drained: bool  # nothing in flight any more; else the timeout passed
    remaining: int  # requests still running
    state: str  # the gateway's state (gateway/state.py)


class Settled(Answer, kw_only=True):
    settled: bool  # nothing sent to the slot runs any more; else the timeout passed
    remaining: int  # requests still running on it


class KeysReplaced(Answer, kw_only=True):
    keys: int  # how many keys the gateway serves with now


class Resumed(Answer, kw_only=True):
    state: str


class GatewayStatus(Answer, kw_only=True):
    """The gateway's admission counters (gateway/state.py snapshot) and slot."""

    state: str
    in_flight: int = 0
    queued: int = 0
    admitted: int = 0
    completed: int = 0
    rejected: dict[str, int] = {}
    drains: int = 0
    proxied_bytes: int = 0
    since: float = 0.0
    slot: str = "main"  # the engine slot new requests go to
    # The slot whose engine died when the gateway moved new requests to the
    # standby itself (they go back once it answers again); "" otherwise.
    failed_over: str = ""


# The answer to each request.
ANSWERS: dict[type, type] = {Drain: Drained, Resume: Resumed, Status: GatewayStatus, Switch: GatewayStatus,
                             Settle: Settled, Keys: KeysReplaced, Mark: GatewayStatus}

Handler = Callable[[Request], Awaitable[Answer]]


class ControlError(Exception):
    """The gateway refused a control request, or could not be reached."""


def parse(line: bytes) -> Request:
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if "Invalid value" in message and "$.verb" in message:
            message = f"{message}; expected verb drain, resume, status, switch, settle, keys or mark"
        raise ControlError(message) from None
    except msgspec.DecodeError as exc:
        raise ControlError(f"not a JSON object: {exc}") from None


async def serve(listener: socket.socket, handle: Handler) -> asyncio.AbstractServer:
    """Answer requests on LISTENER (from sockets.bind_private)."""
    return await asyncio.start_unix_server(
        lambda r, w: _connection(r, w, handle), sock=listener, limit=MAX_LINE
    )


async def _connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler) -> None:
    conn = writer.get_extra_info("socket")
    pid = sockets.trusted_peer(conn)
    try:
        if pid is None:
            return
        root = sockets.peer_credentials(conn)[1] == 0
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.IncompleteReadError:
                return
            except asyncio.LimitOverrunError:
                log.warning("control: pid %d sent a line over %d bytes; closing", pid, MAX_LINE)
                await _answer(writer, Refusal(error=f"request longer than {MAX_LINE} bytes"))
                return
            try:
                request = parse(line)
            except ControlError as exc:
                log.warning("control: refused request from pid %d: %s", pid, exc)
                await _answer(writer, Refusal(error=str(exc)))
                continue
            if isinstance(request, ROOT_ONLY) and not root:
                log.warning("control: refused %s from pid %d: only root may send it", type(request).__name__.lower(), pid)
                await _answer(writer, Refusal(error=f"only root may send {type(request).__name__.lower()} "
                                                    "(systemctl reload model@NAME does, as root)"))
                continue
            try:
                answer = await handle(request)
            except ControlError as exc:  # the gateway refused: it says why, nothing changed
                answer = Refusal(error=str(exc))
            # One line a request at debug (the manager asks `status` often).
            log.debug("control: %s from pid %d: %s", type(request).__name__.lower(), pid,
                      "refused" if isinstance(answer, Refusal) else "ok")
            await _answer(writer, answer)
    except (ConnectionError, OSError):
        return
    finally:
        writer.close()


async def _answer(writer: asyncio.StreamWriter, answer: Answer) -> None:
    writer.write(msgspec.json.encode(msgspec.structs.replace(answer, protocol=PROTOCOL)) + b"\n")
    await writer.drain()


# ---------------------------------------------------------------- clients

_verdict = msgspec.json.Decoder(Refusal)  # ok, and the error when not


def _answer_of(path: Path, request: Request, answer: bytes) -> Answer:
    """ANSWER decoded as the answer type of REQUEST; ControlError for a
    refusal or anything that is not such an answer."""
    if not answer:
        raise ControlError(f"{path}: the gateway closed the connection without answering")
    try:
        verdict = _verdict.decode(answer)
        if not verdict.ok:
            raise ControlError(verdict.error)
        return msgspec.json.decode(answer, type=ANSWERS[type(request)])
    except msgspec.DecodeError as exc:
        raise ControlError(f"{path}: not an answer to {type(request).__name__.lower()}: {exc}: "
                           f"{answer[:200]!r}") from None


def call(path: Path, request: Request) -> Answer:
    """Send REQUEST and return its answer (ANSWERS); ControlError when
    refused or unreachable."""
    timeout = request.timeout if isinstance(request, Drain) else 0
    try:
        with sockets.connect(path, timeout + 30.0) as conn:
            conn.sendall(msgspec.json.encode(request) + b"\n")
            answer = conn.makefile("rb").readline(MAX_LINE + 1)
    except OSError as exc:
        raise ControlError(f"{path}: {exc}") from None
    return _answer_of(path, request, answer)


async def call_async(path: Path, request: Request) -> Answer:
    """call() for an event loop: the checked connect runs in a thread."""
    conn = await asyncio.to_thread(sockets.connect, path, 10.0)
    conn.setblocking(False)
    reader, writer = await asyncio.open_unix_connection(sock=conn, limit=MAX_LINE)
    try:
        writer.write(msgspec.json.encode(request) + b"\n")
        await writer.drain()
        answer = await reader.readline()
    finally:
        writer.close()
    return _answer_of(path, request, answer)
