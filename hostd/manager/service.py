"""hostd manager: the org.hostd1 service on the system bus (hostd.service).

One job: describe models and operations on the bus the way systemd describes
units and jobs, and dispatch verbs: a reload to reload.py, start/stop/restart
to systemd. What a reload does, how it ends and how it is recovered after a
crash live in reload.py; the records on disk in records.py; refusals and their
D-Bus errors in errors.py; names shared with clients in api.py.

    /org/hostd1                     org.hostd1.Manager    verbs, OperationFinished, OperationRemoved
    /org/hostd1/model/<name>        org.hostd1.Model      one per configured model
    /org/hostd1/operation/<id>      org.hostd1.Operation  the running ones and the last 64 finished (operation_bus.py)

A model's State follows its units' PropertiesChanged signals (systemd1.py)
and its operations; nothing polls systemd. InFlight is the gateway's count,
read from its control socket every few seconds while the model runs.

Trust: anyone on the system bus may read and call (the D-Bus policy allows
it, as systemd's does); before a mutating method the manager asks polkit
(errors.admin, errors.authorize): root always may, the admin group by
org.hostd1.rules, nobody else. The caller's uid comes from the bus daemon
(GetConnectionUnixUser), never from the message.
"""

import asyncio
import contextvars
import json
import logging
from pathlib import Path
from typing import Optional

import msgspec
from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method, signal

from hostd import backends, units
from hostd import config as hostd_config
from hostd.config import schema
from hostd.manager import api, errors, recovery
from hostd.manager import reload as reload_mod
from hostd.manager.errors import admin, replies
from hostd.manager.operation_bus import OperationInterface
from hostd.manager.probe import Probe
from hostd.manager.records import Records
from hostd.manager.systemd1 import Systemd

log = logging.getLogger("hostd.manager")

CALLER: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("caller", default=None)
IN_FLIGHT_INTERVAL = 2.0
GATEWAY_UP = ("serving", "paused", "reloading", "engine-down")  # model States with a gateway to ask


class CallerAwareBus(MessageBus):
    """Makes the sender of the method call being handled available in CALLER
    (dbus-fast does not pass it to method handlers)."""

    def _make_method_handler(self, interface, method_):
        inner = super()._make_method_handler(interface, method_)

        def handler(msg, send_reply):
            token = CALLER.set(msg.sender)
            try:
                return inner(msg, send_reply)
            finally:
                CALLER.reset(token)

        return handler


# ---------------------------------------------------------------- models


