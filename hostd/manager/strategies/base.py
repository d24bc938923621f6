"""What every reload strategy is (Strategy: its stages, where Cancel() is
honoured, and the hooks the reload and recovery call) and the helpers more
than one strategy calls: until_asked (a stage that a Cancel() or a stop may
end) and restart_main (recovery's restart of the main engine).

Throughout the package RUN is what a strategy is handed: the reload it runs,
typed by the Run protocol below (reload.Reload satisfies it; a strategy
reads nothing else of it), and MODEL the reload.ModelHandles recovery hands
it. The higher types are imported under TYPE_CHECKING only: reload.py
imports this package at run time, the strategies reach back into it for
types alone (test_import_graph counts what runs, not what a type checker
reads).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Optional, Protocol

from hostd.manager.operation import Cancelled, Interrupted, Operation, Stage, State, transitions
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.config.schema import ModelConfig
    from hostd.engine.health import EngineHealth
    from hostd.manager.change import Change
    from hostd.manager.reload import ModelHandles
    from hostd.manager.preflight import Memory

log = logging.getLogger("hostd.manager.reload")


class Run(Protocol):
    """What a strategy is handed: one checked reload (reload.Reload). Read
    these, call these; nothing else of it."""

    model: ModelHandles  # the model's units, files, systemd, probe and records
    op: Operation  # the Operation the reload publishes
    dry_run: bool  # a CheckReload: nothing is published or touched
    current: ModelConfig  # the effective config before the reload
    target: ModelConfig  # ... and after it
    health: Optional[EngineHealth]  # the main engine's /health as validate read it
    running_engine: Optional[dict]  # the engine section a rollback brings back
    change: Change  # the limits, or a checkpoint swap (change.py)
    weights_before: Optional[tuple[int, int]]  # the weight daemon verify holds engines to
    recorded: bool  # the previous files are known: restore() may write
    switched: bool  # the gateway sends new requests to the strategy's second engine
    rebuilt: Optional[EngineHealth]  # the main engine's /health as its rebuild in place answered

    def restore(self, cause: Optional[str] = None) -> None:
        """The previous config back on disk (CAUSE: an engine's refusal)."""

    async def verify(self, cfg: ModelConfig, slot: str = "main",
                     health: Optional[EngineHealth] = None) -> EngineHealth:
        """The engine in SLOT runs CFG on the reload's weights; its /health."""

    async def stopping(self) -> bool:
        """Is the model being stopped?"""


async def until_asked(op: Operation, work: Coroutine[Any, Any, Any]) -> Any:
    """Run the coroutine WORK unless, or until, a Cancel() or a stop asks
    otherwise (OP.asked): then WORK is abandoned (what it started is undone
    by the caller's restore) and Cancelled or Interrupted is raised; a stage
    that finishes as it is asked still ends so. WORK's own result or error
    otherwise."""
    if op.asked.is_set():  # asked before WORK began: it never begins
        work.close()
    else:
        task = asyncio.ensure_future(work)
        asked = asyncio.ensure_future(op.asked.wait())
        try:
            await asyncio.wait({task, asked}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            asked.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif not op.asked.is_set():
            return task.result()
    if op.interrupt_requested:
        raise Interrupted("interrupted: the model is being stopped")
    raise Cancelled(f"cancelled during {op.stage.value}")


class Strategy:
    """One reload strategy: the steps it supplies to the one driver
    (reload.Reload._apply, which runs record, prepare, the main engine's
    restart, verify, hand back and commit, and alone decides how a run
    ends). STAGES: the path of a reload that ends done; CANCEL_UNTIL: the
    last stage Cancel() may end (CANCEL_ENDS says what follows it, in the
    Busy answer past it); the transitions follow from STAGES and the
    skeleton (operation.transitions). MAIN_STAGE: the stage that puts the
    main engine on the target (put_main_on); HAND_BACK_FAILS: the result's
    words when hand_back fails after the target was verified."""

    name: str
    stages: tuple[Stage, ...]
    cancel_until: Stage
    cancel_ends: str
    main_stage: Stage = Stage.RESTART
    hand_back_fails: str = "the gateway did not resume"

    def __init__(self) -> None:
        self.cancellable = frozenset(self.stages[: self.stages.index(self.cancel_until) + 1])
        self.transitions = transitions(self.stages, self.main_stage)

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        """Why the preflight refuses this strategy's reload for memory (MEMORY:
        its reading), or None."""
        return None

    # ------------------------------------------------------------ the driver's hooks

    async def prepare(self, run: Run) -> None:
        """The strategy's stages between record and the main engine's
        restart (a drain; a second engine made ready and switched to). Raise
        to abandon the reload (Cancelled, Interrupted: until_asked's; any
        other error: failure_cause says whether an engine failed)."""

    async def failure_cause(self, run: Run, exc: Exception) -> Optional[str]:
        """When prepare raised EXC because an engine failed: its own words
        (the reload then ends rolled-back); None when nothing failed that a
        rollback answers (a gateway error: failed)."""
        return None

    async def restore(self, run: Run, outcome: State, failed: Optional[str], interrupted: bool) -> None:
        """Undo what prepare did, after it raised: the files back (run.restore;
        FAILED: an engine's refusal, which pins an administrator's values)
        and the gateway serving from main again, unless INTERRUPTED (the
        model is being stopped: touch no unit). OUTCOME: how the run ends."""
        run.restore(failed)

    async def put_main_on(self, run: Run, cfg: ModelConfig) -> None:
        """The main engine on CFG (the target, or the previous config in a
        rollback), restarted by systemd (restart_pair). In a checkpoint swap
        the main pair: the weight daemon loads the checkpoint on disk and the
        engine, bound to it (BindsTo=), follows; the daemon that answers then
        is the one verify holds the engine to."""
        swap = run.change.swaps
        await restart_pair(run.model, job_timeout(cfg.timeouts.start), swap)
        if swap:
            run.weights_before = await run.model.probe.weights_identity()

    async def verify_main(self, run: Run) -> None:
        """VERIFY: the main engine runs the target, answers, and attached the
        weight daemon the reload holds it to (reload.Reload.verify)."""
        await run.verify(run.target)

    async def hand_back(self, run: Run, outcome: str) -> None:
        """The main engine serves the gateway's new requests again, after
        OUTCOME (done, rolled-back) of the main engine's replacement."""

    # ------------------------------------------------------------ recovery

    def second_unit(self, model: ModelHandles) -> Optional[str]:
        """The unit beside the main engine this strategy starts or changes."""
        return None

    async def recover_engine(self, model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
        """Recovery: bring the main engine back on the config on disk (the
        files are restored already; RELOAD_WEIGHTS: the main weight daemon
        holds another checkpoint than they name, after a swap, and loads it
        too); "restarted", or "left" when it cannot be done safely."""
        raise NotImplementedError

    async def recover_finish(self, model: ModelHandles, outcome: str, where: dict) -> None:
        """Recovery's end, after OUTCOME (committed, left, restarted,
        restored): the gateway serving again, nothing left beside the main
        engine that the reload started."""
        raise NotImplementedError


async def restart_pair(model: ModelHandles, timeout: float, reload_weights: bool) -> None:
    """The main engine restarted by systemd within TIMEOUT; with
    RELOAD_WEIGHTS the main pair: the weight daemon restarts (loading the
    checkpoint on disk) and the engine, bound to it, starts with it."""
    if reload_weights:
        await model.systemd.restart(model.weights_unit, timeout=timeout)
        await model.systemd.start(model.engine_unit, timeout=timeout)
    else:
        await model.systemd.restart(model.engine_unit, timeout=timeout)


async def restart_main(model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
    """Recovery: restart the main engine (with RELOAD_WEIGHTS the main pair,
    restart_pair) with the config on disk; a failure is logged."""
    try:
        await restart_pair(model, job_timeout(model.load().config.timeouts.start), reload_weights)
    except Exception as exc:
        log.error("recovery: restarting the engine of %s failed: %s", model.name, exc, extra=where)
    return "restarted"
