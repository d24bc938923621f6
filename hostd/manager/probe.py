"""How the manager looks at and steers one model's processes.

One job: the manager's side of the gateway's control socket (drain, resume,
status), the engine's HTTP socket (health, a smoke request) and the weight
daemon's socket (identity); the memory preflight is preflight.py's, which the
Probe hands over to (Probe.preflight). The manager runs as
root, so it may connect to the 0600 sockets in the private runtime directory;
it does so only through sockets.connect, which refuses symlinks, sockets not
owned by the model's user and peers that are neither that user nor root.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
from pathlib import Path
from typing import Optional

import aiohttp
import msgspec
from msgspec import UNSET

from hostd import paths, sockets, units
from hostd.engine import health as engine_health
from hostd.engine.health import EngineHealth
from hostd.gateway import control
from hostd.manager.preflight import GpuMemory, Memory, Preflight  # noqa: F401 (Memory, GpuMemory: the probe's API)
from hostd.weights import client as weights_client

log = logging.getLogger("hostd.manager.probe")

# What the manager (root) accepts from a model's sockets, whose other end runs
# the model's code: answers are typed, capped and timed.
CONTROL_TIMEOUT = 10.0  # s for a control answer, beyond what the request may take (a drain's timeout)
HEALTH_MAX = engine_health.MAX_BYTES  # bytes of an engine's /health answer (and of a rebuild's)
SMOKE_ERROR_BYTES = 300  # bytes of a failed smoke request's answer shown: enough for the reason, never the whole
JOURNAL_SYNC_S = 3.0  # s for journald to take in what a failed engine wrote, before its lines are read


class VerifyFailed(Exception):
    pass


class RebuildFailed(Exception):
    """The standby did not rebuild; the message is its own answer (it keeps its old model)."""


REBUILD_TIMEOUT = 600.0  # s: a skeleton, an attach and a warm-up; seconds at 7B (docs/benchmarks.md)


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The first LIMIT bytes of RESPONSE's body (fewer when it ends first); the model's engine chooses its size."""
    data = b""
    while len(data) < limit:
        chunk = await response.content.read(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data


class CheckedUnixConnector(aiohttp.UnixConnector):
    """aiohttp's Unix connector, connecting through sockets.connect."""

    async def _create_connection(self, req, traces, timeout):
        try:
            sock = await asyncio.to_thread(sockets.connect, Path(self.path), 10.0)
        except OSError as exc:
            raise aiohttp.ClientConnectorError(req.connection_key, exc) from exc
        sock.setblocking(False)
        _, proto = await self._loop.create_unix_connection(self._factory, sock=sock)
        return proto



def identity(status) -> Optional[tuple[int, int]]:
    """A weight daemon's (pid, socket inode) from its STATUS (None: it did not answer)."""
    return None if status is None else (status.pid, status.socket_inode)


def weights_problem(before: tuple[int, int], now: Optional[tuple[int, int]], health: EngineHealth) -> Optional[str]:
    """Verify's "same weight daemon" rule: why an engine whose /health is
    HEALTH did not attach the weight daemon BEFORE ((pid, socket inode), read
    as the reload began), the daemon answering NOW; None when it did. Another
    daemon means the weights were loaded again: not the weights retained."""
    engine_saw = tuple(None if v is UNSET else v for v in (health.weights_pid, health.weights_socket_inode))
    before = tuple(before)
    if (tuple(now) if now is not None else None) != before or engine_saw != before:
        return f"the weight daemon changed (pid, inode) {before} -> {now}; the engine attached to {engine_saw}"
    return None

class Probe:
    def __init__(self, name: str):
        self.name = name
        self.gateway_protocol: Optional[int] = None  # control.PROTOCOL of its last answer; None: not asked yet
        self.preflight = Preflight(name)

    # ------------------------------------------------------------ gateway

    async def _control(self, request: control.Request):
        """REQUEST's answer, within CONTROL_TIMEOUT beyond the time the
        request itself may take (a drain's): a gateway that accepts and never
        answers must not hold the manager."""
        wait = CONTROL_TIMEOUT + float(getattr(request, "timeout", 0) or 0)
        try:
            answer = await asyncio.wait_for(control.call_async(paths.control_socket(self.name), request), wait)
        except asyncio.TimeoutError:
            raise control.ControlError(
                f"the gateway of {self.name} did not answer {type(request).__name__.lower()} in {wait:g} s") from None
        self.gateway_protocol = answer.protocol
        return answer

    async def drain(self, timeout: float) -> control.Drained:
        return await self._control(control.Drain(timeout=timeout))

    async def resume(self, outcome: Optional[str] = None) -> control.Resumed:
        """Serve again after a drain; OUTCOME (how the reload ended) labels
        the gateway's reload histogram."""
        return await self._control(control.Resume(outcome=outcome or None))

    async def switch(self, slot: str, outcome: Optional[str] = None) -> control.GatewayStatus:
        """New requests to the engine in SLOT (an overlap reload); OUTCOME when
        switching back to main ends the reload (as for resume).

        A gateway of control protocol 1 (started before an upgrade of hostd,
        its model not restarted since) refuses an outcome with a switch: it
        gets the switch without one. The switch matters, the metric label
        does not."""
        if outcome and self.gateway_protocol is None:
            await self.gateway_status()  # learn the protocol (None again if it does not answer)
        if outcome and self.gateway_protocol == 1:
            log.info("the gateway of %s speaks control protocol 1 (no outcome with a switch); "
                     "switching without one", self.name)
            outcome = None
        return await self._control(control.Switch(slot=slot, outcome=outcome or None))

    async def settle(self, slot: str, timeout: float) -> Optional[control.Settled]:
        """Wait until the requests running on SLOT's engine end (at most TIMEOUT
        seconds). None from a gateway older than control protocol 3, which
        cannot tell: the engine's own shutdown_timeout is then all they get."""
        if self.gateway_protocol is None:
            await self.gateway_status()
        if self.gateway_protocol is not None and self.gateway_protocol < 3:
            log.info("the gateway of %s speaks control protocol %d (no settle); not waiting for the %s engine",
                     self.name, self.gateway_protocol, slot)
            return None
        return await self._control(control.Settle(slot=slot, timeout=timeout))

    async def mark(self, outcome: Optional[str] = None) -> None:
        """An in-place reload begins (no OUTCOME) or ends (OUTCOME) on the
        gateway's reload clock, which no drain or switch starts for it. Only
        a metric rides on it: a gateway older than control protocol 6, or one
        that fails to answer, is logged and the reload goes on."""
        try:
            if self.gateway_protocol is None:
                await self.gateway_status()
            if self.gateway_protocol is not None and self.gateway_protocol < 6:
                log.info("the gateway of %s speaks control protocol %d (no mark); its reload histogram "
                         "does not count this in-place reload", self.name, self.gateway_protocol)
                return
            await self._control(control.Mark(outcome=outcome or None))
        except (OSError, control.ControlError) as exc:
            log.warning("the gateway of %s did not mark the in-place reload's %s: %s", self.name,
                        "end" if outcome else "begin", exc, extra={"hostd_model": self.name})

    async def gateway_status(self) -> Optional[control.GatewayStatus]:
        """The gateway's status; None when it does not answer, or answers
        counts no gateway can have (the D-Bus InFlight is a u)."""
        try:
            status = await self._control(control.Status())
        except (OSError, control.ControlError):
            return None
        if not isinstance(status, control.GatewayStatus) or not 0 <= status.in_flight < 2**32:
            log.warning("the gateway of %s answered an impossible status: %.200r", self.name, status,
                        extra={"hostd_model": self.name})
            return None
        return status

    # ------------------------------------------------------------ weights

    async def weights_status(self, slot: str = "main"):
        """The status (weights/protocol.py's Status) of SLOT's weight daemon
        (main; next: a checkpoint swap's), or None when it does not answer."""
        try:
            return await asyncio.to_thread(weights_client.status, paths.weights_socket(self.name, slot))
        except (OSError, weights_client.WeightsRefused) as exc:
            log.warning("weights of %s (%s): %s", self.name, slot, exc)
            return None

    async def weights_identity(self, slot: str = "main") -> Optional[tuple[int, int]]:
        return identity(await self.weights_status(slot))

    # ------------------------------------------------------------ engine

    async def engine_health(self, slot: str = "main") -> Optional[EngineHealth]:
        """The /health of the engine in SLOT, decoded under HEALTH_MAX (engine/health.py);
        None when it does not answer 200 with one."""
        connector = CheckedUnixConnector(path=str(paths.engine_socket(self.name, slot)))
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=10)) as http:
                async with http.get("http://engine/health") as response:
                    if response.status != 200:
                        return None
                    body = await _read_at_most(response, HEALTH_MAX + 1)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return None
        if len(body) > HEALTH_MAX:
            log.warning("the engine of %s (slot %s) answered /health with more than %d bytes; ignored",
                        self.name, slot, HEALTH_MAX, extra={"hostd_model": self.name})
            return None
        return engine_health.parse(body)

    async def smoke(self, served_name: str, slot: str = "main") -> None:
        connector = CheckedUnixConnector(path=str(paths.engine_socket(self.name, slot)))
        body = {"model": served_name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
            async with http.post("http://engine/v1/completions", json=body) as response:
                if response.status != 200:
                    head = await _read_at_most(response, SMOKE_ERROR_BYTES)
                    response.close()  # the rest is never read
                    raise VerifyFailed(f"smoke request answered {response.status}: "
                                       f"{head.decode('utf-8', 'replace')}")

    async def rebuild(self, engine: dict, slot: str = "standby") -> EngineHealth:
        """Ask the engine in SLOT (the warm standby; main: in place) to rebuild itself on the
        ENGINE section (hostd/engine/server.py, POST /hostd/rebuild); its
        answer, the /health after the rebuild (with rebuild_s), decoded as
        one. RebuildFailed with the engine's own words when it refuses or
        fails."""
        connector = CheckedUnixConnector(path=str(paths.engine_socket(self.name, slot)))
        try:
            async with aiohttp.ClientSession(connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=REBUILD_TIMEOUT)) as http:
                async with http.post("http://engine/hostd/rebuild", json={"engine": engine}) as response:
                    body = await _read_at_most(response, HEALTH_MAX + 1)
                    status = response.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            raise RebuildFailed(f"the {slot} engine did not answer the rebuild: {exc or type(exc).__name__}") from None
        try:
            answer = json.loads(body) if len(body) <= HEALTH_MAX else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise RebuildFailed(f"the {slot} engine answered the rebuild {status} with no JSON object")
        if status != 200:
            error = str(answer.get("error", ""))[:1000] or f"status {status}"
            raise RebuildFailed(f"the {slot} engine refused the rebuild: {error}")
        health = engine_health.parse(body)
        if health is None:
            raise RebuildFailed(f"the {slot} engine answered the rebuild with no /health of this schema")
        return health

    @staticmethod
    def runs(health: EngineHealth, engine: dict) -> bool:
        """Does the engine whose /health is HEALTH run the ENGINE section? Every
        backend's engine reports the section it was started with."""
        return health.engine_config == engine

    async def verify_engine(self, cfg, weights_before: Optional[tuple[int, int]], slot: str = "main",
                            weights_slot: str = "main", ask_daemon: bool = True,
                            health: Optional[EngineHealth] = None) -> EngineHealth:
        """The engine in SLOT runs CFG's engine section, answers a smoke
        request and attached WEIGHTS_SLOT's weight daemon, the one that was
        WEIGHTS_BEFORE (None: not checked); with ASK_DAEMON that daemon still
        answers as it (a second engine's verify leaves that to the main
        engine's, which follows). HEALTH: its /health as a rebuild answered
        it just now (not asked again). Returns the /health it checked."""
        health = health or await self.engine_health(slot)
        if health is None:
            raise VerifyFailed(f"the engine in slot {slot} does not answer /health")
        if not self.runs(health, msgspec.to_builtins(cfg.engine)):
            raise VerifyFailed(f"the engine runs {health.engine_config}, not the target config")
        await self.smoke(cfg.served_model_name or self.name, slot)
        if weights_before is not None:
            now = await self.weights_identity(weights_slot) if ask_daemon else weights_before
            problem = weights_problem(weights_before, now, health)
            if problem:
                raise VerifyFailed(problem)
        return health

    async def engine_error(self, default: str, slot: str = "main", unit: Optional[str] = None) -> str:
        """The failing engine's own last error lines from the journal, else
        DEFAULT. Only the unit's latest invocation (its InvocationID, matched
        on journald's trusted _SYSTEMD_INVOCATION_ID): the engine that served
        before it logged what clients sent it, and a client must not be able
        to plant the cause a failed reload reports."""
        unit = unit or units.engine(self.name, slot)  # UNIT: another unit's words (a swap's weight daemon)
        try:
            shown = await asyncio.to_thread(
                subprocess.run, ["systemctl", "show", "--property=InvocationID", "--value", unit],
                capture_output=True, text=True, timeout=10)
            invocation = shown.stdout.strip()
            if not re.fullmatch(r"[0-9a-f]{32}", invocation):
                return default
            await self._journal_sync()
            result = await asyncio.to_thread(
                subprocess.run,
                ["journalctl", f"_SYSTEMD_INVOCATION_ID={invocation}", "-p", "err", "-n", "3",
                 "-o", "cat", "--no-pager"],
                capture_output=True, text=True, timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return default
        lines = [l for l in result.stdout.splitlines() if l.strip()]
        return f"{default}: {' | '.join(lines[-2:])}" if lines else default

    @staticmethod
    async def _journal_sync() -> None:
        """journald takes in a unit's output on its own time: read just as the
        engine failed, its last lines may not be there yet. --sync returns once
        everything queued to journald before it is in; a slow or failed one
        (journald busy) still leaves the read to find what it can."""
        try:
            await asyncio.to_thread(subprocess.run, ["journalctl", "--sync"], capture_output=True,
                                    timeout=JOURNAL_SYNC_S)
        except (OSError, subprocess.TimeoutExpired):
            pass

    # ------------------------------------------------------------ preflight (preflight.py's)

    async def read_memory(self, cfg, engine_pid: int, standby_pid: int = 0) -> Memory:
        return await self.preflight.read_memory(cfg, engine_pid, standby_pid)

    def memory_problem(self, cfg, memory: Memory, standby_grows: bool = False) -> Optional[str]:
        return self.preflight.memory_problem(cfg, memory, standby_grows)

    async def gpu_memory(self, cfg, engine_pid: int) -> list[GpuMemory]:
        return await self.preflight.gpu_memory(cfg, engine_pid)

    def in_place_problem(self, cfg, health: Optional[EngineHealth], memory: Memory,
                         alone: bool = False) -> Optional[str]:
        return self.preflight.in_place_problem(cfg, health, memory, alone)

    def overlap_problem(self, cfg, health: Optional[EngineHealth], memory: Memory,
                        weights: int = 0, swap: bool = False) -> Optional[str]:
        return self.preflight.overlap_problem(cfg, health, memory, weights, swap)
