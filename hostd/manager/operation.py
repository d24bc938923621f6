"""One reload as the manager and D-Bus see it: its states, its strategies, its
stages and the one table of allowed transitions between them (TRANSITIONS),
and the Operation that moves through them, writing one journal line per
transition. The stages themselves are functions in reload.py.

Trust: nothing here reads or writes outside the manager's memory; the journal
lines carry the model's name and the operation's id as fields.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger("hostd.manager.reload")

# MESSAGE_IDs of the journal lines a reload writes (journalctl MESSAGE_ID=...).
MESSAGE_IDS = {
    "started": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a40",
    "done": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a41",
    "rolled-back": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a42",
    "failed": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a43",
    "cancelled": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a44",
    "unchanged": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a45",
}


class State(str, enum.Enum):
    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled-back"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNCHANGED = "unchanged"  # nothing to apply: the engine runs the target config already


class Strategy(str, enum.Enum):
    OVERLAP = "overlap"
    RESTART = "restart"
    STANDBY = "standby"  # standby: true and the standby answers: it rebuilds, then serves while main restarts


class Stage(str, enum.Enum):
    VALIDATE = "validate"
    PREFLIGHT = "preflight"
    RECORD = "record"
    DRAIN = "drain"
    START_NEXT = "start-next"  # overlap: the second engine starts and is verified
    REBUILD = "rebuild"  # standby: the standby rebuilds on the target config and is verified
    SWITCH = "switch"  # overlap: the gateway sends new requests to it
    SETTLE = "settle"  # overlap: the requests running on the old engine finish there
    RESTART = "restart"
    VERIFY = "verify"
    RESUME = "resume"
    RETIRE = "retire"  # overlap: the second engine stops
    COMMIT = "commit"
    ROLLBACK = "rollback"
    RESTORE = "restore"  # put the drop-in back after a drain that did not finish
    FINISHED = "finished"


# Which stage may follow which; anything else is a bug and raises.
TRANSITIONS: dict[Stage, set[Stage]] = {
    Stage.VALIDATE: {Stage.PREFLIGHT, Stage.FINISHED},
    Stage.PREFLIGHT: {Stage.RECORD, Stage.RESTORE, Stage.FINISHED},
    Stage.RECORD: {Stage.DRAIN, Stage.START_NEXT, Stage.REBUILD, Stage.RESTORE},
    Stage.REBUILD: {Stage.SWITCH, Stage.RESTORE},
    Stage.DRAIN: {Stage.RESTART, Stage.RESTORE},
    Stage.START_NEXT: {Stage.SWITCH, Stage.RESTORE},
    Stage.SWITCH: {Stage.SETTLE, Stage.RESTORE},
    Stage.SETTLE: {Stage.RESTART, Stage.RESTORE},
    Stage.RESTART: {Stage.VERIFY, Stage.ROLLBACK},
    Stage.VERIFY: {Stage.RESUME, Stage.ROLLBACK},
    Stage.RESUME: {Stage.RETIRE, Stage.COMMIT, Stage.FINISHED},
    Stage.RETIRE: {Stage.COMMIT, Stage.FINISHED},
    Stage.COMMIT: {Stage.FINISHED},
    Stage.ROLLBACK: {Stage.RESUME, Stage.FINISHED},
    Stage.RESTORE: {Stage.FINISHED},
    Stage.FINISHED: set(),
}
# Where Cancel() is honoured, per strategy: until the drain ends (restart), or
# until the gateway switches to the second engine (overlap) or to the rebuilt
# standby (standby); before the preflight has chosen, both. Past it the
# reload runs to its end.
CANCELLABLE = {
    "": (Stage.VALIDATE, Stage.PREFLIGHT),
    "restart": (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.DRAIN),
    "overlap": (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.START_NEXT),
    "standby": (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.REBUILD),
}
CANCEL_ENDS = {"": "its preflight", "restart": "its drain", "overlap": "its switch to the second engine",
               "standby": "its switch to the standby"}


class Cancelled(Exception):
    pass


class Interrupted(Exception):
    """The model is being stopped: the reload gives way and touches no unit."""


@dataclass
class Operation:
    """One reload, as the D-Bus Operation object shows it."""

    id: int
    model: str
    patch: dict
    strategy: str = ""  # Strategy, once the preflight chose
    state: State = State.RUNNING
    stage: Stage = Stage.VALIDATE
    error: str = ""
    weights_reused: bool = False
    restored: bool = False
    created: float = field(default_factory=time.time)
    stage_entered: float = field(default_factory=time.time)  # when the current stage began
    finished: float = 0.0
    notes: list[str] = field(default_factory=list)
    on_change: Optional[Callable[["Operation"], None]] = None
    cancel_requested: bool = False
    interrupt_requested: bool = False  # the model is being stopped
    asked: asyncio.Event = field(default_factory=asyncio.Event)  # set by cancel() and interrupt()

    def cancellable(self) -> bool:
        return self.stage in CANCELLABLE.get(self.strategy, ())

    def cancel(self) -> None:
        self.cancel_requested = True
        self.asked.set()

    def interrupt(self) -> None:
        """The model is being stopped."""
        self.interrupt_requested = True
        self.asked.set()

    def enter(self, stage: Stage) -> None:
        if stage not in TRANSITIONS[self.stage]:
            raise RuntimeError(f"reload {self.id}: no transition {self.stage.value} -> {stage.value}")
        self.stage = stage
        self.stage_entered = time.time()
        log.info(
            "reload %d of %s: stage %s", self.id, self.model, stage.value,
            extra={"hostd_model": self.model, "hostd_operation": str(self.id), "hostd_stage": stage.value},
        )
        self._changed()

    def finish(self, state: State, error: str = "") -> None:
        self.state, self.error, self.finished = state, error, time.time()
        if self.stage != Stage.FINISHED:
            self.stage = Stage.FINISHED
        log.log(
            logging.INFO if state == State.DONE else logging.WARNING,
            "reload %d of %s %s%s", self.id, self.model, state.value, f": {error}" if error else "",
            extra={"hostd_model": self.model, "hostd_operation": str(self.id),
                   "hostd_stage": "finished", "message_id": MESSAGE_IDS[state.value]},
        )
        self._changed()

    def _changed(self) -> None:
        if self.on_change:
            self.on_change(self)
