"""One reload as the manager and D-Bus see it: its states, the names of its
stages, the skeleton's rule of which stage may follow which (transitions()),
and the Operation that moves through them, writing one journal line per
transition. Each strategy (its file in strategies/) says which stages its
reload passes, where Cancel() is honoured, and runs them; the Operation is
handed its strategy by the preflight and asks it. The skeleton's stages are
functions in reload.py.

Trust: nothing here reads or writes outside the manager's memory; the journal
lines carry the model's name and the operation's id as fields.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

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


class Stage(str, enum.Enum):
    """Every stage's name (the D-Bus value of Operation.Stage); which
    strategy passes which is the strategy's (its file in strategies/)."""

    VALIDATE = "validate"
    PREFLIGHT = "preflight"
    RECORD = "record"
    DRAIN = "drain"  # restart: the gateway holds new requests, the running ones end
    LOAD_NEXT = "load-next"  # swap: a second weight daemon loads the new checkpoint
    START_NEXT = "start-next"  # overlap, swap: the second engine starts and is verified
    REBUILD = "rebuild"  # standby: the standby rebuilds on the target config and is verified; in-place: the main engine
    SWITCH = "switch"  # overlap, standby: the gateway sends new requests to the second engine
    SETTLE = "settle"  # overlap, standby: the requests running on the main engine finish there
    RESTART = "restart"
    VERIFY = "verify"
    RESUME = "resume"
    RETIRE = "retire"  # overlap, swap: the second engine (swap: and its weight daemon) stops
    COMMIT = "commit"
    ROLLBACK = "rollback"
    RESTORE = "restore"  # a failure before the main engine's restart: the strategy puts things back
    FINISHED = "finished"


# Before the preflight has chosen a strategy: validate, preflight, and the
# end of a reload refused there (or unchanged). Cancel() is honoured here.
BEFORE_CHOICE: dict[Stage, frozenset[Stage]] = {
    Stage.VALIDATE: frozenset({Stage.PREFLIGHT, Stage.FINISHED}),
    Stage.PREFLIGHT: frozenset({Stage.FINISHED}),
}


def transitions(path: tuple[Stage, ...], main: Stage = Stage.RESTART) -> dict[Stage, frozenset[Stage]]:
    """Which stage may follow which for a strategy whose reload, when it ends
    done, passes through PATH (validate ... MAIN (the main engine put on the
    target: restart, or rebuild in place), verify, (resume ...) commit,
    finished); anything else is a bug and raises. The skeleton adds its ways
    out (reload.py): every stage from record up to MAIN may end in restore
    (the files put back, the main engine never stopped); MAIN and verify in
    rollback, which hands the gateway back (resume, when PATH has it) or
    ends; from the hand back on a failure still commits (the target runs) or
    ends; preflight may go to restore (a cancel before record)."""
    table = {stage: set() for stage in Stage}
    for stage, after in zip(path, path[1:]):
        table[stage].add(after)
    for stage, after in BEFORE_CHOICE.items():
        table[stage] |= after
    at, verify, commit = path.index(main), path.index(Stage.VERIFY), path.index(Stage.COMMIT)
    for stage in (Stage.PREFLIGHT, *path[path.index(Stage.RECORD):at]):
        table[stage].add(Stage.RESTORE)
    for stage in (main, Stage.VERIFY):
        table[stage].add(Stage.ROLLBACK)
    table[Stage.ROLLBACK] |= {Stage.FINISHED, *({Stage.RESUME} & set(path))}
    for stage in path[verify + 1:commit]:
        table[stage] |= {Stage.COMMIT, Stage.FINISHED}
    table[Stage.RESTORE].add(Stage.FINISHED)
    return {stage: frozenset(after) for stage, after in table.items()}


class Plan(Protocol):
    """What an Operation asks of its strategy (a strategies.Strategy, handed
    in by the preflight; this module imports none)."""

    name: str  # the D-Bus value of Operation.Strategy
    stages: tuple[Stage, ...]  # the path of a reload that ends done
    cancellable: frozenset[Stage]  # where Cancel() is honoured
    cancel_ends: str  # "its drain": what Cancel() is refused past
    transitions: dict[Stage, frozenset[Stage]]  # transitions(stages)


def journal_fields(model: str, operation: int, **more) -> dict:
    """The journal fields of a line about operation OPERATION of MODEL, for
    logging's extra= (logs.py sends hostd_* attributes as HOSTD_* fields):
    `journalctl HOSTD_OPERATION=ID` finds every line of one reload, its
    recovery's after a manager restart included. MORE: further hostd_* fields."""
    return {"hostd_model": model, "hostd_operation": str(operation), **more}


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
    strategy: Optional[Plan] = None  # a strategies.Strategy, once the preflight chose
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
        """Would Cancel() be honoured now: before the preflight has chosen,
        or in a stage the strategy says Cancel may end."""
        if self.state != State.RUNNING:
            return False
        return self.stage in (self.strategy.cancellable if self.strategy else BEFORE_CHOICE)

    def cancel_ends(self) -> str:
        """What Cancel() is refused past ("its drain")."""
        return self.strategy.cancel_ends if self.strategy else "its preflight"

    def stages(self) -> tuple[Stage, ...]:
        """The stages of a reload that ends done, as far as the strategy is known."""
        return self.strategy.stages if self.strategy else (*BEFORE_CHOICE, Stage.FINISHED)

    @property
    def strategy_name(self) -> str:
        """The D-Bus value of Operation.Strategy ("" before the preflight chose)."""
        return self.strategy.name if self.strategy else ""

    def fields(self, **more) -> dict:
        """This operation's journal fields (journal_fields)."""
        return journal_fields(self.model, self.id, **more)

    def cancel(self) -> None:
        self.cancel_requested = True
        self.asked.set()

    def interrupt(self) -> None:
        """The model is being stopped."""
        self.interrupt_requested = True
        self.asked.set()

    def enter(self, stage: Stage) -> None:
        allowed = self.strategy.transitions if self.strategy else BEFORE_CHOICE
        if stage not in allowed.get(self.stage, ()):
            raise RuntimeError(f"reload {self.id}: no transition {self.stage.value} -> {stage.value}")
        self.stage = stage
        self.stage_entered = time.time()
        log.info(
            "reload %d of %s: stage %s", self.id, self.model, stage.value,
            extra=self.fields(hostd_stage=stage.value),
        )
        self._changed()

    def finish(self, state: State, error: str = "") -> None:
        self.state, self.error, self.finished = state, error, time.time()
        if self.stage != Stage.FINISHED:
            self.stage = Stage.FINISHED
        log.log(
            logging.INFO if state == State.DONE else logging.WARNING,
            "reload %d of %s %s%s", self.id, self.model, state.value, f": {error}" if error else "",
            extra=self.fields(hostd_stage="finished", message_id=MESSAGE_IDS[state.value]),
        )
        self._changed()

    def _changed(self) -> None:
        if self.on_change:
            self.on_change(self)
