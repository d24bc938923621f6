"""org.hostd1.Operation: one object per operation on the bus, as systemd's Job
(/org/hostd1/operation/<id>): read-only properties that follow the reload's
Operation (reload.py, operation.py) with PropertiesChanged, and Cancel.

Trust: anyone on the bus may read; Cancel asks polkit first (authority.admin),
as every mutating method of the manager does (service.py).
"""

import json

from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method

from hostd import units
from hostd.manager import api, errors
from hostd.manager.authority import admin
from hostd.manager.operation import Operation, Stage, State

RUNNING = State.RUNNING


class OperationInterface(ServiceInterface):
    def __init__(self, op: Operation, kind: str, systemd, authority):
        """SYSTEMD (systemd1.Systemd) for the engine's STATUS=, AUTHORITY
        (authority.Authority) for Cancel."""
        super().__init__(api.OPERATION)
        self.op, self.kind, self.systemd, self.authority = op, kind, systemd, authority
        self.path = api.operation_path(op.id)

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
    def Strategy(self) -> "s":
        """restart, overlap or standby, once the preflight chose ("" before,
        and for start/stop/restart operations)."""
        return self.op.strategy_name

    @dbus_property(access=PropertyAccess.READ)
    def Stages(self) -> "as":
        """The stages a reload passes through when it ends done, in order, as
        its strategy says (its file in strategies/); ["validate", "preflight",
        "finished"] before the preflight chose; [] for start, stop, restart
        and recovery operations. A reload that fails, is cancelled or rolls
        back leaves this path for restore or rollback (then finished)."""
        return self.stages()

    @dbus_property(access=PropertyAccess.READ)
    def Cancellable(self) -> "b":
        """Would Cancel() be honoured now (a running reload in a stage its
        strategy lets Cancel end)."""
        return self.cancellable()

    def stages(self) -> list[str]:
        return [stage.value for stage in self.op.stages()] if self.kind == "reload" else []

    def cancellable(self) -> bool:
        return self.kind == "reload" and self.op.cancellable()

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

    @dbus_property(access=PropertyAccess.READ)
    def StageUSec(self) -> "t":
        """When the current Stage began (CLOCK_REALTIME, µs): its elapsed time."""
        return int(self.op.stage_entered * 1e6)

    @dbus_property(access=PropertyAccess.READ)
    def EngineStatus(self) -> "s":
        """The STATUS= line of the unit the current stage waits on (waited_unit):
        "attaching weights", "vllm starting: Loading safetensors checkpoint shards: 4/9", ..."""
        return self.engine_status()

    def engine_status(self) -> str:
        props = self.systemd.cached(self.waited_unit()) or {}
        return str(props.get("StatusText", ""))

    def waited_unit(self) -> str:
        """The unit whose start the current stage waits on: the swap's weight
        daemon while it loads, the second engine while an overlap or a swap
        starts it, the standby while it rebuilds; else the main engine (a
        restart's, a start's, an in-place rebuild's)."""
        name, stage, strategy = self.op.model, self.op.stage, self.op.strategy_name
        if stage == Stage.LOAD_NEXT:
            return units.weights(name, "next")
        if stage == Stage.START_NEXT:
            return units.swap_engine(name) if strategy == "swap" else units.engine(name, "next")
        if stage == Stage.REBUILD and strategy == "standby":
            return units.engine(name, "standby")
        return units.engine(name)

    @method()
    @admin(api.MANAGE_ACTION)
    async def Cancel(self):
        op = self.op
        if op.state != RUNNING:
            raise errors.NotRunning(f"operation {op.id} already ended ({op.state.value})")
        if self.kind != "reload":
            raise errors.Busy(f"operation {op.id} is a {self.kind}, not a reload; it cannot be cancelled")
        if not op.cancellable():
            raise errors.Busy(f"operation {op.id} is past {op.cancel_ends()} "
                              f"({op.stage.value}); it cannot be cancelled now")
        op.cancel()

    def changed(self) -> None:
        self.emit_properties_changed({
            "State": self.op.state.value, "Stage": self.op.stage.value, "Error": self.op.error,
            "Strategy": self.op.strategy_name, "Stages": self.stages(), "Cancellable": self.cancellable(),
            "WeightsReused": self.op.weights_reused, "Restored": self.op.restored,
            "Notes": list(self.op.notes), "FinishedUSec": int(self.op.finished * 1e6),
            "StageUSec": int(self.op.stage_entered * 1e6), "EngineStatus": self.engine_status(),
        })

    @property
    def running(self) -> bool:
        return self.op.state == RUNNING
