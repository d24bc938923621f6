"""hostd manager: the org.hostd1 service on the system bus (hostd.service).

One job: describe models and operations on the bus the way systemd describes
units and jobs, and dispatch verbs: a reload to reload.py, start/stop/restart
to systemd. What a reload does, how it ends and how it is recovered after a
crash live in reload.py and recovery.py (which also puts each recovery on the
bus as an Operation); the records on disk in records.py; refusals and their
D-Bus errors in errors.py; names shared with clients in api.py.

    /org/hostd1                     org.hostd1.Manager    verbs, CheckReload, OperationFinished, OperationRemoved
    /org/hostd1/model/<name>        org.hostd1.Model      one per configured model (model_bus.py)
    /org/hostd1/operation/<id>      org.hostd1.Operation  the running ones and the last 64 finished (operation_bus.py)

A model's State follows its units' PropertiesChanged signals (systemd1.py)
and its operations; nothing polls systemd. InFlight is the gateway's count,
read from its control socket every few seconds while the model runs.

Trust: anyone on the system bus may read and call (the D-Bus policy allows
it, as systemd's does); before a mutating method the manager asks polkit
(authority.py, the one room that decides): root always may, the admin group
by org.hostd1.rules, nobody else. The caller's uid comes from the bus daemon
(GetConnectionUnixUser), never from the message.
"""

import asyncio
import json
import logging
from pathlib import Path
from typing import Optional

from dbus_fast import BusType
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method, signal

from hostd import config as hostd_config
from hostd import logs, units
from hostd import systemd as unit_notify
from hostd.config import schema
from hostd.manager import api, dropins, errors, recovery, tasks
from hostd.manager import reload as reload_mod
from hostd.manager import authority
from hostd.manager.authority import Authority, CallerAwareBus, admin
from hostd.manager.errors import replies
from hostd.manager.model_bus import GATEWAY_UP, ModelInterface
from hostd.manager.operation_bus import OperationInterface
from hostd.manager.patch import MAX_PATCH_BYTES, patch_from_variants
from hostd.manager.records import Intent, Records
from hostd.manager.systemd1 import Systemd

log = logging.getLogger("hostd.manager")

IN_FLIGHT_INTERVAL = 2.0


# ---------------------------------------------------------------- manager


def watched_units(model: ModelInterface) -> tuple[str, ...]:
    """The units whose changes concern MODEL: its own, and those an operation
    of it waits on (OperationInterface.waited_unit)."""
    name = model.model_name
    return (*model.units, model.standby_unit, units.engine(name, "next"), units.swap_engine(name),
            units.weights(name, "next"))


