"""hostd manager: the org.hostd1 service on the system bus (hostd.service).

One job: expose models and operations the way systemd exposes units and jobs,
and run each model's reload (reload.py) when asked.

    /org/hostd1                     org.hostd1.Manager    verbs, OperationFinished
    /org/hostd1/model/<name>        org.hostd1.Model      one per configured model
    /org/hostd1/operation/<id>      org.hostd1.Operation  one per reload/start/stop/restart

Trust: anyone on the system bus may read (the D-Bus policy allows it);
mutating methods are allowed by the policy only to root and the hostd-admin
group, and checked again here: the caller's uid comes from the bus daemon
(GetConnectionUnixUser), never from the message.
"""

import asyncio
import contextvars
import grp
import json
import logging
import pwd
import time
from pathlib import Path
from typing import Optional

import msgspec
from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method, signal

from hostd import config as hostd_config
from hostd import paths
from hostd.config import schema
from hostd.manager import reload as reload_mod
from hostd.manager.probe import Probe
from hostd.manager.systemd1 import Systemd, UnitJobFailed

log = logging.getLogger("hostd.manager")

BUS_NAME = "org.hostd1"
ROOT_PATH = "/org/hostd1"
ERROR = "org.hostd1.Error"
CALLER: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("caller", default=None)
REFRESH_INTERVAL = 2.0


def escape(name: str) -> str:
    """A model name as one D-Bus object path element (like systemd's escaping)."""
    return "".join(c if c.isalnum() and c.isascii() else f"_{ord(c):02x}" for c in name)


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


# ---------------------------------------------------------------- operations


class OperationInterface(ServiceInterface):
    def __init__(self, op: reload_mod.Operation, kind: str):
        super().__init__("org.hostd1.Operation")
        self.op, self.kind = op, kind
        self.path = f"{ROOT_PATH}/operation/{op.id}"

    @dbus_property(access=PropertyAccess.READ)
    def Id(self) -> "u":
        return self.op.id

    @dbus_property(access=PropertyAccess.READ)
    def Model(self) -> "s":
        return self.op.model

    @dbus_property(access=PropertyAccess.READ)
    def Kind(self) -> "s":
        return self.kind

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> "s":
        return self.op.state.value

    @dbus_property(access=PropertyAccess.READ)
    def Stage(self) -> "s":
        return self.op.stage.value

    @dbus_property(access=PropertyAccess.READ)
    def Error(self) -> "s":
        return self.op.error

    @dbus_property(access=PropertyAccess.READ)
    def Patch(self) -> "s":
        return json.dumps(self.op.patch, sort_keys=True)

    @dbus_property(access=PropertyAccess.READ)
    def WeightsReused(self) -> "b":
        return self.op.weights_reused

    @dbus_property(access=PropertyAccess.READ)
    def Restored(self) -> "b":
        return self.op.restored

    @dbus_property(access=PropertyAccess.READ)
    def Notes(self) -> "as":
        return list(self.op.notes)

    @dbus_property(access=PropertyAccess.READ)
    def CreatedUSec(self) -> "t":
        return int(self.op.created * 1e6)

    @dbus_property(access=PropertyAccess.READ)
    def FinishedUSec(self) -> "t":
        return int(self.op.finished * 1e6)

    @method()
    async def Cancel(self):
        await self.manager.require_admin()
        op = self.op
        if op.state != reload_mod.State.RUNNING:
            raise DBusError(f"{ERROR}.NotRunning", f"operation {op.id} already ended ({op.state.value})")
        if op.stage not in (reload_mod.Stage.VALIDATE, reload_mod.Stage.PREFLIGHT,
                            reload_mod.Stage.RECORD, reload_mod.Stage.DRAIN):
            raise DBusError(f"{ERROR}.Busy", f"operation {op.id} is past its drain ({op.stage.value}); it cannot be cancelled now")
        op.cancel_requested = True

    def changed(self) -> None:
        self.emit_properties_changed({
            "State": self.op.state.value, "Stage": self.op.stage.value, "Error": self.op.error,
            "WeightsReused": self.op.weights_reused, "Restored": self.op.restored,
            "Notes": list(self.op.notes), "FinishedUSec": int(self.op.finished * 1e6),
        })


# ---------------------------------------------------------------- models


