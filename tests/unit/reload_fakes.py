"""A fake systemd on a fake bus and a fake probe, for driving the reload state
machine (hostd/manager/reload.py) and its recovery in milliseconds.

FakeBus answers the D-Bus messages hostd's real systemd client
(hostd/manager/systemd1.py) sends, the way systemd 252 does: LoadUnit,
GetAll, {Start,Stop,Restart}Unit with a JobRemoved after the unit's
PropertiesChanged, and KillUnit (recorded in `kills`). It counts every message sent, so a test can say how many
round trips a reload costs. FakeProbe stands for the gateway, engine and
weight daemon: the engine "runs" whatever the config on disk says when it is
restarted, unless the test makes its start fail; it asks the model's backend
whether a second engine may run (Backend.overlap_refusal), as the real probe
does, so an upstream model is never driven through an overlap the product
refuses, and reports the next slot's bridge budget as the real supervisor does.
With World(standby=True) the model has a warm standby: its slot "runs" a
config too, and FakeProbe.rebuild puts the section it is given there (or
refuses, with fail_rebuild), as the standby engine's rebuild verb does.
The weight daemon has an identity (pid, socket inode), a new one each time
model-weights@NAME starts (FakeProbe.daemon_restarted); an engine reports on
/health the identity it attached when it started, and verify applies the
product's own "same weight daemon" rule (probe.weights_problem) to it.
The daemon answers a real weights/protocol Status holding the checkpoint
the config on disk named when it started, and a checkpoint swap runs too:
model-weights-next@NAME holds the target's checkpoint, model-engine-swap@NAME
serves the next slot from it, and every engine reports the content digest
of the checkpoint it attached (FakeProbe.digest).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import msgspec
import yaml
from dbus_fast import Message, Variant

from hostd import backends, config, units
from hostd.gateway import control
from hostd.manager import recovery
from hostd.manager import reload as R
from hostd.engine.health import EngineHealth
from hostd.manager.probe import Memory, Probe, RebuildFailed, VerifyFailed, identity, weights_problem
from hostd.manager.records import Intent, Records
from hostd.manager.systemd1 import MANAGER, PATH, PROPERTIES, Systemd
from hostd.weights.protocol import Fingerprint, Status


def unit_path(name: str) -> str:
    return f"{PATH}/unit/" + "".join(c if c.isalnum() else f"_{ord(c):02x}" for c in name)


class FakeBus:
    """The system bus with systemd behind it."""

    unique_name = ":1.1"

    def __init__(self, world: "World"):
        self.world = world
        self.exported = {}
        self.handlers = []
        self.sent: list[str] = []  # "Interface.Member" of every call, in order
        self.units: dict[str, dict] = {}
        self.job_results: dict[str, list[str]] = {}  # unit -> results of its next jobs
        self.jobs = 0
        self.job_log: list[tuple[str, str]] = []  # (start|stop|restart, unit) of every job asked for
        self.kills: list[tuple[str, str, int]] = []  # (unit, whom, signal) of every KillUnit

    exported: dict[str, object]

    def export(self, path: str, interface) -> None:
        self.exported[path] = interface

    def unexport(self, path: str, interface=None) -> None:
        del self.exported[path]

    def add_message_handler(self, handler) -> None:
        self.handlers.append(handler)

    def unit(self, name: str) -> dict:
        return self.units.setdefault(name, {"ActiveState": "active", "SubState": "running", "MainPID": 100})

    def emit(self, path: str, interface: str, member: str, signature: str, body: list) -> None:
        msg = Message.new_signal(path, interface, member, signature, body)
        for handler in list(self.handlers):
            handler(msg)

    def set_status(self, name: str, text: str) -> None:
        """NAME's STATUS= (sd_notify) changed, as systemd says it: StatusText."""
        self.unit(name)["StatusText"] = text
        self.emit(unit_path(name), PROPERTIES, "PropertiesChanged", "sa{sv}as",
                  ["org.freedesktop.systemd1.Unit", {"StatusText": Variant("s", text)}, []])

    def set_state(self, name: str, state: str) -> None:
        self.unit(name)["ActiveState"] = state
        self.emit(unit_path(name), PROPERTIES, "PropertiesChanged", "sa{sv}as",
                  ["org.freedesktop.systemd1.Unit", {"ActiveState": Variant("s", state)}, []])

    async def call(self, msg: Message) -> Message:
        self.sent.append(f"{msg.interface}.{msg.member}")
        msg.serial = len(self.sent)  # the real bus numbers the messages it sends
        await asyncio.sleep(0)
        if msg.member in ("AddMatch", "Subscribe"):
            return Message.new_method_return(msg)
        if msg.member == "LoadUnit":
            self.unit(msg.body[0])
            return Message.new_method_return(msg, "o", [unit_path(msg.body[0])])
        if msg.member == "GetAll":
            [name] = [n for n in self.units if unit_path(n) == msg.path]
            props = self.unit(name)
            values = {"ActiveState": Variant("s", props["ActiveState"]), "SubState": Variant("s", props["SubState"]),
                      "MainPID": Variant("u", props["MainPID"]), "Id": Variant("s", name)}
            return Message.new_method_return(msg, "a{sv}", [values])
        if msg.member in ("StartUnit", "StopUnit", "RestartUnit"):
            self.job_log.append((msg.member[:-4].lower(), msg.body[0]))
            self.jobs += 1
            job = f"{PATH}/job/{self.jobs}"
            asyncio.get_running_loop().create_task(self.run_job(msg.member[:-4].lower(), msg.body[0], job))
            return Message.new_method_return(msg, "o", [job])
        if msg.member == "KillUnit":  # systemd signals the unit's processes at once: no job
            self.kills.append(tuple(msg.body))
            return Message.new_method_return(msg)
        return Message.new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod", msg.member)

    async def run_job(self, verb: str, name: str, job: str) -> None:
        await asyncio.sleep(0.001)
        results = self.job_results.get(name) or []
        result = results.pop(0) if results else "done"
        slot = {units.engine(self.world.name, s): s for s in ("main", "next", "standby")}.get(name)
        probe = self.world.probe
        if name == units.weights(self.world.name) and verb != "stop" and result == "done":
            # The unit's ExecStartPre= (start_record.py) records the disk it starts on.
            self.world.records.write_started(self.world.name, self.world.config())
            probe.daemon_restarted()
        if name == units.weights(self.world.name, "next"):
            probe.next_daemon_started() if verb != "stop" and result == "done" else probe.next_daemon_stopped()
        if name == units.swap_engine(self.world.name):
            if verb == "stop":
                probe.next_engine = None
            elif result == "done":
                probe.swap_engine_started()
        if verb == "stop":
            self.set_state(name, "inactive")
            if slot == "next":
                self.world.probe.next_engine = None
        elif result == "done":
            self.set_state(name, "activating")
            if slot:
                self.world.probe.engine_started(slot)
            self.set_state(name, "active")
        else:
            self.set_state(name, "failed")
            if slot:
                self.world.probe.set_engine(slot, None)
        self.emit(PATH, MANAGER, "JobRemoved", "uoss", [self.jobs, job, name, result])


