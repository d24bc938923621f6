"""The in-place strategy (InPlace): a limit change that starts no process.
The main engine builds a new runner with the target's engine section on the
weights it already maps, warms it, and takes new requests on it; the old
runner finishes what it admitted (streams included) and is freed
(hostd/engine/server.py's rebuild verb). No unit starts or stops, the
engine's MainPID stays; with `standby: true` the warm standby follows the
same way in its own process. When it is chosen: in_place_refusal and
choose() (strategies/__init__.py).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.

in-place: no 503 at any point, no process start.

    validate -> preflight -> record -> rebuild -> verify -> (the standby follows) -> commit -> finished (done)
                                          \\_______/
                                 (refused, fails) rollback: the drop-in back (or the refused
                                 admin's values pinned), the main engine on the previous
                                 section (it still runs it when the rebuild was refused),
                                 verified -> finished (rolled-back)

    record: the gateway is told the reload began (control's mark: its
      reload histograms; it drains and switches nothing), and told how it
      ended before the standby follows or the rollback finishes;
    rebuild: POST /hostd/rebuild to model-engine@NAME with the target's engine
      section: refusals checked as a start checks them, the new runner
      (its KV cache beside the serving one's: the preflight counts both),
      its warm-up, the swap on the same listening socket; a refusal or a
      failure leaves the old runner serving, untouched;
    verify: as after a restart (/health runs the target, a smoke request,
      the same weight daemon);
    the standby follows: a warm standby rebuilds on the target too (its
      trouble never changes how the reload ended: it is then restarted by
      systemd, in the notes and the journal).
    Cancel() is honoured until record: the rebuild takes about a second.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Optional

import msgspec

from hostd import backends
from hostd.manager.operation import Stage, State
from hostd.manager.probe import RebuildFailed
from hostd.manager.strategies.base import Run, Strategy
from hostd.manager.strategies.restart import Restart
from hostd.manager.strategies.standby import put_standby_on
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.config.schema import ModelConfig
    from hostd.manager.preflight import Memory
    from hostd.manager.reload import ModelHandles

log = logging.getLogger("hostd.manager.reload")

# The sections a reload may change in place besides the engine's: the
# manager's own (reload.*), which no engine reads.
MANAGER_SECTIONS = ("engine", "reload")


class InPlace(Strategy):
    """The main engine rebuilds on the target's engine section in its own
    process; the standby, if any, follows."""

    name = "in-place"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.REBUILD, Stage.VERIFY, Stage.COMMIT,
              Stage.FINISHED)
    cancel_until = Stage.RECORD
    cancel_ends = "its rebuild in place"
    main_stage = Stage.REBUILD

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        return run.model.probe.in_place_problem(run.target, run.health, memory)

    async def prepare(self, run: Run) -> None:
        """Nothing drains or switches: the gateway is only told the reload
        began, for its reload histogram (hand_back tells it the end)."""
        await run.model.probe.mark()

    async def put_main_on(self, run: Run, cfg: ModelConfig) -> None:
        """The main engine rebuilds on CFG's engine section; in a rollback
        (CFG the previous config) only when it does not run it still (a
        refused rebuild left the old runner serving)."""
        op, probe = run.op, run.model.probe
        engine = msgspec.to_builtins(cfg.engine)
        if cfg is not run.target:
            health = await probe.engine_health()
            if health is not None and probe.runs(health, engine):
                return
        answer = run.rebuilt = await probe.rebuild(engine, "main")
        phases = answer.rebuild_s or {}
        seconds = sum(phases.values())
        which = "the target" if cfg is run.target else "the previous"
        op.notes.append(f"the main engine rebuilt in place on {which} config in {seconds:.2f} s")
        log.info("reload %d of %s: the main engine rebuilt in place on %s config in %.2f s (%s)", op.id,
                 op.model, which, seconds, json.dumps(phases), extra=op.fields())

    async def verify_main(self, run: Run) -> None:
        """As after a restart, on the /health the rebuild answered (not asked again)."""
        await run.verify(run.target, health=run.rebuilt)

    async def hand_back(self, run: Run, outcome: str) -> None:
        """Done: a warm standby follows onto the target in its own process
        (rolled back: it never left the previous config). The gateway's
        reload clock ends with OUTCOME first."""
        await run.model.probe.mark(outcome)
        if outcome != State.DONE.value or not getattr(run.target, "standby", False):
            return
        op, model = run.op, run.model

        def restarting(why: str) -> None:
            log.warning("reload %d of %s: the standby did not rebuild on the target (%s); restarting %s",
                        op.id, op.model, why, model.standby_unit, extra=op.fields())
            op.notes.append(f"the standby was restarted: {why}")

        try:
            if await put_standby_on(model, msgspec.to_builtins(run.target.engine),
                                    job_timeout(run.target.timeouts.start), restarting) == "rebuilt":
                op.notes.append("the standby rebuilt in place on the target config")
        except Exception as exc:  # the main engine serves the target: the reload is done all the same
            log.error("reload %d of %s: restarting the standby failed: %s", op.id, op.model, exc,
                      extra=op.fields())
            op.notes.append(f"the standby did not follow: {exc}")

    # ------------------------------------------------------------ recovery

    async def recover_engine(self, model: ModelHandles, where: dict, reload_weights: bool = False) -> str:
        """The main engine on the config on disk: rebuilt in place when it
        answers (nothing drained, nothing refused), else as restart recovers."""
        cfg = model.load().config
        if not reload_weights and await model.probe.engine_health() is not None:
            try:
                await model.probe.rebuild(msgspec.to_builtins(cfg.engine), "main")
                return "rebuilt"
            except RebuildFailed as exc:
                log.warning("recovery: %s's engine did not rebuild in place (%s); restarting it", model.name,
                            exc, extra=where)
        return await RESTART_RECOVERY.recover_engine(model, where, reload_weights)

    async def recover_finish(self, model: ModelHandles, outcome: str, where: dict) -> None:
        """Nothing was drained; after a restart the gateway resumes (restart's
        recovery), and a warm standby goes on the config on disk."""
        if outcome == "restarted":
            await RESTART_RECOVERY.recover_finish(model, outcome, where)
        if outcome == "restored":
            return
        try:
            cfg = model.load().config
            if getattr(cfg, "standby", False) and backends.for_config(cfg).rebuilds_in_place:
                await put_standby_on(model, msgspec.to_builtins(cfg.engine), job_timeout(cfg.timeouts.start))
        except Exception as exc:
            log.error("recovery: %s's standby: %s", model.name, exc, extra=where)


RESTART_RECOVERY = Restart()  # how the main engine comes back when it cannot rebuild in place


def in_place_refusal(run: Run) -> Optional[str]:
    """Why RUN's change cannot be applied in place (the memory aside:
    InPlace.memory_problem), or None: the backend's engine rebuilds in its
    process, the serving engine says it answers the rebuild verb, nothing
    but the engine's limits (and the manager's own reload.* keys) changes,
    not the checkpoint."""
    current, target, health = run.current, run.target, run.health
    backend = backends.for_config(target)
    if not backend.rebuilds_in_place:
        return f"the {target.backend} engine cannot change its limits in its own process"
    if run.change.swaps:
        return "the checkpoint changes: its weights load in a weight daemon of their own"
    if health is None:
        return "the engine does not answer /health"
    if health.rebuilds is not True:
        return "the serving engine has no rebuild verb (an engine of an older hostd: restart it once)"
    before, after = msgspec.to_builtins(current), msgspec.to_builtins(target)
    changed = sorted(key for key in set(before) | set(after)
                     if key not in MANAGER_SECTIONS and before.get(key) != after.get(key))
    if changed:
        return f"{', '.join(changed)} changes, which the engine reads at its start"
    return None
