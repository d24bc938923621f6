"""A Python client of hostd's manager (org.hostd1), async and sync.

    async with AsyncClient() as hostd:
        op = await hostd.reload("tiny", {"max_num_seqs": 16})   # waits; returns the Operation's properties
    with Client() as hostd:
        print(hostd.list_models())

Waiting is systemctl's way: the client subscribes (AddMatch) to the manager's
OperationFinished and the operations' PropertiesChanged when it connects,
before it calls anything; after the call it reads the operation once (GetAll)
and from then on follows the signals (the changes that came before it waited
are kept, so every stage is seen). No polling, no introspection.

Trust: only the manager. The system bus lets any user send a signal to
any connection, whatever match rules name, so the client resolves the owner
of org.hostd1 when it connects, follows its NameOwnerChanged, and drops
every signal from another sender; and before it reports that an operation
ended it reads the operation again with a method call, whose reply only the
manager can send (issue 52: a forged `done` ended `hostctl reload`, and so
ExecReload, while the reload still ran).

Errors come back as dbus_fast DBusError with the manager's error names
(org.hostd1.Error.NotEditable, ...). Patches travel as JSON (ReloadJSON), so
every YAML value, null included, can be expressed.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any, Callable, Optional

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from hostd.manager import api

# Kept for operations not waited on yet (_unclaimed): a few recent ones, each
# its strategy's stages with room to spare.
UNCLAIMED_PATHS = 8
UNCLAIMED_CHANGES = 64

BUS = "org.freedesktop.DBus"
MATCHES = (
    f"type='signal',sender='{api.BUS_NAME}',interface='{api.MANAGER}',member='OperationFinished'",
    f"type='signal',sender='{api.BUS_NAME}',interface='{api.PROPERTIES}',member='PropertiesChanged',"
    f"path_namespace='{api.OPERATION_PATH}'",
    f"type='signal',sender='{BUS}',interface='{BUS}',member='NameOwnerChanged',arg0='{api.BUS_NAME}'",
)


class AsyncClient:
    def __init__(self, bus_address: Optional[str] = None):
        self._address = bus_address
        self.bus: Optional[MessageBus] = None
        self._watching: dict[str, asyncio.Queue] = {}  # operation path -> its signals
        # Changes of operations nobody waits on yet, newest paths last: the
        # stages an operation passed between its method's reply and wait()
        # (the reply and the first signals can come in one read), which
        # wait() shows before the GetAll that is newer than them.
        self._unclaimed: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()
        self._manager: Optional[str] = None  # the unique name owning org.hostd1: the one sender trusted

    async def __aenter__(self) -> "AsyncClient":
        if self._address:
            self.bus = await MessageBus(bus_address=self._address).connect()
        else:
            self.bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        self.bus.add_message_handler(self._signal)
        for rule in MATCHES:
            await self._call("AddMatch", "s", [rule], destination=BUS, path="/org/freedesktop/DBus", interface=BUS)
        try:  # after the match: an owner that changes from here on is seen
            [self._manager] = await self._call("GetNameOwner", "s", [api.BUS_NAME], destination=BUS,
                                               path="/org/freedesktop/DBus", interface=BUS)
        except DBusError:  # not running yet: the first call activates it (NameOwnerChanged names it)
            self._manager = None
        return self

    async def __aexit__(self, *exc) -> None:
        if self.bus:
            self.bus.disconnect()

    async def _call(self, member: str, signature: str = "", body: Optional[list] = None,
                    path: str = api.ROOT_PATH, interface: str = api.MANAGER,
                    destination: str = api.BUS_NAME) -> list:
        reply = await self.bus.call(Message(destination=destination, path=path, interface=interface,
                                            member=member, signature=signature, body=body or []))
        if reply.message_type == MessageType.ERROR:
            raise DBusError(reply.error_name, (reply.body or [""])[0])
        return reply.body

    def _signal(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.sender == BUS and msg.member == "NameOwnerChanged" and msg.body and msg.body[0] == api.BUS_NAME:
            self._manager = msg.body[2] or None
            return
        if self._manager is None or msg.sender != self._manager:
            return  # not the manager's: anyone on the bus may send a signal to us
        if msg.interface == api.MANAGER and msg.member == "OperationFinished":
            self._deliver(msg.body[1], {"State": msg.body[3]})
        elif msg.interface == api.PROPERTIES and msg.member == "PropertiesChanged" and msg.body[0] == api.OPERATION:
            self._deliver(msg.path, {k: v.value for k, v in msg.body[1].items()})

    def _deliver(self, path: str, change: dict) -> None:
        queue = self._watching.get(path)
        if queue is not None:
            queue.put_nowait(change)
            return
        kept = self._unclaimed.setdefault(path, [])
        self._unclaimed.move_to_end(path)
        if len(kept) < UNCLAIMED_CHANGES:
            kept.append(change)
        while len(self._unclaimed) > UNCLAIMED_PATHS:
            self._unclaimed.popitem(last=False)

    async def _properties(self, path: str, interface: str) -> dict[str, Any]:
        [values] = await self._call("GetAll", "s", [interface], path=path, interface=api.PROPERTIES)
        return {k: v.value for k, v in values.items()}

    # ------------------------------------------------------------ reading

    async def list_models(self) -> list[dict]:
        [rows] = await self._call("ListModels")
        return [{"name": n, "state": s, "path": p} for n, s, p in rows]

    async def model_properties(self, name: str) -> dict[str, Any]:
        """Model NAME's org.hostd1.Model properties as the bus gives them (Config: a JSON string)."""
        [path] = await self._call("GetModel", "s", [name])
        return await self._properties(path, api.MODEL)

    async def model(self, name: str) -> dict[str, Any]:
        props = await self.model_properties(name)
        for key in ("Config", "RunningConfig"):
            props[key] = json.loads(props[key] or "{}")
        return props

    async def gpu_memory(self, name: str) -> Any:
        """Model NAME's GpuMemory(), decoded: a list of its GPUs (index, UUIDs, bytes), or {"unreadable": why}."""
        [path] = await self._call("GetModel", "s", [name])
        [text] = await self._call("GpuMemory", path=path, interface=api.MODEL)
        return json.loads(text)

    async def operations(self) -> list[dict]:
        [rows] = await self._call("ListOperations")
        keys = ("id", "model", "kind", "state", "stage", "path")
        return [dict(zip(keys, row)) for row in rows]

    async def operation(self, path: str) -> dict[str, Any]:
        return await self._properties(path, api.OPERATION)

    async def config_problem(self, path: str) -> str:
        """Why the config of the model at PATH does not load ("" when it does)."""
        [value] = await self._call("Get", "ss", [api.MODEL, "ConfigProblem"], path=path, interface=api.PROPERTIES)
        return value.value

    # ------------------------------------------------------------ acting

    async def wait(self, path: str, on_change: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
        """Wait until the operation at PATH ends; ON_CHANGE sees every change.

        One GetAll, then the signals matched since connecting: the manager
        sends its signals and replies in order, so whatever arrives after the
        GetAll reply is newer than it. Changes that came before wait() (the
        stages passed since the call that started the operation) are older
        than the GetAll: ON_CHANGE sees them first, over its answer's other
        properties."""
        queue = self._watching[path] = asyncio.Queue()
        earlier = self._unclaimed.pop(path, [])
        try:
            props = await self.operation(path)
            if on_change:
                passed: dict = {}
                for change in earlier:
                    passed.update(change)
                    if passed.get("Stage") != props.get("Stage"):
                        on_change({**props, **passed})
            while True:
                if on_change:
                    on_change(dict(props))
                if props["State"] in api.FINAL_STATES:
                    return props
                while True:  # apply every change queued, report once
                    props.update(await queue.get())
                    if queue.empty():
                        break
                if props["State"] in api.FINAL_STATES:
                    # The end is the manager's word only: read it again by a call.
                    props = {**props, **await self.operation(path)}
        finally:
            del self._watching[path]

    async def reload(self, name: str, patch: Optional[dict] = None, wait: bool = True,
                     on_change: Optional[Callable[[dict], None]] = None) -> dict[str, Any]:
        [path] = await self._call("ReloadJSON", "ss", [name, json.dumps(patch or {})])
        if not wait:
            return {"path": path}
        return {"path": path, **await self.wait(path, on_change)}

    async def check_reload(self, name: str, patch: Optional[dict] = None) -> dict[str, Any]:
        """What reload(NAME, PATCH) would do, changing nothing (CheckReloadJSON):
        outcome, changes {key: {old, new}}, strategy, reason, notes,
        weights_not_retained. A refusal raises as reload's does."""
        [answer] = await self._call("CheckReloadJSON", "ss", [name, json.dumps(patch or {})])
        return json.loads(answer)

    async def _verb(self, verb: str, name: str, wait: bool, on_change=None) -> dict[str, Any]:
        [path] = await self._call(verb, "s", [name])
        return {"path": path, **(await self.wait(path, on_change) if wait else {})}

    async def start(self, name: str, wait: bool = True, on_change=None) -> dict[str, Any]:
        return await self._verb("Start", name, wait, on_change)

    async def stop(self, name: str, wait: bool = True, on_change=None) -> dict[str, Any]:
        return await self._verb("Stop", name, wait, on_change)

    async def restart(self, name: str, wait: bool = True, on_change=None) -> dict[str, Any]:
        return await self._verb("Restart", name, wait, on_change)

    async def revert(self, name: str, wait: bool = True, on_change=None) -> dict[str, Any]:
        """The manager's drop-ins of model NAME removed, then a reload (Manager.Revert)."""
        return await self._verb("Revert", name, wait, on_change)

    async def set_log_level(self, name: str, role: str, level: str) -> list[dict]:
        """LEVEL in model NAME's running processes of ROLE ("": all of the
        model's) until they restart (Model.SetLogLevel); the processes that
        took it: [{role, unit, pid}]."""
        [path] = await self._call("GetModel", "s", [name])
        [rows] = await self._call("SetLogLevel", "ss", [role, level], path=path, interface=api.MODEL)
        return [{"role": role, "unit": unit, "pid": pid} for role, unit, pid in rows]

    async def cancel(self, op_id: int) -> None:
        [path] = await self._call("GetOperation", "u", [op_id])
        await self._call("Cancel", path=path, interface=api.OPERATION)


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
        return lambda *a, **kw: self._run(attribute(*a, **kw))

    def _run(self, coro):
        """Run CORO to its end; on ^C (KeyboardInterrupt) cancel it first, so
        nothing is left pending on the loop, then let the caller say why."""
        task = self._loop.create_task(coro)
        try:
            return self._loop.run_until_complete(task)
        except KeyboardInterrupt:
            task.cancel()
            try:
                self._loop.run_until_complete(task)
            except BaseException:  # its CancelledError, or whatever it ended with
                pass
            raise
