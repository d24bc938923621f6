"""The restart strategy (Restart): drain the gateway, restart the main
engine on the target config, resume: 503 while it restarts. When it is
chosen: the package's docstring and choose() (strategies/__init__.py).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.

restart:

    validate -> preflight -> record -> drain -> restart -> verify -> resume -> commit -> finished (done)
        |           |                    |          \\________/         |
     refused     refused                 |               | failure     +- resume fails: commit, failed
    (nothing touched)          timeout/cancel/stop       |
                                         |           rollback -> (verify old) -> resume -> finished (rolled-back)
                                restore, resume              |                          \\ fails: failed (degraded)
                                (no resume when stopping)    +- the model is being stopped (interrupted):
                                         |                      restore, start nothing -> finished (failed)
                                finished (cancelled | failed)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from hostd.manager.operation import Interrupted, Stage, State
from hostd.manager.strategies.base import Run, Strategy, restart_main, until_asked

if TYPE_CHECKING:
    from hostd.manager.reload import ModelHandles
    from hostd.manager.preflight import Memory

log = logging.getLogger("hostd.manager.reload")


class Restart(Strategy):
    """Drain, restart the engine, resume: 503 while it restarts."""

    name = "restart"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.DRAIN, Stage.RESTART, Stage.VERIFY,
              Stage.RESUME, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.DRAIN
    cancel_ends = "its drain"

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        return run.model.probe.memory_problem(run.target, memory)

    async def prepare(self, run: Run) -> None:
        """DRAIN: no new request is admitted and those running end; a drain
        that times out, is cancelled or meets a stop abandons the reload
        (restore)."""
        op = run.op
        op.enter(Stage.DRAIN)
        await until_asked(op, self.drain(run))
        if await run.stopping():
            raise Interrupted("interrupted: the model is being stopped")

    async def restore(self, run: Run, outcome: State, failed: Optional[str], interrupted: bool) -> None:
        """The file back, and the drained gateway serving again (not when stopping)."""
        run.restore(failed)
        if not interrupted:
            await run.model.probe.resume(outcome.value)

    @staticmethod
    async def drain(run: Run) -> None:
        timeout = run.current.reload.drain_timeout
        result = await run.model.probe.drain(timeout)
        if not result.drained:
            raise TimeoutError(
                f"drain timed out after {timeout:g} s with "
                f"{result.remaining} request(s) still running; the old engine keeps serving"
            )

    @staticmethod
    async def hand_back(run: Run, outcome: str) -> None:
        """The drained gateway serves again."""
        run.op.enter(Stage.RESUME)
        await run.model.probe.resume(outcome)

    async def recover_engine(self, model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
        """Restart the engine with the config on disk, after draining what it admitted."""
        cfg = model.load().config
        try:
            drained = (await model.probe.drain(cfg.reload.drain_timeout)).drained
        except Exception as exc:  # no gateway: nothing was admitted through it
            log.warning("recovery: draining %s: %s", model.name, exc, extra=where)
            drained = True
        if not drained:
            log.error("recovery: %s did not drain in %g s; its engine is left running (systemctl reload %s "
                      "once it is idle)", model.name, cfg.reload.drain_timeout, model.umbrella_unit, extra=where)
            return "left"
        return await restart_main(model, where, reload_weights)

    async def recover_finish(self, model: ModelHandles, outcome: str, where: dict) -> None:
        if outcome == "restored":
            return
        try:
            await model.probe.resume("recovered")
        except Exception as exc:  # the gateway may be down; it starts serving on its own then
            log.warning("recovery: resuming %s: %s", model.name, exc, extra=where)
