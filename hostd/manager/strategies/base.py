"""What every reload strategy is (Strategy: its stages, where Cancel() is
honoured, and the hooks the reload and recovery call) and the helpers more
than one strategy calls: until_asked (a stage that a Cancel() or a stop may
end) and restart_main (recovery's restart of the main engine).

Throughout the package RUN is the reload.Reload a strategy runs (its
attributes are listed in that class's __init__) and MODEL the
reload.ModelHandles recovery hands it; both are imported under
TYPE_CHECKING only: reload.py imports this package at run time, the
strategies reach back into it for types alone (test_import_graph counts
what runs, not what a type checker reads).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Optional

from hostd.manager.operation import Cancelled, Interrupted, Operation, Stage, transitions
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.manager.reload import ModelHandles, Reload
    from hostd.manager.preflight import Memory

log = logging.getLogger("hostd.manager.reload")


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
    """One reload strategy. STAGES: the path of a reload that ends done;
    CANCEL_UNTIL: the last stage Cancel() may end (CANCEL_ENDS says what
    follows it, in the Busy answer past it); the transitions follow from
    STAGES and the skeleton (operation.transitions)."""

    name: str
    stages: tuple[Stage, ...]
    cancel_until: Stage
    cancel_ends: str

    def __init__(self) -> None:
        self.cancellable = frozenset(self.stages[: self.stages.index(self.cancel_until) + 1])
        self.transitions = transitions(self.stages)

    def __repr__(self) -> str:
        return f"<strategy {self.name}>"

    def memory_problem(self, run: Reload, memory: Memory) -> Optional[str]:
        """Why the preflight refuses this strategy's reload for memory (MEMORY:
        its reading), or None."""
        return None

    async def apply(self, run: Reload) -> None:
        """Run RUN (a checked reload.Reload) from its record stage to its end."""
        raise NotImplementedError

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


async def restart_main(model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
    """Recovery: restart the main engine with the config on disk; with
    RELOAD_WEIGHTS the main pair: the weight daemon loads the checkpoint on
    disk and the engine, bound to it, follows."""
    timeout = job_timeout(model.load().config.timeouts.start)
    try:
        if reload_weights:
            await model.systemd.restart(model.weights_unit, timeout=timeout)
            await model.systemd.start(model.engine_unit, timeout=timeout)
        else:
            await model.systemd.restart(model.engine_unit, timeout=timeout)
    except Exception as exc:
        log.error("recovery: restarting the engine of %s failed: %s", model.name, exc, extra=where)
    return "restarted"