class Manager(ServiceInterface):
    def __init__(self, bus: MessageBus, systemd: Systemd, root: Path, records: Optional[Records] = None):
        super().__init__(api.MANAGER)
        self.bus, self.systemd, self.root = bus, systemd, root
        self.authority = Authority(bus)
        self.records = records or Records()
        self.models: dict[str, ModelInterface] = {}
        self.operations: dict[int, OperationInterface] = {}
        self._by_unit: dict[str, ModelInterface] = {}
        # Reload checks need no polkit, so any local user may send them: one
        # model's run one at a time, and a flood of them waits its turn (the
        # bus caps each caller's pending calls) instead of fanning out into
        # parallel YAML parses, engine probes and NVML reads.
        self._check_locks: dict[str, asyncio.Lock] = {}
        systemd.on_unit_change = self._unit_changed

    # ------------------------------------------------------------ plumbing

    @staticmethod
    def keep(task: asyncio.Task) -> asyncio.Task:
        """Hold a strong reference until TASK ends (tasks.keep: the one keeper)."""
        return tasks.keep(task)

    def model(self, name: str) -> ModelInterface:
        """The model NAME; the loader's config.NoSuchModel (its name rule, or no
        NAME.yaml) when there is none."""
        self.discover()
        if name not in self.models:
            hostd_config.load.existing_model_file(name, self.root)
            self.discover()  # the YAML appeared since
        return self.models[name]

    def discover(self) -> None:
        """Export a Model for every model YAML; remove those whose YAML is gone
        (once no operation of theirs runs)."""
        names = {n for n in hostd_config.list_models(self.root) if schema.model_name_problem(n) is None}
        for name in names - set(self.models):
            iface = self.models[name] = ModelInterface(self, name)
            self._by_unit.update(dict.fromkeys(watched_units(iface), iface))
            self.bus.export(iface.path, iface)
            self.keep(asyncio.create_task(self.track(iface)))
        for name in set(self.models) - names:
            iface = self.models[name]
            if iface.busy() is None:
                del self.models[name]
                for unit in watched_units(iface):
                    self._by_unit.pop(unit, None)
                self.bus.unexport(iface.path, iface)
                log.info("model %s removed: its YAML is gone", name, extra={"hostd_model": name})

    async def track(self, model: ModelInterface) -> None:
        """Start following MODEL's units (one GetAll each); signals do the rest."""
        for unit in (*model.units, model.weights_unit, model.standby_unit):
            try:
                await self.systemd.properties(unit)
            except Exception as exc:  # one model's trouble must not stop the others'
                log.warning("cannot look at %s: %s", unit, exc, extra={"hostd_model": model.model_name})
        # The checkpoint's config.json, read once off the loop (cached per
        # identity): the properties any user may read then find it cached.
        await asyncio.to_thread(model.weights_not_retained)
        model.refresh()

    def _unit_changed(self, unit: str, _props: dict) -> None:
        model = self._by_unit.get(unit)
        if model is not None:
            model.refresh()
            running = model.busy()
            if running is not None and unit == running.waited_unit():  # its STATUS= for the operation
                running.emit_properties_changed({"EngineStatus": running.engine_status()})

    def new_operation(self, model: ModelInterface, kind: str, patch: dict) -> OperationInterface:
        """An operation, not yet visible on the bus (see publish); MODEL is busy from here on."""
        iface = OperationInterface(reload_mod.Operation(
            id=self.records.next_operation_id(), model=model.model_name, patch=patch), kind,
            self.systemd, self.authority)
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
            model.degraded = self.records.degraded(model.model_name)  # it may have left it so, or cured it
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

    @staticmethod
    def refuse_if_busy(model: ModelInterface) -> None:
        if model.busy():
            raise errors.Busy(f"model {model.model_name} is busy with operation {model.active.op.id}; "
                              "wait for it or cancel it")

    async def reload(self, name: str, patch: dict) -> str:
        model = self.model(name)
        self.refuse_if_busy(model)
        previous = model.active
        iface = self.new_operation(model, "reload", patch)
        run = reload_mod.Reload(
            model.handles, iface.op)
        try:
            await run.check()
        except BaseException as exc:
            model.active = previous
            if isinstance(exc, errors.Refused):
                log.warning("reload of %s refused (%s): %s", name, exc.kind, exc, extra={"hostd_model": name})
            raise
        self.publish(iface)
        self.keep(asyncio.create_task(run.run()))
        return iface.path

    async def check_reload(self, name: str, patch: dict) -> str:
        """What reload(NAME, PATCH) would do, as JSON (reload.check_only);
        its refusals raised as reload's. Nothing is written, no unit is
        touched and no Operation is made, so any caller may ask (no polkit:
        the answer holds what Model.Config and EditableFields show anyone,
        plus the preflight's memory verdict)."""
        model = self.model(name)
        if any(key in patch for key in schema.SWAPPABLE_KEYS):
            # A checkpoint path makes root look at files of the caller's
            # choosing (and say where a symlink points, how large files
            # are): asked as a reload is asked.
            await self.authority.require(api.RELOAD_ACTION, {"model": name, "verb": "reload"})
        async with self._check_locks.setdefault(name, asyncio.Lock()):
            self.refuse_if_busy(model)
            verdict = await reload_mod.check_only(model.handles, patch)
        log.debug("reload check of %s: %s", name, verdict["outcome"], extra={"hostd_model": name})
        return json.dumps(verdict)

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
        return await self.reload(name, patch_from_variants(patch))

    @method()
    @admin(api.RELOAD_ACTION)
    async def ReloadJSON(self, name: "s", patch: "s") -> "o":
        return await self.reload(name, patch_from_json(patch))

    # Read-only: no polkit (docs/dbus-api.md says why), as ListModels.
    @method()
    @authority.anyone("a dry run of Reload: it changes nothing")
    async def CheckReload(self, name: "s", patch: "a{sv}") -> "s":
        return await self.check_reload(name, patch_from_variants(patch))

    @method()
    @authority.anyone("a dry run of Reload: it changes nothing")
    async def CheckReloadJSON(self, name: "s", patch: "s") -> "s":
        return await self.check_reload(name, patch_from_json(patch))

    # Read-only: what the caller may do, so a client (the Cockpit page) offers
    # no action the manager would refuse, without trying one.
    @method()
    @replies
    async def Access(self, name: "s") -> "a{ss}":
        self.model(name)
        return await authority.access(self.authority, name)

    @method()
    @admin(api.RELOAD_ACTION)
    async def Revert(self, name: "s") -> "o":
        """The manager's drop-ins removed, then a reload (dropins.revert)."""
        model = self.model(name)
        self.refuse_if_busy(model)
        path, note = await dropins.revert(hostd_config.dropin_dir(name, self.root), lambda: self.reload(name, {}),
                                          model.forget)
        log.info("model %s: %s", name, note, extra={"hostd_model": name})
        model.active.op.notes.insert(0, note)
        self._changed(model.active)
        return path

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
                try:  # one model's bad answer must not stop the others' refreshes
                    status = await model.handles.probe.gateway_status()
                    if status:
                        model.refresh(status.in_flight, status.state)
                except Exception as exc:
                    log.warning("in-flight count of %s: %s", name, exc, extra={"hostd_model": name})
            await asyncio.sleep(IN_FLIGHT_INTERVAL)

    def claim_recoveries(self) -> list[tuple[ModelInterface, Intent, OperationInterface]]:
        """A visible recovery Operation for every model left mid-reload (recovery.claim)."""
        return recovery.claim(self)

    async def recover(self, claimed: Optional[list] = None) -> None:
        """End the reloads a previous manager left half done (recovery.recover_claimed)."""
        await recovery.recover_claimed(self, self.claim_recoveries() if claimed is None else claimed)


