"""The overlap strategy (Overlap), the default: a second engine starts
beside the serving one on the same weights and serves while the main engine
restarts, then retires.

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.

overlap: no 503 at any point.

    validate -> preflight -> record -> start-next -> switch -> settle -> restart -> verify -> resume -> retire -> commit -> finished (done)
                               |          |  (fails,    |         |           \\____(fails)___/
                               +----------+  cancel,    |      (timeout)   rollback (main back to the previous config)
                               |             stop)      |         |         -> resume -> retire -> finished (rolled-back)
                            restore: (switch back), stop next, put the drop-in back (pinned in
                            99-rollback.yaml when an engine refused an admin's drop-in)
                            -> finished (rolled-back | cancelled | failed; the old engine never stopped)

    start-next: model-engine-next@NAME starts beside model-engine@NAME on the
      same weights with the target config and is verified on its own socket;
      Cancel() is honoured until here (Overlap.cancel_until);
    switch: the gateway sends new requests to it (requests running on the
      old engine finish there);
    settle: the requests still running on the old engine end (the gateway's
      settle verb), within reload.drain_timeout, else the reload is abandoned;
    restart: model-engine@NAME, idle, restarts with the target config, verify;
    resume: the gateway sends new requests to model-engine@NAME again;
    retire: once its requests end (reload.drain_timeout, then its own
      shutdown_timeout), model-engine-next@NAME stops.
    At rest only model-engine@NAME runs, so `systemctl restart model-engine@NAME`
    and the journal mean what they always meant.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from hostd.manager.operation import Stage
from hostd.manager.strategies.second_engine import SecondEngine
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.manager.strategies.base import Run
    from hostd.manager.reload import ModelHandles

log = logging.getLogger("hostd.manager.reload")


class Overlap(SecondEngine):
    """A second engine, model-engine-next@NAME, starts beside the serving one
    on the same weights; it serves while the main engine restarts, then
    retires."""

    name = "overlap"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.START_NEXT, Stage.SWITCH, Stage.SETTLE,
              Stage.RESTART, Stage.VERIFY, Stage.RESUME, Stage.RETIRE, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.START_NEXT
    cancel_ends = "its switch to the second engine"
    slot, prepare_stage, old = "next", Stage.START_NEXT, "old"

    async def prepare_engine(self, run: Run) -> None:
        """Start the second engine with the target config and verify it."""
        op, model = run.op, run.model
        await model.systemd.start(model.next_unit, timeout=job_timeout(run.target.timeouts.start))
        health = await run.verify(run.target, "next")
        bridge = health.bridge
        if bridge:  # vllm, sglang: the next engine runs on a KV budget of its own
            op.notes.append(f"bridge engine ran with {bridge}")
            log.info("reload %d of %s: the bridge engine runs with %s", op.id, op.model, bridge,
                     extra=op.fields())

    async def put_back(self, run: Run, failed: Optional[str], served: bool, interrupted: bool) -> None:
        # The next engine stops before the intent goes (restore drops it): a
        # manager killed meanwhile leaves a record whose recovery stops it.
        await self.retire(run, served)
        run.restore(failed)

    async def after_hand_back(self, run: Run, outcome: str) -> None:
        run.op.enter(Stage.RETIRE)
        await self.retire(run)

    async def retire(self, run: Run, served: bool = True) -> None:
        """Stop the second engine; when it SERVED (the gateway switched to
        it), once what it admitted has finished (up to reload.drain_timeout;
        then its engine.shutdown_timeout applies)."""
        op, remaining = run.op, 0
        if served:
            try:
                remaining = await self.settle(run, "next")
            except Exception as exc:  # the gateway does not answer: nothing to wait for through it
                log.warning("reload %d of %s: cannot ask the gateway what runs on the next engine: %s",
                            op.id, op.model, exc)
        if remaining:
            op.notes.append(f"{remaining} request(s) still ran on the second engine after "
                            f"reload.drain_timeout; it was stopped with engine.shutdown_timeout")
        await self.stop_second(run.model, job_timeout(run.target.timeouts.stop))

    def second_unit(self, model: ModelHandles) -> Optional[str]:
        return model.next_unit

    async def stop_second(self, model: ModelHandles, timeout: float) -> None:
        """Stop what this strategy started beside the main engine."""
        await model.systemd.stop(self.second_unit(model), timeout=timeout)

    async def recover_second(self, model: ModelHandles, outcome: str, main_answers: bool, where: dict) -> None:
        """Exactly one engine is left: the next one stops, unless the main
        engine does not answer (then it keeps serving)."""
        if outcome == "restored" or main_answers:
            await self.stop_second(model, job_timeout(model.load().config.timeouts.stop))
        else:
            log.error("recovery: %s's main engine does not answer; its second engine (%s) keeps serving",
                      model.name, self.second_unit(model), extra=where)