class ModelInterface(ServiceInterface):
    def __init__(self, manager: "Manager", name: str):
        super().__init__("org.hostd1.Model")
        self.manager, self.model_name = manager, name  # self.name is the interface's
        self.path = f"{ROOT_PATH}/model/{escape(name)}"
        self.state = "unknown"
        self.in_flight = 0
        self.active: Optional[OperationInterface] = None

    def loaded(self) -> Optional[hostd_config.LoadedModel]:
        try:
            return hostd_config.load_model(self.model_name, self.manager.root)
        except hostd_config.ConfigError:
            return None

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
        return json.dumps(msgspec.to_builtins(loaded.config)) if loaded else "{}"

    @dbus_property(access=PropertyAccess.READ)
    def RunningConfig(self) -> "s":
        text = reload_mod.read_text(reload_mod.state_dir(self.model_name) / reload_mod.COMMITTED)
        return text or "{}"

    @dbus_property(access=PropertyAccess.READ)
    def EditableFields(self) -> "as":
        loaded = self.loaded()
        return list(schema.editable_fields(loaded.config.backend)) if loaded else []

    @dbus_property(access=PropertyAccess.READ)
    def WeightsRetained(self) -> "b":
        """Are the weights kept across engine restarts (a reload reuses them)?"""
        return not self.weights_not_retained()

    @dbus_property(access=PropertyAccess.READ)
    def WeightsNotRetainedReason(self) -> "s":
        """Why not, naming the setting; empty when they are retained."""
        return self.weights_not_retained()

    def weights_not_retained(self) -> str:
        from hostd import backends

        loaded = self.loaded()
        if loaded is None:
            return ""
        try:
            return backends.for_config(loaded.config).weights_not_retained(loaded.config) or ""
        except backends.Refused:
            return ""

    @dbus_property(access=PropertyAccess.READ)
    def ActiveOperation(self) -> "o":
        active = self.active
        if active and active.op.state == reload_mod.State.RUNNING:
            return active.path
        return "/"

    @dbus_property(access=PropertyAccess.READ)
    def InFlight(self) -> "u":
        return self.in_flight

    @method()
    async def Reload(self, patch: "a{sv}") -> "o":
        return await self.manager.reload(self.model_name, reload_mod.patch_from_variants(patch))


# ---------------------------------------------------------------- manager


