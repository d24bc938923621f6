"""The manager's client of org.freedesktop.systemd1.

One job: start, stop and restart units the way systemctl does, and wait for
the job to end: Subscribe first, then call the verb, then match JobRemoved on
the job path the call returned (JobRemoved can arrive before the call's reply,
so every finished job is remembered until it is claimed). Unit object paths
come from LoadUnit, never computed.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from dbus_fast.aio import MessageBus

SYSTEMD = "org.freedesktop.systemd1"
PATH = "/org/freedesktop/systemd1"


class UnitJobFailed(Exception):
    def __init__(self, unit: str, verb: str, result: str):
        super().__init__(f"{verb} {unit}: job ended with result '{result}'")
        self.unit, self.verb, self.result = unit, verb, result


class Systemd:
    def __init__(self, bus: MessageBus):
        self.bus = bus
        self.manager = None
        self._finished: dict[str, str] = {}
        self._waiters: dict[str, asyncio.Future] = {}

    async def connect(self) -> "Systemd":
        introspection = await self.bus.introspect(SYSTEMD, PATH)
        proxy = self.bus.get_proxy_object(SYSTEMD, PATH, introspection)
        self.manager = proxy.get_interface(f"{SYSTEMD}.Manager")
        self.manager.on_job_removed(self._job_removed)
        await self.manager.call_subscribe()
        return self

    def _job_removed(self, _id: int, job: str, _unit: str, result: str) -> None:
        waiter = self._waiters.pop(job, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(result)
        else:
            self._finished[job] = result
            if len(self._finished) > 1024:  # jobs nobody waits for
                self._finished.pop(next(iter(self._finished)))

    async def _job(self, verb: str, unit: str, timeout: Optional[float]) -> str:
        call = getattr(self.manager, f"call_{verb}_unit")
        job = await call(unit, "replace")
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

    async def unit_properties(self, unit: str) -> dict:
        """ActiveState, SubState, MainPID (services) and InvocationID of UNIT."""
        path = await self.manager.call_load_unit(unit)
        introspection = await self.bus.introspect(SYSTEMD, path)
        proxy = self.bus.get_proxy_object(SYSTEMD, path, introspection)
        unit_iface = proxy.get_interface(f"{SYSTEMD}.Unit")
        props = {
            "ActiveState": await unit_iface.get_active_state(),
            "SubState": await unit_iface.get_sub_state(),
        }
        if unit.endswith(".service"):
            service = proxy.get_interface(f"{SYSTEMD}.Service")
            props["MainPID"] = await service.get_main_pid()
            props["StatusText"] = await service.get_status_text()
            props["Result"] = await service.get_result()
        return props

    async def active_state(self, unit: str) -> str:
        return (await self.unit_properties(unit))["ActiveState"]