class FakeProbe:
    """The gateway, the engine and the weight daemon of one model."""

    runs = staticmethod(Probe.runs)

    def __init__(self, world: "World"):
        self.world = world
        self.engine: Optional[dict] = None  # the engine section the engine runs; None: it does not answer
        self.next_engine: Optional[dict] = None  # the same for the overlap slot's engine
        self.standby_engine: Optional[dict] = None  # the same for the warm standby (standby: true)
        self.fail_rebuild: Optional[str] = None  # the standby refuses its next rebuild, saying this
        self.rebuilds: list[dict] = []  # every section the standby was asked to rebuild on
        self.slot = "main"  # where the gateway sends new requests
        self.no_room: Optional[str] = None  # what overlap_problem answers
        self.no_room_in_place: Optional[str] = None  # what in_place_problem answers
        self.never_fits: Optional[str] = None  # ... asked whether the new KV cache fits even alone
        self.calls: list[str] = []
        self.outcomes: list[str | None] = []  # what each resume or switch told the gateway
        self.drain_result = control.Drained(drained=True, remaining=0, state="paused")
        self.drain_hangs = False
        self.unsettled: dict[str, int] = {}  # slot -> requests still running when settle times out
        self.resume_fails = False
        self.fail_next_start = False  # the engine exits with an error once started
        self.weights = (7, 8)  # the weight daemon's (pid, socket inode); None: it does not answer
        self.held: Optional[str] = None  # the checkpoint the main daemon holds (None: the config's at start)
        # A checkpoint swap's daemon (model-weights-next@NAME): its identity and checkpoint, while it runs.
        self.next_weights: Optional[tuple[int, int]] = None
        self.next_held: Optional[str] = None
        self.digests: dict[str, str] = {}  # slot -> the content digest its engine attached
        # slot -> the daemon its engine attached when it started (an engine a
        # test sets by hand attached the first one)
        self.attached: dict[str, Optional[tuple[int, int]]] = dict.fromkeys(("main", "next", "standby"), self.weights)

    def daemon_restarted(self) -> None:
        """model-weights@NAME started again: another process, another socket,
        holding the checkpoint the config on disk names."""
        pid, inode = self.weights or (7, 8)
        self.weights = (pid + 1000, inode + 1000)
        self.held = self.on_disk()

    def on_disk(self) -> str:
        return str(Path(self.world.config().model).resolve())

    def next_daemon_started(self) -> None:
        """model-weights-next@NAME: the checkpoint the config on disk names (the reload's target)."""
        self.next_weights, self.next_held = (5000, 5001), self.on_disk()

    def next_daemon_stopped(self) -> None:
        self.next_weights = self.next_held = None

    @staticmethod
    def digest(checkpoint: Optional[str]) -> str:
        return f"digest of {checkpoint}"

    def set_engine(self, slot: str, engine: Optional[dict]) -> None:
        setattr(self, {"main": "engine", "next": "next_engine", "standby": "standby_engine"}[slot], engine)

    def get_engine(self, slot: str) -> Optional[dict]:
        return getattr(self, {"main": "engine", "next": "next_engine", "standby": "standby_engine"}[slot])

    async def rebuild(self, engine: dict, slot: str = "standby") -> EngineHealth:
        self.calls.append(f"rebuild {slot}")
        self.rebuilds.append(engine)
        if self.get_engine(slot) is None:
            raise RebuildFailed(f"the {slot} engine did not answer the rebuild: connection refused")
        if self.fail_rebuild:
            why, self.fail_rebuild = self.fail_rebuild, None
            raise RebuildFailed(f"the {slot} engine refused the rebuild: {why}")
        self.set_engine(slot, engine)
        return msgspec.convert({"engine_config": engine, "rebuild_s": {"runner": 0.01, "warm_up": 0.2},
                                "rebuilds": True, **self.attachment(slot)}, EngineHealth)

    async def gateway_status(self):
        self.calls.append("status")
        return control.GatewayStatus(state="serving", slot=self.slot)

    def engine_started(self, slot: str = "main") -> None:
        if self.fail_next_start:
            self.fail_next_start = False
            self.set_engine(slot, None)
            return
        self.set_engine(slot, msgspec.to_builtins(config.load_model(self.world.name, self.world.root).config.engine))
        self.attached[slot] = self.weights
        self.digests[slot] = self.digest(self.held or self.on_disk())

    def swap_engine_started(self) -> None:
        """model-engine-swap@NAME: the next slot's engine, on the next daemon's checkpoint."""
        self.engine_started("next")
        self.attached["next"] = self.next_weights
        self.digests["next"] = self.digest(self.next_held)

    async def engine_health(self, slot: str = "main") -> Optional[EngineHealth]:
        self.calls.append("health" if slot == "main" else f"health {slot}")
        engine = self.get_engine(slot)
        if engine is None:
            return None
        # The builtin main engine and standby answer the rebuild verb (in place).
        rebuilds = slot in ("main", "standby") and backends.for_config(self.world.config()).rebuilds_in_place
        return msgspec.convert({"engine_config": engine, "bridge": self.bridge(slot), "rebuilds": rebuilds,
                                "content_digest": self.digests.get(slot, self.digest(self.held or self.on_disk())),
                                **self.attachment(slot)}, EngineHealth)

    def attachment(self, slot: str) -> dict:
        """What the engine in SLOT reports of its weight daemon on /health."""
        pid, inode = self.attached[slot] or (None, None)
        return {"weights_pid": pid, "weights_socket_inode": inode}

    def bridge(self, slot: str) -> str:
        """What the real engine supervisor of SLOT reports under "bridge"
        (hostd/engine/upstream.py): the next and standby slots of an upstream
        model run on its backend's bridge budget; "" otherwise."""
        cfg = config.load_model(self.world.name, self.world.root).config
        backend = backends.for_config(cfg)
        if slot not in ("next", "standby") or not hasattr(backend, "bridge_summary"):
            return ""
        return backend.bridge_summary(cfg, backend.bridge(cfg))

    async def read_memory(self, cfg, pid: int, standby_pid: int = 0) -> Memory:
        self.calls.append("memory")
        return Memory(None, "")

    def memory_problem(self, cfg, memory: Memory, standby_grows: bool = False) -> Optional[str]:
        return None

    def in_place_problem(self, cfg, health: Optional[EngineHealth], memory: Memory,
                         alone: bool = False) -> Optional[str]:
        """NO_ROOM_IN_PLACE, beside the serving runner; NEVER_FITS alone."""
        return self.never_fits if alone else self.no_room_in_place

    def overlap_problem(self, cfg, health: Optional[EngineHealth], memory: Memory, weights: int = 0,
                        swap: bool = False) -> Optional[str]:
        """The backend's own refusal first, as Probe.overlap_problem asks it
        (SGLang's when config.json cannot size its bridge); then NO_ROOM,
        which stands for the memory preflight."""
        return backends.for_config(cfg).overlap_refusal(cfg) or self.no_room

    async def switch(self, slot: str, outcome: str | None = None) -> dict:
        self.calls.append(f"switch {slot}")
        self.outcomes.append(outcome)
        if self.get_engine(slot) is None:
            raise OSError(f"the engine in slot {slot} does not answer /health; not switching")
        self.slot = slot
        return control.GatewayStatus(state="serving", slot=slot)

    async def settle(self, slot: str, timeout: float):
        """The requests running on SLOT end at once, unless UNSETTLED[slot] says
        how many outlive the timeout."""
        self.calls.append(f"settle {slot}")
        remaining = self.unsettled.get(slot, 0)
        return control.Settled(settled=remaining == 0, remaining=remaining)

    async def weights_identity(self, slot: str = "main"):
        return identity(await self.weights_status(slot))

    async def weights_status(self, slot: str = "main"):
        """The weight daemon of SLOT's status (a real weights/protocol
        Status): the main one holds HELD (the checkpoint the config on disk
        named when it started), the next one (a checkpoint swap's) NEXT_HELD;
        None when it does not answer."""
        identity_, held = (self.weights, self.held or self.on_disk()) if slot == "main" else \
            (self.next_weights, self.next_held)
        if identity_ is None:
            return None
        pid, inode = identity_
        fingerprint = Fingerprint(model_path=held, content_digest=self.digest(held), architecture="a",
                                  dtype="float32", device="cpu", tensor_parallel_size=1, backend="builtin",
                                  torch_version="t", transformers_version="t")
        return Status(fingerprint=fingerprint, pid=pid, socket_inode=inode, tensors=1,
                      bytes_by_device={"cpu": 1}, loaded_at=0.0, clients_served=1)

    async def drain(self, timeout: float) -> dict:
        self.calls.append("drain")
        if self.drain_hangs:
            await asyncio.Event().wait()
        return self.drain_result

    async def resume(self, outcome: str | None = None) -> dict:
        self.calls.append("resume")
        self.outcomes.append(outcome)
        if self.resume_fails:
            raise OSError("control socket: connection refused")
        return control.Resumed(state="serving")

    async def mark(self, outcome: str | None = None) -> None:
        """The real one never raises (a metric only: probe.py)."""
        self.calls.append("mark" if outcome is None else f"mark {outcome}")

    async def verify_engine(self, cfg, weights_before, slot: str = "main", weights_slot: str = "main",
                            ask_daemon: bool = True, health: Optional[EngineHealth] = None) -> EngineHealth:
        self.calls.append("verify" if slot == "main" else f"verify {slot}")
        engine = self.get_engine(slot)
        if engine is None:
            raise VerifyFailed("the engine does not answer /health")
        if not self.runs(EngineHealth(engine_config=engine), msgspec.to_builtins(cfg.engine)):
            raise VerifyFailed(f"the engine runs {engine}, not the target config")
        if weights_before is not None:
            daemon = self.weights if weights_slot == "main" else self.next_weights
            now = daemon if ask_daemon else weights_before
            problem = weights_problem(weights_before, now, EngineHealth(**self.attachment(slot)))
            if problem:
                raise VerifyFailed(problem)
        return msgspec.convert({"engine_config": engine, "bridge": self.bridge(slot), **self.attachment(slot),
                                "content_digest": self.digests.get(slot, "")}, EngineHealth)

    async def smoke(self, served_name: str, slot: str = "main") -> None:
        self.calls.append("smoke" if slot == "main" else f"smoke {slot}")
        if self.get_engine(slot) is None:
            raise OSError(f"the engine in slot {slot} does not answer")

    async def engine_error(self, default: str, slot: str = "main", unit: str | None = None) -> str:
        return default