class Manager(ServiceInterface):
    def __init__(self, bus: MessageBus, systemd: Systemd, root: Path):
        super().__init__("org.hostd1.Manager")
        self.bus, self.systemd, self.root = bus, systemd, root
        self.models: dict[str, ModelInterface] = {}
        self.operations: dict[int, OperationInterface] = {}
        self._tasks: set[asyncio.Task] = set()
        self.admin_group = "hostd-admin"
        self._counter_file = paths.manager_state_root() / "next-operation"
        try:
            self._next_id = int(self._counter_file.read_text())
        except (OSError, ValueError):
            self._next_id = 1

    # ------------------------------------------------------------ plumbing

    def keep(self, task: asyncio.Task) -> asyncio.Task:
        """Hold a strong reference until TASK ends (asyncio keeps only weak ones)."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def new_id(self) -> int:
        op_id = self._next_id
        self._next_id += 1
        try:
            reload_mod.write_atomic(self._counter_file, str(self._next_id))
        except OSError as exc:
            log.warning("cannot persist the operation counter: %s", exc)
        return op_id

    async def require_admin(self) -> None:
        sender = CALLER.get()
        if sender is None:
            raise DBusError("org.freedesktop.DBus.Error.AccessDenied", "unknown caller")
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionUnixUser", signature="s", body=[sender],
        ))
        if reply.message_type == MessageType.ERROR:
            raise DBusError("org.freedesktop.DBus.Error.AccessDenied", "cannot tell who the caller is")
        uid = reply.body[0]
        if uid == 0 or self.in_admin_group(uid):
            return
        raise DBusError(
            "org.freedesktop.DBus.Error.AccessDenied",
            f"uid {uid} may not change models: only root and members of {self.admin_group!r} may",
        )

    def in_admin_group(self, uid: int) -> bool:
        try:
            group = grp.getgrnam(self.admin_group)
            user = pwd.getpwuid(uid)
        except KeyError:
            return False
        return user.pw_gid == group.gr_gid or user.pw_name in group.gr_mem

    def model(self, name: str) -> ModelInterface:
        self.discover()
        if name not in self.models:
            raise DBusError(f"{ERROR}.NoSuchModel", f"no model {name!r}: /etc/hostd/models/{name}.yaml does not exist")
        return self.models[name]

    def discover(self) -> None:
        for name in hostd_config.list_models(self.root):
            if name not in self.models and schema.model_name_problem(name) is None:
                iface = ModelInterface(self, name)
                self.models[name] = iface
                self.bus.export(iface.path, iface)

    def new_operation(self, model: str, kind: str, patch: dict) -> OperationInterface:
        """An operation, not yet visible on the bus (see publish)."""
        op = reload_mod.Operation(id=self.new_id(), model=model, patch=patch)
        iface = OperationInterface(op, kind)
        iface.manager = self
        return iface

    def publish(self, iface: OperationInterface) -> None:
        iface.op.on_change = lambda _op: self._changed(iface)
        self.operations[iface.op.id] = iface
        self.bus.export(iface.path, iface)

    def _changed(self, iface: OperationInterface) -> None:
        iface.changed()
        if iface.op.state != reload_mod.State.RUNNING:
            self.OperationFinished(iface.op.id, iface.path, iface.op.model, iface.op.state.value)

    # ------------------------------------------------------------ verbs

    async def reload(self, name: str, patch: dict) -> str:
        await self.require_admin()
        model = self.model(name)
        if model.active and model.active.op.state == reload_mod.State.RUNNING:
            raise DBusError(f"{ERROR}.Busy", f"model {name} is busy with operation {model.active.op.id}; wait for it or cancel it")
        iface = self.new_operation(name, "reload", patch)
        model.active = iface  # Busy for others from here on
        run = reload_mod.Reload(reload_mod.Model(name, self.root, self.systemd, Probe(name)), iface.op)
        try:
            await run.check()
        except reload_mod.Refused as exc:
            model.active = None
            log.warning("reload of %s refused (%s): %s", name, exc.kind, exc, extra={"hostd_model": name})
            raise DBusError(f"{ERROR}.{exc.kind}", str(exc)) from None
        except BaseException:
            model.active = None
            raise
        self.publish(iface)
        self.keep(run.start())
        return iface.path

    async def unit_verb(self, name: str, kind: str) -> str:
        await self.require_admin()
        model = self.model(name)
        running = model.active if model.active and model.active.op.state == reload_mod.State.RUNNING else None
        if running and kind == "stop" and running.kind == "reload":
            running.op.interrupt_requested = True  # the reload gives way to the stop
            log.info("stop of %s interrupts reload %d", name, running.op.id, extra={"hostd_model": name})
        elif running:
            raise DBusError(f"{ERROR}.Busy", f"model {name} is busy with operation {running.op.id}")
        iface = self.new_operation(name, kind, {})
        model.active = iface
        self.publish(iface)

        async def go():
            op = iface.op
            try:
                await getattr(self.systemd, kind)(f"model@{name}.service")
            except Exception as exc:  # a failed job, a bus error: the operation says so
                op.finish(reload_mod.State.FAILED, str(exc))
            else:
                op.finish(reload_mod.State.DONE)

        self.keep(asyncio.create_task(go()))
        return iface.path

    @method()
    def ListModels(self) -> "a(sso)":
        self.discover()
        return [[n, m.state, m.path] for n, m in sorted(self.models.items())]

    @method()
    def GetModel(self, name: "s") -> "o":
        return self.model(name).path

    @method()
    async def Reload(self, name: "s", patch: "a{sv}") -> "o":
        return await self.reload(name, reload_mod.patch_from_variants(patch))

    @method()
    async def ReloadJSON(self, name: "s", patch: "s") -> "o":
        try:
            data = (json.loads(patch) if patch.strip() else None) or {}
        except ValueError as exc:
            raise DBusError(f"{ERROR}.InvalidValue", f"patch is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise DBusError(f"{ERROR}.InvalidValue", "patch must be a JSON object of field: value")
        return await self.reload(name, data)

    @method()
    async def Start(self, name: "s") -> "o":
        return await self.unit_verb(name, "start")

    @method()
    async def Stop(self, name: "s") -> "o":
        return await self.unit_verb(name, "stop")

    @method()
    async def Restart(self, name: "s") -> "o":
        return await self.unit_verb(name, "restart")

    @method()
    def GetOperation(self, op_id: "u") -> "o":
        if op_id not in self.operations:
            raise DBusError(f"{ERROR}.NoSuchOperation", f"no operation {op_id}")
        return self.operations[op_id].path

    @method()
    def ListOperations(self) -> "a(usssso)":
        return [
            [i.op.id, i.op.model, i.kind, i.op.state.value, i.op.stage.value, i.path]
            for i in sorted(self.operations.values(), key=lambda i: i.op.id)
        ]

    @signal()
    def OperationFinished(self, op_id: "u", path: "o", model: "s", result: "s") -> "uoss":
        return [op_id, path, model, result]

    # ------------------------------------------------------------ background

    async def refresh(self) -> None:
        """Keep each model's State and InFlight current."""
        while True:
            self.discover()
            for name, model in list(self.models.items()):
                try:
                    state, in_flight = await self.observe(name, model)
                except Exception as exc:  # one model's trouble must not stop the others' updates
                    log.warning("cannot observe %s: %s", name, exc, extra={"hostd_model": name})
                    continue
                changed = {}
                if state != model.state:
                    model.state = state
                    changed["State"] = state
                if in_flight != model.in_flight:
                    model.in_flight = in_flight
                    changed["InFlight"] = in_flight
                if changed:
                    model.emit_properties_changed(changed)
            await asyncio.sleep(REFRESH_INTERVAL)

    async def observe(self, name: str, model: ModelInterface) -> tuple[str, int]:
        try:
            active = await self.systemd.active_state(f"model@{name}.service")
        except DBusError:
            active = "unknown"
        if model.active and model.active.op.state == reload_mod.State.RUNNING and model.active.kind == "reload":
            return "reloading", model.in_flight
        last = model.active.op if model.active else None
        if last and last.degraded:
            return "degraded", model.in_flight
        if active != "active":
            return {"activating": "starting", "deactivating": "stopping"}.get(active, "stopped"), 0
        status = await Probe(name).gateway_status()
        if status is None:
            return "starting", 0
        return {"serving": "serving", "engine-down": "engine-down", "starting": "starting"}.get(
            status["state"], status["state"]), status["in_flight"]

    async def recover(self) -> None:
        """Finish reloads a previous manager left half done (intent records)."""
        for name in hostd_config.list_models(self.root):
            if schema.model_name_problem(name):
                continue
            intent_path = reload_mod.state_dir(name) / reload_mod.INTENT
            text = reload_mod.read_text(intent_path)
            if not text:
                continue
            try:
                await recover_model(self, name, json.loads(text))
            except Exception:
                log.exception("recovery of %s failed; its intent record stays in %s", name, intent_path,
                              extra={"hostd_model": name})


