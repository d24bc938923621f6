"""The manager's client of org.freedesktop.systemd1.

One job: start, stop and restart units the way systemctl does (and signal
them, as `systemctl kill` does), and know each unit's state the way machined
does, from signals rather than polling.

- Jobs: Subscribe first, then call the verb, then match JobRemoved on the job
  path the call returned (JobRemoved can arrive before the call's reply, so
  every finished job is remembered until it is claimed).
- Unit state: the first look at a unit is one LoadUnit and one GetAll (every
  interface: ActiveState, SubState, MainPID, ...); from then on the unit's
  PropertiesChanged signals keep that copy current, and reading it costs no
  round trip. systemd flushes a unit's pending PropertiesChanged before the
  JobRemoved of its job, so the copy is current when a job ends. UnitRemoved
  (systemd unloaded an inactive unit) marks the copy inactive, except between
  Reloading(true) and Reloading(false): a daemon-reload sends UnitRemoved for
  every unit, running ones included, and then no PropertiesChanged for those
  whose state did not change, so at its end every copy is read again.

Unit object paths come from LoadUnit, never computed. Calls are plain
messages: no introspection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from dbus_fast import Message, MessageType
from dbus_fast.errors import DBusError

log = logging.getLogger("hostd.manager.systemd1")

SYSTEMD = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"
MANAGER = f"{SYSTEMD}.Manager"
UNIT_PATHS = f"{PATH}/unit"
PROPERTIES = "org.freedesktop.DBus.Properties"
SETTLING = ("activating", "deactivating", "reloading")
# How much longer than a unit's own TimeoutStartSec=/TimeoutStopSec= (the
# model's timeouts.start and timeouts.stop: generator.py) the manager waits for
# a job on it. systemd ends a job that overruns those itself: it kills the
# unit and fails the job (JobRemoved result "timeout"). Waiting a margin past
# them lets that verdict arrive, so the operation reports systemd's word and
# leaves no job of ours still running; a wait of exactly the unit's timeout
# would race it and end in a bare TimeoutError.
JOB_MARGIN = 30.0


def job_timeout(unit_timeout: float) -> float:
    """How long to wait for a job on a unit whose systemd timeout is
    UNIT_TIMEOUT seconds (JOB_MARGIN more)."""
    return unit_timeout + JOB_MARGIN

# The signals the manager needs, and no others (a busy host has many units).
MATCHES = (
    f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}',member='JobRemoved'",
    f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}',member='UnitRemoved'",
    f"type='signal',sender='{SYSTEMD}',interface='{MANAGER}',member='Reloading'",
    f"type='signal',sender='{SYSTEMD}',interface='{PROPERTIES}',member='PropertiesChanged',"
    f"path_namespace='{UNIT_PATHS}'",
)


class UnitJobFailed(Exception):
    def __init__(self, unit: str, verb: str, result: str):
        super().__init__(f"{verb} {unit}: job ended with result '{result}'")
        self.unit, self.verb, self.result = unit, verb, result


class Systemd:
    def __init__(self, bus):
        self.bus = bus
        self._finished: dict[str, str] = {}
        self._waiters: dict[str, asyncio.Future] = {}
        self._paths: dict[str, str] = {}  # unit name -> object path
        self._names: dict[str, str] = {}  # object path -> unit name
        self._units: dict[str, dict] = {}  # unit name -> its properties, kept current
        self._changed: dict[str, asyncio.Event] = {}
        self._daemon_reloading = False  # between Reloading(true) and Reloading(false)
        self._refresh: Optional[asyncio.Task] = None
        self.on_unit_change: Optional[Callable[[str, dict], None]] = None

    async def _call(self, member: str, signature: str = "", body: Optional[list] = None,
                    path: str = PATH, interface: str = MANAGER, destination: str = SYSTEMD) -> list:
        reply = await self.bus.call(Message(
            destination=destination, path=path, interface=interface, member=member,
            signature=signature, body=body or []))
        if reply.message_type == MessageType.ERROR:
            raise DBusError(reply.error_name, (reply.body or [""])[0])
        return reply.body

    async def connect(self) -> "Systemd":
        self.bus.add_message_handler(self._signal)
        for rule in MATCHES:
            await self._call("AddMatch", "s", [rule], path="/org/freedesktop/DBus",
                             interface="org.freedesktop.DBus", destination="org.freedesktop.DBus")
        await self._call("Subscribe")
        return self

    # ------------------------------------------------------------ signals

    def _signal(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.interface == MANAGER and msg.member == "JobRemoved":
            self._job_removed(*msg.body)
        elif msg.interface == MANAGER and msg.member == "UnitRemoved":
            self._unloaded(msg.body[0])
        elif msg.interface == MANAGER and msg.member == "Reloading":
            self._reloading(msg.body[0])
        elif msg.interface == PROPERTIES and msg.member == "PropertiesChanged":
            name = self._names.get(msg.path)
            if name is not None and name in self._units:
                _iface, changed, _invalidated = msg.body
                self._update(name, {k: v.value for k, v in changed.items()})

    def _job_removed(self, _id: int, job: str, _unit: str, result: str) -> None:
        waiter = self._waiters.pop(job, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)
        else:
            self._finished[job] = result
            if len(self._finished) > 1024:  # jobs nobody waits for
                self._finished.pop(next(iter(self._finished)))

    def _unloaded(self, name: str) -> None:
        """systemd unloads only inactive units; its path stays the unit's, and
        PropertiesChanged resume when the unit is loaded again. A daemon-reload
        "removes" every unit: that says nothing of its state."""
        if name in self._units and not self._daemon_reloading:
            self._update(name, {"ActiveState": "inactive", "SubState": "dead", "MainPID": 0})

    def _reloading(self, active: bool) -> None:
        self._daemon_reloading = active
        if not active and self._units:
            self._refresh = asyncio.get_running_loop().create_task(self._read_again())

    async def _read_again(self) -> None:
        """After a daemon-reload: each tracked unit's properties, read anew."""
        for name in list(self._units):
            try:
                values = (await self._call("GetAll", "s", [""], path=self._paths[name], interface=PROPERTIES))[0]
            except DBusError as exc:  # gone with the reload: it is not running
                log.debug("after daemon-reload, %s: %s", name, exc)
                values = {}
                self._unloaded(name)
            if values:
                self._update(name, {k: v.value for k, v in values.items()})

    def _update(self, name: str, changed: dict) -> None:
        props = self._units[name]
        before = props.get("ActiveState")
        props.update(changed)
        event = self._changed.pop(name, None)
        if event is not None:
            event.set()
        if self.on_unit_change and (("ActiveState" in changed and changed["ActiveState"] != before)
                                    or "StatusText" in changed):
            self.on_unit_change(name, dict(props))

    # ------------------------------------------------------------ state

    async def properties(self, unit: str) -> dict:
        """UNIT's properties (ActiveState, SubState, MainPID, StatusText, ...).
        The first call costs LoadUnit + GetAll; later ones read the copy that
        PropertiesChanged keeps current."""
        if unit not in self._units:
            path = self._paths.get(unit) or (await self._call("LoadUnit", "s", [unit]))[0]
            self._paths[unit], self._names[path] = path, unit
            values = (await self._call("GetAll", "s", [""], path=path, interface=PROPERTIES))[0]
            self._units[unit] = {k: v.value for k, v in values.items()}
        return dict(self._units[unit])

    def cached(self, unit: str) -> Optional[dict]:
        """UNIT's properties if they are tracked already (no round trip), else None."""
        props = self._units.get(unit)
        return dict(props) if props is not None else None

    async def active_state(self, unit: str) -> str:
        return (await self.properties(unit))["ActiveState"]

    async def settle(self, unit: str, timeout: float) -> str:
        """Wait (on signals) until UNIT is not activating, deactivating or
        reloading, at most TIMEOUT seconds; its ActiveState then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        state = await self.active_state(unit)
        while state in SETTLING and loop.time() < deadline:
            event = self._changed.setdefault(unit, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
            state = await self.active_state(unit)
        return state

    # ------------------------------------------------------------ jobs

    async def _job(self, verb: str, unit: str, timeout: Optional[float]) -> str:
        [job] = await self._call(f"{verb.capitalize()}Unit", "ss", [unit, "replace"])
        if job in self._finished:
            result = self._finished.pop(job)
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[job] = waiter
            try:
                result = await asyncio.wait_for(waiter, timeout)
            finally:
                self._waiters.pop(job, None)
        if result != "done":
            raise UnitJobFailed(unit, verb, result)
        return result

    async def start(self, unit: str, timeout: Optional[float] = None) -> None:
        await self._job("start", unit, timeout)

    async def stop(self, unit: str, timeout: Optional[float] = None) -> None:
        await self._job("stop", unit, timeout)

    async def restart(self, unit: str, timeout: Optional[float] = None) -> None:
        await self._job("restart", unit, timeout)

    # ------------------------------------------------------------ signals to units

    async def kill(self, unit: str, signum: int, whom: str = "main") -> None:
        """Send SIGNUM to UNIT's processes, as `systemctl kill
        --kill-whom=WHOM` does (KillUnit: no job, systemd sends it at
        once). "main" reaches the main process only, not the children a
        supervisor runs (vLLM, SGLang). systemd does it, not the manager:
        root's manager keeps no CAP_KILL for the models' users."""
        await self._call("KillUnit", "ssi", [unit, whom, signum])
