"""org.hostd1.Model: one object per configured model on the bus, as systemd's
Unit (/org/hostd1/model/<escaped name>): read-only properties that follow the
model's units (their PropertiesChanged, through systemd1.py) and its
operations, Reload and SetLogLevel. The manager (service.py) exports one per model YAML.

Trust: anyone on the bus may read: Config and RunningConfig have env: values
and secret flags' values redacted (secrets of a YAML that may be 0600), and a config's problems are
the loader's messages, which name files, keys and what was expected, never
values. Reload and SetLogLevel ask polkit first (authority.admin);
CheckReload, which changes nothing, does not.
"""

import asyncio
import json
import logging
from pathlib import Path
from typing import Optional

import msgspec
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method

from hostd import backends, host_check, units
from hostd import config as hostd_config
from hostd.config import redact, schema
from hostd.manager import api, log_levels
from hostd.manager import reload as reload_mod
from hostd.manager import authority
from hostd.manager.authority import admin
from hostd.manager.errors import replies
from hostd.manager.operation_bus import OperationInterface
from hostd.manager.patch import patch_from_variants
from hostd.manager.probe import Probe
from hostd.manager.records import Degraded

log = logging.getLogger("hostd.manager")

GPU_MEMORY_CACHE_S = 1.0  # GpuMemory answers from one NVML reading this long (any local user may ask)
GATEWAY_UP = ("serving", "paused", "reloading", "engine-down")  # model States with a gateway to ask


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


REDACTED = redact.REDACTED


def redacted(config: dict) -> dict:
    """CONFIG with its env: values and the values of secret flags in
    extra_args (--hf-token, ...) replaced by REDACTED (hostd/config/redact.py),
    keys and flags kept. Anyone on the bus may read Config and RunningConfig,
    and these hold secrets of a YAML that may be 0640; root reads the files."""
    return redact.config(config)


