"""SecondEngine, the steps overlap and standby share (its docstring says
what it does, its hooks what a strategy of this kind fills in). The stages
and diagrams are at the top of overlap.py and standby.py; swap.py extends
overlap.

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from hostd.manager.operation import Stage, State
from hostd.manager.probe import RebuildFailed
from hostd.manager.strategies.base import Run, Strategy, restart_main, until_asked

if TYPE_CHECKING:
    from hostd.manager.reload import ModelHandles

log = logging.getLogger("hostd.manager.reload")


class SecondEngine(Strategy):
    """The steps overlap and standby share: a second engine (SLOT) is made
    ready on the target config (PREPARE_STAGE, verified on its own socket), the
    gateway switches to it, what runs on the main engine settles, then the
    main engine restarts on the target and takes over again: no 503 at any
    point. Cancel() is honoured until the switch; a stop interrupts it there
    too."""

    slot: str  # the gateway's name of the second engine
    prepare_stage: Stage  # the stage that makes it ready
    old: str  # what the settle's refusal calls the main engine

    async def prepare_engine(self, run: Run) -> None:
        raise NotImplementedError

    async def put_back(self, run: Run, failed: Optional[str], served: bool, interrupted: bool) -> None:
        """RESTORE, after the gateway went back to main: the files (FAILED: why
        the second engine failed, if it did) and the second engine as they
        were; SERVED: the gateway had switched to it."""
        raise NotImplementedError

    async def after_hand_back(self, run: Run, outcome: str) -> None:
        """The gateway serves from main again after OUTCOME: what the second engine does now."""
        raise NotImplementedError

    async def prepare(self, run: Run) -> None:
        """PREPARE_STAGE (the second engine ready, under until_asked), SWITCH,
        SETTLE (what runs on the main engine finishes there)."""
        op, probe = run.op, run.model.probe
        op.enter(self.prepare_stage)
        began = time.monotonic()
        await until_asked(op, self.prepare_engine(run))
        op.enter(Stage.SWITCH)
        prepared = time.monotonic()
        await probe.switch(self.slot)
        run.switched = True
        # Where the time to "the new config serves" went (issue 34): the journal's phases.
        log.info("reload %d of %s: new requests go to the %s engine on %s: %s %.2f s, "
                 "switch %.3f s", op.id, op.model, self.slot, self.serves(run), self.prepare_stage.value,
                 prepared - began, time.monotonic() - prepared, extra=op.fields())
        op.enter(Stage.SETTLE)
        await self.settle_main(run)

    async def restore(self, run: Run, outcome: State, failed: Optional[str], interrupted: bool) -> None:
        """The gateway back on main (when it had switched; not when
        stopping), then the second engine and the files as they were."""
        if run.switched and not interrupted:
            await run.model.probe.switch("main", outcome.value)
        await self.put_back(run, failed, run.switched, interrupted)

    def serves(self, run: Run) -> str:
        """What the second engine serves once the gateway switched to it (the journal's words)."""
        return "the target config"

    async def failure_cause(self, run: Run, exc: Exception) -> Optional[str]:
        """Why the second engine failed: the standby's own rebuild answer, else
        its own last error lines, else EXC."""
        if isinstance(exc, RebuildFailed):
            return str(exc)
        return await run.model.probe.engine_error(str(exc), self.slot)

    hand_back_fails = "handing the gateway back to the main engine failed"

    async def hand_back(self, run: Run, outcome: str) -> None:
        run.op.enter(Stage.RESUME)
        await run.model.probe.switch("main", outcome)
        await self.after_hand_back(run, outcome)

    @staticmethod
    async def settle(run: Run, slot: str) -> int:
        """Wait until the requests running on SLOT's engine end, up to
        reload.drain_timeout; how many still run then (0 also when the
        gateway is older than settle: Probe.settle says so in the journal)."""
        op, timeout = run.op, run.current.reload.drain_timeout
        settled = await run.model.probe.settle(slot, timeout)
        if settled is None or settled.settled:
            return 0
        log.warning("reload %d of %s: %d request(s) still running on the %s engine after "
                    "reload.drain_timeout (%g s)", op.id, op.model, settled.remaining, slot, timeout,
                    extra=op.fields())
        return settled.remaining

    async def settle_main(self, run: Run) -> None:
        """SETTLE: the requests running on the main engine end before it
        restarts; raises when some still run after reload.drain_timeout (the
        main engine then keeps serving, and the reload rolls back)."""
        remaining = await self.settle(run, "main")
        if remaining:
            raise TimeoutError(
                f"{remaining} request(s) still running on the {self.old} engine after reload.drain_timeout "
                f"({run.current.reload.drain_timeout:g} s); the {self.old} engine keeps serving"
            )

    # ------------------------------------------------------------ recovery

    async def recover_engine(self, model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
        return await restart_main(model, where, reload_weights)  # nothing was drained: the gateway serves meanwhile

    async def recover_finish(self, model: ModelHandles, outcome: str, where: dict) -> None:
        main_answers = await model.probe.engine_health() is not None
        if outcome != "restored" and main_answers:
            try:
                await model.probe.switch("main", "recovered")
            except Exception as exc:  # a gateway that is down starts on main by itself
                log.warning("recovery: switching %s's gateway to the main engine: %s", model.name, exc,
                            extra=where)
        await self.recover_second(model, outcome, main_answers, where)

    async def recover_second(self, model: ModelHandles, outcome: str, main_answers: bool, where: dict) -> None:
        raise NotImplementedError