async def recover_model(manager: Manager, name: str, intent: dict) -> None:
    probe = Probe(name)
    model = reload_mod.Model(name, manager.root, manager.systemd, probe)
    # An engine restarted just before the crash may still be starting: let it
    # finish (or fail) before deciding what it runs.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            state = await manager.systemd.active_state(f"model-engine@{name}.service")
        except DBusError:
            break
        if state not in ("activating", "reloading", "deactivating"):
            break
        await asyncio.sleep(0.5)
    health = await probe.engine_health()
    runs_target = health is not None and Probe.runs(health, intent.get("target_engine") or {})
    if runs_target:
        log.info("recovery: %s runs the target of reload %s; committing", name, intent.get("operation"),
                 extra={"hostd_model": name, "hostd_operation": str(intent.get("operation"))})
        cfg = hostd_config.load_model(name, manager.root).config
        reload_mod.Reload(model, reload_mod.Operation(0, name, {})).write_committed(cfg)
    else:
        log.warning("recovery: %s does not run the target of reload %s; rolling back", name, intent.get("operation"),
                    extra={"hostd_model": name, "hostd_operation": str(intent.get("operation"))})
        directory = hostd_config.dropin_dir(name, manager.root)
        reload_mod.restore_file(directory / reload_mod.RELOAD_DROPIN, intent.get("previous_reload"))
        reload_mod.restore_file(directory / reload_mod.ROLLBACK_DROPIN, intent.get("previous_rollback"))
        # Restart the engine only for a model that runs: never start a stopped one.
        if await manager.systemd.active_state(f"model@{name}.service") in ("active", "reloading"):
            try:
                await manager.systemd.restart(f"model-engine@{name}.service", timeout=1800)
            except (UnitJobFailed, DBusError) as exc:
                log.error("recovery: restarting the engine of %s failed: %s", name, exc)
    try:
        await probe.resume()
    except Exception as exc:  # the gateway may be down; it starts serving on its own then
        log.warning("recovery: resuming %s: %s", name, exc)
    reload_mod.remove_durably(reload_mod.state_dir(name) / reload_mod.INTENT)


async def serve(root: Path) -> None:
    bus = await CallerAwareBus(bus_type=BusType.SYSTEM).connect()
    systemd = await Systemd(bus).connect()
    manager = Manager(bus, systemd, root)
    try:
        manager.admin_group = hostd_config.load_daemon(root).admin_group
    except hostd_config.ConfigError as exc:
        log.error("hostd.yaml: %s; using defaults", exc)
    bus.export(ROOT_PATH, manager)
    manager.discover()
    await bus.request_name(BUS_NAME)
    log.info("manager on the system bus as %s; %d model(s)", BUS_NAME, len(manager.models))
    # Recovery may wait for engines; the bus name is already ours meanwhile.
    manager.keep(asyncio.create_task(manager.recover()))
    refresher = asyncio.create_task(manager.refresh())
    try:
        await bus.wait_for_disconnect()
    finally:
        refresher.cancel()


def run(args) -> int:
    from hostd import logs

    logs.setup("", "manager")
    asyncio.run(serve(hostd_config.config_root(args.config_dir)))
    return 0


def add_arguments(parser) -> None:
    pass