class World:
    """One model, tiny, configured under ROOT, running, with its manager's
    records under STATE."""

    def __init__(self, tmp: Path, strategy: str = "overlap", standby: bool = False,
                 backend: str = "builtin"):  # the product's default
        self.name = "tiny"
        self.root = tmp / "etc"
        checkpoint = tmp / "checkpoint"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text("{}")
        (checkpoint / "model.safetensors").write_text("")
        (self.root / "models").mkdir(parents=True)
        (self.root / "models/tiny.yaml").write_text(
            f"backend: {backend}\nmodel: {checkpoint}\ndevice: cpu\n"
            f"reload: {{drain_timeout: 5, strategy: {strategy}}}\n" + ("standby: true\n" if standby else ""))
        self.records = Records(tmp / "state/.manager")
        self.bus = FakeBus(self)
        self.probe = FakeProbe(self)
        self.probe.engine_started()  # serving the config on disk
        if standby:
            self.probe.engine_started("standby")  # and waiting on it
        self.systemd = Systemd(self.bus)
        for unit in (units.swap_engine(self.name), units.weights(self.name, "next")):  # a swap's pair: not running
            self.bus.unit(unit)["ActiveState"] = "inactive"

    @property
    def dropin(self) -> Path:
        return self.root / "models/tiny.d" / R.RELOAD_DROPIN

    def config(self):
        """The model's config on disk."""
        return config.load_model(self.name, self.root).config

    def model(self) -> R.ModelHandles:
        return R.ModelHandles(self.name, self.root, self.systemd, self.probe, self.records)

    async def connect(self) -> None:
        if not self.bus.handlers:
            await self.systemd.connect()

    async def recover(self, intent: "Intent") -> str:
        await self.connect()
        return await recovery.recover(self.model(), intent)

    async def reload(self, patch: dict, during=None) -> R.Operation:
        """Check and run one reload; DURING(op) runs once the drain has begun."""
        await self.connect()
        op = R.Operation(id=1, model=self.name, patch=patch)
        run = R.Reload(self.model(), op)
        await run.check()
        task = asyncio.create_task(run.run())
        if during is not None:
            while op.stage != R.Stage.DRAIN and not task.done():
                await asyncio.sleep(0.001)
            await during(op)
        await task
        return op

    def restarts(self) -> int:
        return self.bus.sent.count(f"{MANAGER}.RestartUnit")

    def crashed_reload(self, target: dict, strategy: str = "restart", write_dropin: bool = True,
                       **fields) -> Intent:
        """The intent record a manager that died mid-reload of TARGET (engine
        values) under STRATEGY leaves (FIELDS: any other Intent field), with
        90-reload.yaml already holding TARGET unless WRITE_DROPIN is false;
        what recovery reads back."""
        running = dict(self.probe.engine)
        self.records.write_intent(self.name, Intent(**{
            "operation": 5, "strategy": strategy, "patch": target, "previous_engine": running,
            "target_engine": {**running, **target}, "weights": (7, 8), **fields}))
        if write_dropin:
            self.dropin.parent.mkdir(parents=True, exist_ok=True)
            self.dropin.write_text(yaml.safe_dump({"engine": target}))
        return self.records.intent(self.name)