def config_stamp(name: str, root: Path) -> tuple:
    """What the model's parsed config depends on, cheaply: every file's mtime and size."""
    files = [hostd_config.model_file(name, root), hostd_config.config_root(root) / "hostd.yaml"]
    directory = hostd_config.dropin_dir(name, root)
    try:
        files += sorted(directory.iterdir())
    except OSError:
        pass
    stamp = []
    for path in files:
        try:
            st = path.stat()
            stamp.append((path.name, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamp.append((path.name, None))
    return tuple(stamp)


REDACTED = "<redacted>"


def redacted(config: dict) -> dict:
    """CONFIG with its env: values replaced by REDACTED, keys kept. Anyone on
    the bus may read Config and RunningConfig, and env: holds secrets
    (HF_TOKEN) of a YAML that may be 0600; root reads the files themselves."""
    env = config.get("env")
    return {**config, "env": dict.fromkeys(env, REDACTED)} if isinstance(env, dict) else config


class ModelInterface(ServiceInterface):
    def __init__(self, manager: "Manager", name: str):
        super().__init__(api.MODEL)
        self.manager, self.model_name = manager, name  # self.name is the interface's
        self.path = api.model_path(name)
        self.units = (units.umbrella(name), units.engine(name))
        self.weights_unit = units.weights(name)  # tracked too, for its PID
        self.state = "unknown"
        self.in_flight = 0
        self.gateway: Optional[str] = None  # the gateway's own state when last asked; None: not since an operation
        self.active: Optional[OperationInterface] = None
        self._stamp: Optional[tuple] = None
        self._loaded: Optional[hostd_config.LoadedModel] = None
        self._problem: Optional[hostd_config.ConfigError] = None

    def load(self) -> hostd_config.LoadedModel:
        """The model's effective config, parsed again only when a file changed."""
        stamp = config_stamp(self.model_name, self.manager.root)
        if stamp != self._stamp:
            self._stamp, self._loaded, self._problem = stamp, None, None
            try:
                self._loaded = hostd_config.load_model(self.model_name, self.manager.root)
            except hostd_config.ConfigError as exc:
                self._problem = exc
        if self._problem is not None:
            raise self._problem
        return self._loaded

    def loaded(self) -> Optional[hostd_config.LoadedModel]:
        try:
            return self.load()
        except hostd_config.ConfigError:
            return None

    def forget(self) -> None:
        self._stamp = None

    def busy(self) -> Optional[OperationInterface]:
        return self.active if self.active and self.active.running else None

    def compute_state(self) -> str:
        active = self.busy()
        if active and active.kind == "reload":
            return "reloading"
        if self.active and self.active.op.degraded:
            return "degraded"
        umbrella, engine = (self.manager.systemd.cached(u) or {} for u in self.units)
        state = umbrella.get("ActiveState", "unknown")
        if state == "active":
            serving = "paused" if self.gateway in ("draining", "paused") else "serving"  # e.g. a resume that failed
            return {"active": serving, "activating": "starting"}.get(engine.get("ActiveState"), "engine-down")
        return {"activating": "starting", "deactivating": "stopping", "reloading": "reloading",
                "unknown": "unknown"}.get(state, "stopped")

    def refresh(self, in_flight: Optional[int] = None, gateway: Optional[str] = None) -> None:
        if gateway is not None:
            self.gateway = gateway
        changed = {}
        state = self.compute_state()
        if state != self.state:
            self.state = changed["State"] = state
        if state not in GATEWAY_UP:
            in_flight = 0
        if in_flight is not None and in_flight != self.in_flight:
            self.in_flight = changed["InFlight"] = in_flight
        if changed:
            self.emit_properties_changed(changed)

    @dbus_property(access=PropertyAccess.READ)
    def Name(self) -> "s":
        return self.model_name

    @dbus_property(access=PropertyAccess.READ)
    def Backend(self) -> "s":
        loaded = self.loaded()
        return loaded.config.backend if loaded else ""

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> "s":
        return self.state

    @dbus_property(access=PropertyAccess.READ)
    def Config(self) -> "s":
        loaded = self.loaded()
        return json.dumps(redacted(msgspec.to_builtins(loaded.config))) if loaded else "{}"

    @dbus_property(access=PropertyAccess.READ)
    def RunningConfig(self) -> "s":
        committed = self.manager.records.committed(self.model_name)
        if committed is None:
            return "{}"
        return json.dumps({**committed, "fixed": redacted(committed.get("fixed") or {})})

    @dbus_property(access=PropertyAccess.READ)
    def EditableFields(self) -> "as":
        loaded = self.loaded()
        return list(schema.editable_fields(loaded.config.backend)) if loaded else []

    @dbus_property(access=PropertyAccess.READ)
    def WeightsRetained(self) -> "b":
        """Does a weight cache daemon hold the weights now, so that engine
        restarts attach them (a reload reuses them)? False for a model whose
        config cannot retain them (WeightsNotRetainedReason) or whose weights
        unit is not active."""
        active = (self.manager.systemd.cached(self.weights_unit) or {}).get("ActiveState") == "active"
        return active and not self.weights_not_retained()

    @dbus_property(access=PropertyAccess.READ)
    def WeightsNotRetainedReason(self) -> "s":
        """Why not, naming the setting; empty when they are retained."""
        return self.weights_not_retained()

    def weights_not_retained(self) -> str:
        loaded = self.loaded()
        if loaded is None:
            return ""
        try:
            return backends.for_config(loaded.config).weights_not_retained(loaded.config) or ""
        except backends.Refused:
            return ""

    @dbus_property(access=PropertyAccess.READ)
    def ActiveOperation(self) -> "o":
        active = self.busy()
        return active.path if active else "/"

    @dbus_property(access=PropertyAccess.READ)
    def InFlight(self) -> "u":
        return self.in_flight

    # What a script needs without a second tool (read with Get/GetAll; they
    # follow the units, so only State and InFlight send PropertiesChanged).

    @dbus_property(access=PropertyAccess.READ)
    def Units(self) -> "as":
        name = self.model_name
        return [units.umbrella(name), units.socket(name), units.engine(name), units.weights(name),
                units.instance(units.WEIGHTS_SOCKET, name)]

    def _pid(self, unit: str) -> int:
        return int((self.manager.systemd.cached(unit) or {}).get("MainPID", 0) or 0)

    @dbus_property(access=PropertyAccess.READ)
    def GatewayPID(self) -> "u":
        return self._pid(self.units[0])

    @dbus_property(access=PropertyAccess.READ)
    def EnginePID(self) -> "u":
        return self._pid(self.units[1])

    @dbus_property(access=PropertyAccess.READ)
    def WeightsPID(self) -> "u":
        return self._pid(self.weights_unit)

    @dbus_property(access=PropertyAccess.READ)
    def EngineStatus(self) -> "s":
        return str((self.manager.systemd.cached(self.units[1]) or {}).get("StatusText", ""))

    @dbus_property(access=PropertyAccess.READ)
    def Listen(self) -> "s":
        loaded = self.loaded()
        return str(loaded.config.listen) if loaded else ""

    @dbus_property(access=PropertyAccess.READ)
    def LastOperation(self) -> "o":
        """The model's latest operation, running or finished, while it is on the bus."""
        last = self.active
        return last.path if last is not None and last.op.id in self.manager.operations else "/"

    @method()
    @admin(api.RELOAD_ACTION)
    async def Reload(self, patch: "a{sv}") -> "o":
        return await self.manager.reload(self.model_name, reload_mod.patch_from_variants(patch))


# ---------------------------------------------------------------- manager


class Manager(ServiceInterface):
    def __init__(self, bus: MessageBus, systemd: Systemd, root: Path, records: Optional[Records] = None):
        super().__init__(api.MANAGER)
        self.bus, self.systemd, self.root = bus, systemd, root
        self.manager = self  # for errors.admin
        self.records = records or Records()
        self.models: dict[str, ModelInterface] = {}
        self.operations: dict[int, OperationInterface] = {}
        self._by_unit: dict[str, ModelInterface] = {}
        self._tasks: set[asyncio.Task] = set()
        self.admin_group = "hostd-admin"
        systemd.on_unit_change = self._unit_changed

    # ------------------------------------------------------------ plumbing

    def keep(self, task: asyncio.Task) -> asyncio.Task:
        """Hold a strong reference until TASK ends (asyncio keeps only weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def require_admin(self, action: str = api.MANAGE_ACTION) -> None:
        sender = CALLER.get()
        if sender is None:
            raise errors.AccessDenied("unknown caller")
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionUnixUser", signature="s", body=[sender],
        ))
        if reply.message_type == MessageType.ERROR:
            raise errors.AccessDenied("cannot tell who the caller is")
        await errors.authorize(self.bus, sender, reply.body[0], action, self.admin_group)

    def model(self, name: str) -> ModelInterface:
        self.discover()
        if name not in self.models:
            problem = schema.model_name_problem(name)
            if problem is not None:  # never a path built from it: "../models/x" names no file
                raise errors.NoSuchModel(problem)
            raise errors.NoSuchModel(
                f"no model {name!r}: {hostd_config.model_file(name, self.root)} does not exist")
        return self.models[name]

    def discover(self) -> None:
        """Export a Model for every model YAML; remove those whose YAML is gone
        (once no operation of theirs runs)."""
        names = {n for n in hostd_config.list_models(self.root) if schema.model_name_problem(n) is None}
        for name in names - set(self.models):
            iface = self.models[name] = ModelInterface(self, name)
            self._by_unit.update(dict.fromkeys(iface.units, iface))
            self.bus.export(iface.path, iface)
            self.keep(asyncio.create_task(self.track(iface)))
        for name in set(self.models) - names:
            iface = self.models[name]
            if iface.busy() is None:
                del self.models[name]
                for unit in iface.units:
                    self._by_unit.pop(unit, None)
                self.bus.unexport(iface.path, iface)
                log.info("model %s removed: its YAML is gone", name, extra={"hostd_model": name})

    async def track(self, model: ModelInterface) -> None:
        """Start following MODEL's units (one GetAll each); signals do the rest."""
        for unit in (*model.units, model.weights_unit):
            try:
                await self.systemd.properties(unit)
            except Exception as exc:  # one model's trouble must not stop the others'
                log.warning("cannot look at %s: %s", unit, exc, extra={"hostd_model": model.model_name})
        model.refresh()

    def _unit_changed(self, unit: str, _props: dict) -> None:
        model = self._by_unit.get(unit)
        if model is not None:
            model.refresh()
            running = model.busy()
            if running is not None and unit == model.units[1]:  # the engine's STATUS= for the operation
                running.emit_properties_changed({"EngineStatus": running.engine_status()})

    def new_operation(self, model: ModelInterface, kind: str, patch: dict) -> OperationInterface:
        """An operation, not yet visible on the bus (see publish); MODEL is busy from here on."""
        iface = OperationInterface(self, reload_mod.Operation(
            id=self.records.next_operation_id(), model=model.model_name, patch=patch), kind)
        model.active = iface
        return iface

    def publish(self, iface: OperationInterface) -> None:
        iface.op.on_change = lambda _op: self._changed(iface)
        self.operations[iface.op.id] = iface
        self.bus.export(iface.path, iface)
        self._changed(iface)

    def _changed(self, iface: OperationInterface) -> None:
        iface.changed()
        model = self.models.get(iface.op.model)
        if model is not None and not iface.running:
            model.forget()  # the reload may have rewritten its drop-ins
            model.gateway = None  # the operation resumed it (or says why not)
        if model is not None:
            model.refresh()
        if not iface.running:
            self.OperationFinished(iface.op.id, iface.path, iface.op.model, iface.op.state.value)
            self.prune()

    def prune(self) -> None:
        """Keep the last api.KEEP_OPERATIONS finished operations on the bus."""
        finished = sorted(i for i, iface in self.operations.items() if not iface.running)
        for op_id in finished[: max(0, len(finished) - api.KEEP_OPERATIONS)]:
            iface = self.operations.pop(op_id)
            self.bus.unexport(iface.path, iface)
            self.OperationRemoved(op_id, iface.path, iface.op.model)

    # ------------------------------------------------------------ verbs

    async def reload(self, name: str, patch: dict) -> str:
        model = self.model(name)
        if model.busy():
            raise errors.Busy(f"model {name} is busy with operation {model.active.op.id}; wait for it or cancel it")
        previous = model.active
        iface = self.new_operation(model, "reload", patch)
        run = reload_mod.Reload(
            reload_mod.Model(name, self.root, self.systemd, Probe(name), self.records, model.load), iface.op)
        try:
            await run.check()
        except BaseException as exc:
            model.active = previous
            if isinstance(exc, errors.Refused):
                log.warning("reload of %s refused (%s): %s", name, exc.kind, exc, extra={"hostd_model": name})
            raise
        self.publish(iface)
        self.keep(run.start())
        return iface.path

    async def unit_verb(self, name: str, kind: str) -> str:
        model = self.model(name)
        running = model.busy()
        if running and kind == "stop" and running.kind == "reload":
            running.op.interrupt()  # the reload gives way to the stop
            log.info("stop of %s interrupts reload %d", name, running.op.id, extra={"hostd_model": name})
        elif running:
            raise errors.Busy(f"model {name} is busy with operation {running.op.id}")
        iface = self.new_operation(model, kind, {})
        self.publish(iface)

        async def go():
            op = iface.op
            try:
                await getattr(self.systemd, kind)(model.units[0])
            except Exception as exc:  # a failed job, a bus error: the operation says so
                op.finish(reload_mod.State.FAILED, str(exc))
            else:
                op.finish(reload_mod.State.DONE)

        self.keep(asyncio.create_task(go()))
        return iface.path

    @method()
    @replies
    def ListModels(self) -> "a(sso)":
        self.discover()
        return [[n, m.state, m.path] for n, m in sorted(self.models.items())]

    @method()
    @replies
    def GetModel(self, name: "s") -> "o":
        return self.model(name).path

    @method()
    @admin(api.RELOAD_ACTION)
    async def Reload(self, name: "s", patch: "a{sv}") -> "o":
        return await self.reload(name, reload_mod.patch_from_variants(patch))

    @method()
    @admin(api.RELOAD_ACTION)
    async def ReloadJSON(self, name: "s", patch: "s") -> "o":
        try:
            data = (json.loads(patch) if patch.strip() else None) or {}
        except ValueError as exc:
            raise errors.InvalidValue(f"patch is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise errors.InvalidValue("patch must be a JSON object of field: value")
        return await self.reload(name, data)

    @method()
    @admin(api.MANAGE_ACTION)
    async def Start(self, name: "s") -> "o":
        return await self.unit_verb(name, "start")

    @method()
    @admin(api.MANAGE_ACTION)
    async def Stop(self, name: "s") -> "o":
        return await self.unit_verb(name, "stop")

    @method()
    @admin(api.MANAGE_ACTION)
    async def Restart(self, name: "s") -> "o":
        return await self.unit_verb(name, "restart")

    @method()
    @replies
    def GetOperation(self, op_id: "u") -> "o":
        if op_id not in self.operations:
            raise errors.NoSuchOperation(f"no operation {op_id}")
        return self.operations[op_id].path

    @method()
    @replies
    def ListOperations(self) -> "a(usssso)":
        return [
            [i.op.id, i.op.model, i.kind, i.op.state.value, i.op.stage.value, i.path]
            for i in sorted(self.operations.values(), key=lambda i: i.op.id)
        ]

    @signal()
    def OperationFinished(self, op_id: "u", path: "o", model: "s", result: "s") -> "uoss":
        return [op_id, path, model, result]

    @signal()
    def OperationRemoved(self, op_id: "u", path: "o", model: "s") -> "uos":
        return [op_id, path, model]

    # ------------------------------------------------------------ background

    async def watch_in_flight(self) -> None:
        """The gateways' in-flight counts (their control sockets; not systemd),
        and models whose YAML appeared or went away."""
        while True:
            self.discover()
            for name, model in list(self.models.items()):
                if model.state not in GATEWAY_UP:
                    continue
                status = await Probe(name).gateway_status()
                if status:
                    model.refresh(status["in_flight"], status["state"])
            await asyncio.sleep(IN_FLIGHT_INTERVAL)

    async def recover(self) -> None:
        """End reloads a previous manager left half done (recovery.recover)."""
        for name, model in list(self.models.items()):
            intent = self.records.intent(name)
            if intent is None:
                continue
            where = reload_mod.Model(name, self.root, self.systemd, Probe(name), self.records, model.load)
            try:
                outcome = await recovery.recover(where, intent)
                log.info("recovery: %s %s", name, outcome, extra={"hostd_model": name})
            except Exception:
                log.exception("recovery of %s failed; its intent record stays in %s", name,
                              self.records.intent_path(name), extra={"hostd_model": name})
            model.forget()
            model.refresh()


async def serve(root: Path) -> None:
    bus = await CallerAwareBus(bus_type=BusType.SYSTEM).connect()
    systemd = await Systemd(bus).connect()
    manager = Manager(bus, systemd, root)
    try:
        manager.admin_group = hostd_config.load_daemon(root).admin_group
    except hostd_config.ConfigError as exc:
        log.error("hostd.yaml: %s; using defaults", exc)
    bus.export(api.ROOT_PATH, manager)
    manager.discover()
    await bus.request_name(api.BUS_NAME)
    log.info("manager on the system bus as %s; %d model(s)", api.BUS_NAME, len(manager.models))
    # Recovery may wait for engines; the bus name is already ours meanwhile.
    manager.keep(asyncio.create_task(manager.recover()))
    watcher = asyncio.create_task(manager.watch_in_flight())
    try:
        await bus.wait_for_disconnect()
    finally:
        watcher.cancel()


def run(args) -> int:
    from hostd import logs

    logs.setup("", "manager")
    asyncio.run(serve(hostd_config.config_root(args.config_dir)))
    return 0