class ModelInterface(ServiceInterface):
    def __init__(self, manager, name: str):  # MANAGER: service.Manager (not imported: no circle)
        super().__init__(api.MODEL)
        self.manager, self.model_name = manager, name  # self.name is the interface's
        self.authority = manager.authority
        self.path = api.model_path(name)
        self.units = (units.umbrella(name), units.engine(name))
        self.weights_unit = units.weights(name)  # tracked too, for its PID
        self.standby_unit = units.engine(name, "standby")  # tracked too: Standby, StandbyState, StandbyPID
        self.state = "unknown"
        self.in_flight = 0
        self.gateway: Optional[str] = None  # the gateway's own state when last asked; None: not since an operation
        self.active: Optional[OperationInterface] = None
        # A failed rollback's record (records.Degraded), kept on disk: it outlives
        # the next operation and the manager; re-read as each operation ends.
        self.degraded: Optional[Degraded] = manager.records.degraded(name)
        self._stamp: Optional[tuple] = None
        self._loaded: Optional[hostd_config.LoadedModel] = None
        self._problem: Optional[hostd_config.ConfigError] = None
        self._gpu_reading: Optional[tuple] = None  # (when, (config, engine pid), task): GpuMemory's cache
        # What a reload or a recovery acts on: built here only.
        self.handles = reload_mod.ModelHandles(name, manager.root, manager.systemd, Probe(name),
                                               manager.records, self.load)

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
        if active and active.kind in ("reload", "recovery"):  # a recovery finishes a reload
            return "reloading"
        umbrella, engine = (self.manager.systemd.cached(u) or {} for u in self.units)
        state = umbrella.get("ActiveState", "unknown")
        if self.degraded is not None and state in ("deactivating", "inactive", "failed"):
            # Stopped (or restarting): what was degraded is gone with it.
            log.info("model %s: no longer degraded (its umbrella is %s)", self.model_name, state,
                     extra={"hostd_model": self.model_name})
            self.manager.records.clear_degraded(self.model_name)
            self.degraded = None
        if self.degraded is not None:
            return "degraded"
        if state == "active":
            serving = "paused" if self.gateway in ("draining", "paused") else "serving"  # e.g. a resume that failed
            if engine.get("ActiveState") != "active" and self.standby_state() == "active":
                return serving  # the gateway serves from the warm standby meanwhile (a failover)
            return {"active": serving, "activating": "starting", "failed": "failed"}.get(engine.get("ActiveState"), "engine-down")
        return {"activating": "starting", "deactivating": "stopping", "reloading": "reloading",
                "failed": "failed", "unknown": "unknown"}.get(state, "stopped")

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
    def ConfigProblem(self) -> "s":
        """Why the model's config does not load, as the loader says it (one
        problem a line: file, key, what was expected); empty when it loads.
        Read by the manager as root, so it is the truth about a YAML that
        its reader (e.g. hostctl as a user) may not be able to open."""
        try:
            self.load()
        except hostd_config.ConfigError as exc:
            return str(exc)
        return ""

    @dbus_property(access=PropertyAccess.READ)
    def StartProblem(self) -> "s":
        """Why model@NAME.socket refuses to start the model although its
        config loads: a file holding its secrets that others can read (one
        line a file, naming it, who else reads it and the chown/chmod that
        fixes it; hostd/secretfiles.py, the socket's own check); empty when
        none. Read by the manager as root: the files' modes, never a value."""
        return "\n".join(host_check.exposure_warnings(self.manager.root, [self.model_name]))

    @dbus_property(access=PropertyAccess.READ)
    def Config(self) -> "s":
        loaded = self.loaded()
        return json.dumps(redacted(msgspec.to_builtins(loaded.config))) if loaded else "{}"

    @dbus_property(access=PropertyAccess.READ)
    def RunningConfig(self) -> "s":
        """What runs, as last recorded (records.running): a reload's commit,
        or the config on disk at the units' last start if that came later."""
        running = self.manager.records.running(self.model_name)
        if running is None:
            return "{}"
        return json.dumps(msgspec.to_builtins(msgspec.structs.replace(running, fixed=redacted(running.fixed))))

    @dbus_property(access=PropertyAccess.READ)
    def EditableFields(self) -> "as":
        loaded = self.loaded()
        return list(schema.editable_fields(loaded.config.backend)) if loaded else []

    @dbus_property(access=PropertyAccess.READ)
    def EditableSchema(self) -> "s":
        """EditableFields with their types and constraints: the JSON Schema of
        the backend's engine section (schema.editable_schema); "{}" while the
        config does not load."""
        loaded = self.loaded()
        return json.dumps(schema.editable_schema(loaded.config.backend)) if loaded else "{}"

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
        except backends.BackendRefused:
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
                units.instance(units.WEIGHTS_SOCKET, name)] + ([self.standby_unit] if self.standby() else [])

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

    def standby(self) -> bool:
        loaded = self.loaded()
        return bool(loaded and getattr(loaded.config, "standby", False))

    def standby_state(self) -> str:
        """The standby unit's ActiveState; "" for a model without `standby: true`."""
        if not self.standby():
            return ""
        return str((self.manager.systemd.cached(self.standby_unit) or {}).get("ActiveState", "unknown"))

    @dbus_property(access=PropertyAccess.READ)
    def Standby(self) -> "b":
        """The config on disk says standby: true (it takes effect at the model's next start)."""
        return self.standby()

    @dbus_property(access=PropertyAccess.READ)
    def StandbyState(self) -> "s":
        return self.standby_state()

    @dbus_property(access=PropertyAccess.READ)
    def StandbyPID(self) -> "u":
        return self._pid(self.standby_unit) if self.standby() else 0

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
        return await self.manager.reload(self.model_name, patch_from_variants(patch))

    @method()
    @admin(api.LOG_LEVEL_ACTION)
    async def SetLogLevel(self, role: "s", level: "s") -> "a(ssu)":
        """LEVEL (debug, info, warning, error) in the model's running
        processes of ROLE (gateway, engine: every slot, weights, manager;
        "": gateway, engines and weights) until they restart
        (manager/log_levels.py); each process that took it as (role,
        unit, PID)."""
        changed = await log_levels.set_level(self.manager.systemd, self.model_name, role, level)
        return [[c.role, c.unit, c.pid] for c in changed]

    @method()
    @replies
    async def GpuMemory(self) -> "s":
        """NVML's view of the model's GPUs, JSON (read-only; what the reload's
        preflight weighs): a list of {index, uuid ('GPU-…'), mig_uuid ('MIG-…'
        or null), total, free, engine, weights} (bytes, a MIG slice's its own),
        [] for a model on no GPU, or {"unreadable": why}. With `standby: true`
        each entry also has `standby` (the standby's bytes by NVML, null where
        NVML does not list its PID), `standby_kv_bytes` and `standby_kv_budget`
        (its /health: "idle" while it waits, "full" while it serves)."""
        loaded = self.loaded()
        if loaded is None:
            return json.dumps([])
        standby_pid = self._pid(self.standby_unit) if self.standby() else 0
        memory = await self._gpu_memory(loaded.config, self._pid(self.units[1]), standby_pid)
        if memory.gpus is None:
            return json.dumps({"unreadable": memory.unreadable} if memory.unreadable else [])
        standby = {}
        if self.standby():
            health = await self.handles.probe.engine_health("standby")
            standby = {"standby_kv_bytes": _known(getattr(health, "kv_cache_bytes", None)),
                       "standby_kv_budget": _known(getattr(health, "kv_budget", None))}
        return json.dumps([{"index": g.index, "uuid": g.uuid, "mig_uuid": g.mig_uuid or None,
                            "total": g.total, "free": g.free, "engine": g.engine,
                            "weights": g.daemon, **({"standby": g.standby, **standby} if self.standby() else {})}
                           for g in memory.gpus])

    async def _gpu_memory(self, cfg, engine_pid: int, standby_pid: int = 0):
        """GpuMemory's reading: any caller may ask, so one reading of the same
        config and engines serves every call within GPU_MEMORY_CACHE_S, those
        that arrive while it runs included (NVML is never asked in parallel)."""
        loop = asyncio.get_running_loop()
        key = (msgspec.json.encode(cfg), engine_pid, standby_pid)
        cached = self._gpu_reading
        if cached is None or cached[1] != key or loop.time() - cached[0] > GPU_MEMORY_CACHE_S:
            cached = self._gpu_reading = (loop.time(), key, asyncio.ensure_future(
                self.handles.probe.read_memory(cfg, engine_pid, standby_pid)))
        return await asyncio.shield(cached[2])  # a caller that leaves does not cancel the others' reading

    @method()
    @authority.anyone("a dry run of Reload: it changes nothing")
    async def CheckReload(self, patch: "a{sv}") -> "s":
        """What Reload(PATCH) would do, JSON (Manager.CheckReload); read-only."""
        return await self.manager.check_reload(self.model_name, patch_from_variants(patch))


def _known(value):
    """VALUE, or None for msgspec's UNSET (a field an engine's /health did not send)."""
    return None if value is msgspec.UNSET else value