def patch_from_json(patch: str) -> dict:
    """ReloadJSON's and CheckReloadJSON's patch: a JSON object ("" is {}), weighed
    before it is parsed (patch.MAX_PATCH_BYTES), its nesting refused as any
    other invalid value (a RecursionError is no bug to log with its traceback)."""
    size = len(patch.encode("utf-8", "surrogatepass"))
    if size > MAX_PATCH_BYTES:
        raise errors.InvalidValue(f"patch is {size} bytes of JSON; at most {MAX_PATCH_BYTES} are "
                                  "accepted (an engine's limits take a few hundred)")
    try:
        data = (json.loads(patch) if patch.strip() else None) or {}
    except RecursionError:
        raise errors.InvalidValue("patch is nested too deeply to parse; send a JSON object of field: value") from None
    except ValueError as exc:
        raise errors.InvalidValue(f"patch is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise errors.InvalidValue("patch must be a JSON object of field: value")
    return data


async def serve(root: Path) -> None:
    bus = await CallerAwareBus(bus_type=BusType.SYSTEM).connect()
    systemd = await Systemd(bus).connect()
    manager = Manager(bus, systemd, root)
    try:
        daemon = hostd_config.load_daemon(root)
        manager.authority.admin_group = daemon.admin_group
        logs.apply_level(daemon.log_level)
    except hostd_config.ConfigError as exc:
        log.error("hostd.yaml: %s; using defaults", exc)
    bus.export(api.ROOT_PATH, manager)
    manager.discover()
    claimed = manager.claim_recoveries()  # busy before any call can arrive
    await bus.request_name(api.BUS_NAME)
    log.info("manager on the system bus as %s; %d model(s)", api.BUS_NAME, len(manager.models))
    # Recovery may wait for engines; the bus name is already ours meanwhile.
    manager.keep(asyncio.create_task(manager.recover(claimed)))
    # WatchdogSec= (units/hostd.service): a loop frozen on a read or a lock is restarted.
    manager.keep(asyncio.create_task(unit_notify.feed_watchdog()))
    watcher = asyncio.create_task(manager.watch_in_flight())
    try:
        await bus.wait_for_disconnect()
    finally:
        watcher.cancel()


def run(args) -> int:
    logs.setup("", "manager")
    asyncio.run(serve(hostd_config.config_root(args.config_dir)))
    return 0
