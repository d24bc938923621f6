"""A Python client of hostd's manager (org.hostd1), async and sync.

    async with AsyncClient() as hostd:
        op = await hostd.reload("tiny", {"max_num_seqs": 16})   # waits; returns the Operation's properties
    with Client() as hostd:
        print(hostd.list_models())

Errors come back as dbus_fast DBusError with the manager's error names
(org.hostd1.Error.NotEditable, ...). Patches travel as JSON (ReloadJSON), so
every YAML value, null included, can be expressed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable, Optional

from dbus_fast import BusType
from dbus_fast.aio import MessageBus

BUS_NAME = "org.hostd1"
ROOT_PATH = "/org/hostd1"
OPERATION = "org.hostd1.Operation"
FINAL_STATES = ("done", "rolled-back", "failed", "cancelled")


class AsyncClient:
    def __init__(self, bus_address: Optional[str] = None):
        self._address = bus_address
        self.bus: Optional[MessageBus] = None
        self.manager = None

    async def __aenter__(self) -> "AsyncClient":
        if self._address:
            self.bus = await MessageBus(bus_address=self._address).connect()
        else:
            self.bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        self.manager = await self._interface(ROOT_PATH, "org.hostd1.Manager")
        return self

    async def __aexit__(self, *exc) -> None:
        if self.bus:
            self.bus.disconnect()

    async def _interface(self, path: str, name: str):
        introspection = await self.bus.introspect(BUS_NAME, path)
        return self.bus.get_proxy_object(BUS_NAME, path, introspection).get_interface(name)

    async def _properties(self, path: str, interface: str) -> dict[str, Any]:
        props = await self._interface(path, "org.freedesktop.DBus.Properties")
        values = await props.call_get_all(interface)
        return {k: v.value for k, v in values.items()}

    # ------------------------------------------------------------ reading

    async def list_models(self) -> list[dict]:
        rows = await self.manager.call_list_models()
        return [{"name": n, "state": s, "path": p} for n, s, p in rows]

    async def model(self, name: str) -> dict[str, Any]:
        path = await self.manager.call_get_model(name)
        props = await self._properties(path, "org.hostd1.Model")
        for key in ("Config", "RunningConfig"):
            props[key] = json.loads(props[key] or "{}")
        return props

    async def operations(self) -> list[dict]:
        rows = await self.manager.call_list_operations()
        keys = ("id", "model", "kind", "state", "stage", "path")
        return [dict(zip(keys, row)) for row in rows]

    async def operation(self, path: str) -> dict[str, Any]:
        return await self._properties(path, OPERATION)

    # ------------------------------------------------------------ acting

    async def wait(self, path: str, on_change: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
        """Wait until the operation at PATH ends; ON_CHANGE sees every change."""
        props_iface = await self._interface(path, "org.freedesktop.DBus.Properties")
        changed = asyncio.Event()

        def handler(_iface, _changed, _invalidated):
            changed.set()

        props_iface.on_properties_changed(handler)
        try:
            last = None
            while True:
                props = await self._properties(path, OPERATION)
                if on_change and props != last:
                    on_change(props)
                last = props
                if props["State"] in FINAL_STATES:
                    return props
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
        finally:
            props_iface.off_properties_changed(handler)

    async def reload(self, name: str, patch: Optional[dict] = None, wait: bool = True,
                     on_change: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
        path = await self.manager.call_reload_json(name, json.dumps(patch or {}))
        if not wait:
            return {"path": path}
        return {"path": path, **await self.wait(path, on_change)}

    async def _verb(self, verb: str, name: str, wait: bool) -> dict[str, Any]:
        path = await getattr(self.manager, f"call_{verb}")(name)
        return {"path": path, **(await self.wait(path) if wait else {})}

    async def start(self, name: str, wait: bool = True) -> dict[str, Any]:
        return await self._verb("start", name, wait)

    async def stop(self, name: str, wait: bool = True) -> dict[str, Any]:
        return await self._verb("stop", name, wait)

    async def restart(self, name: str, wait: bool = True) -> dict[str, Any]:
        return await self._verb("restart", name, wait)

    async def cancel(self, op_id: int) -> None:
        path = await self.manager.call_get_operation(op_id)
        op = await self._interface(path, "org.hostd1.Operation")
        await op.call_cancel()


class Client:
    """The same calls, blocking."""

    def __init__(self, bus_address: Optional[str] = None):
        self._async = AsyncClient(bus_address)
        self._loop = asyncio.new_event_loop()

    def __enter__(self) -> "Client":
        self._loop.run_until_complete(self._async.__aenter__())
        return self

    def __exit__(self, *exc) -> None:
        self._loop.run_until_complete(self._async.__aexit__(*exc))
        self._loop.close()

    def __getattr__(self, name: str):
        attribute = getattr(self._async, name)
        if not asyncio.iscoroutinefunction(attribute):
            return attribute
        return lambda *a, **kw: self._loop.run_until_complete(attribute(*a, **kw))
