"""The reload strategies: one object per strategy, each holding what that
strategy is: its stages (the path of a reload that ends done, which the
Operation publishes as Stages), the stages Cancel() may end (Cancellable),
what a stage that is cancelled, interrupted or fails leaves (its restore),
and what recovery (recovery.py) does with the intent a crashed manager left
under it. reload.py keeps the skeleton every strategy shares (validate,
preflight, record, the main engine's restart and verify, commit, rollback)
and calls the chosen strategy in one place (Reload.run); choose() is the
preflight's choice among them. One second-engine driver (SecondEngine)
serves overlap and standby.

A strategy is handed the reload it runs (a reload.Reload) or the model it
recovers (a reload.ModelHandles); this module imports neither (no circle).
Adding a strategy: a class here, its entry in STRATEGIES, and its place in
choose().

Trust: nothing here is read from outside the manager: the engines, the
gateway and systemd are reached through the probe and the systemd client the
handles carry, which apply their own caps.

Four strategies, chosen by the preflight (Operation.strategy says which, and
why in the journal): `swap` (a checkpoint swap: the target's checkpoint is not
the one the main weight daemon holds), `standby` (a model with
`standby: true` whose standby answers and the gateway serves from main),
`overlap` (the default otherwise) and `restart` (forced by reload.strategy:
restart, and the fallback when the backend cannot run two engines or there is
no room for a second one; never for a swap that does not fit, which is
refused unless reload.strategy is restart).

swap: no 503 at any point; an overlap on the weights as well as the engine.

    validate -> preflight -> record -> load-next -> start-next -> switch -> settle -> restart -> verify -> resume -> retire -> commit -> finished (done)
                                          (fails, cancel, stop: as overlap's restore, the swap's pair stopped)

    load-next: model-weights-next@NAME loads the new checkpoint (its
      fingerprint to the Operation's notes and the journal);
    start-next: model-engine-swap@NAME (the second slot, on those weights)
      starts and is verified; Cancel() is honoured until here;
    switch, settle: as overlap's;
    restart: model-weights@NAME restarts on the new checkpoint and
      model-engine@NAME, bound to it, with it (systemd restarts a unit that
      BindsTo= the one restarted: the warm standby too); verify adds the digest;
    retire: the swap engine, then model-weights-next@NAME, stop.
    vllm, sglang: model-weights-next@NAME runs upstream's daemon with its
      sockets in a directory of its own (/run/hostd/NAME/next), and the swap
      engine is a bridge attached to it; where upstream retains no weights
      (CPU) the bridge loads the new checkpoint from disk.
    At rest the main pair serves, as after every reload.

standby: no 503 at any point, and the new config serves within the standby's
rebuild (about a second) instead of a whole engine start.

    validate -> preflight -> record -> rebuild -> switch -> settle -> restart -> verify -> resume -> commit -> finished (done)
                                          |          |         |           \\____(fails)___/
                                     (fails, cancel, stop)  (timeout)  rollback (main back to the previous config)
                                          |                              -> resume (standby back too) -> finished (rolled-back)
                            restore: (switch back), put the drop-in back, the standby back on
                            the previous config -> finished (rolled-back | cancelled | failed;
                            the main engine never stopped)

    rebuild: model-engine-standby@NAME rebuilds itself on the target config in
      its own process (the engine's rebuild verb: new skeleton on the same
      mapped weights, new limits, warm-up) and is verified on its own socket;
      a refused or failed rebuild leaves it on its old model. Cancel() is
      honoured until here. vllm, sglang: upstream cannot rebuild a running
      server, so here the standby is only checked (/health, a smoke request)
      and serves the config it started with while the main engine restarts;
      after a done reload it keeps that config unless the reload changed a
      key that alters which requests it accepts (max_model_len,
      context_length), and then systemd restarts it in the background;
    switch, settle, restart, verify: as overlap's, with the standby serving;
    resume: the gateway sends new requests to model-engine@NAME again; the
      standby, already on the target config, is standby again: nothing
      retires. After a rollback it is rebuilt back on the previous config
      (restarted by systemd if that fails).
    At rest model-engine@NAME serves and model-engine-standby@NAME waits on the
    committed config: the roles never swap, so `systemctl restart
    model-engine@NAME` and the journal mean what they always meant.

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

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Optional

import msgspec

from hostd import backends
from hostd.manager import errors
from hostd.manager.operation import Cancelled, Interrupted, Operation, Stage, State, transitions
from hostd.manager.probe import RebuildFailed
from hostd.manager.systemd1 import job_timeout

log = logging.getLogger("hostd.manager.reload")


async def until_asked(op: Operation, work) -> None:
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


async def put_standby_on(model, engine: dict, timeout: float, restarting=None) -> str:
    """The warm standby of MODEL (reload.ModelHandles) on ENGINE (an engine
    section: what the main engine serves): left alone when it runs it
    already ("runs"), else rebuilt there ("rebuilt"), else restarted by
    systemd within TIMEOUT, on the config on disk ("restarted", after
    RESTARTING(why) is told why). A failed restart raises."""
    probe = model.probe
    health = await probe.engine_health("standby")
    if health is not None and probe.runs(health, engine):
        return "runs"
    try:
        if health is None:
            raise RuntimeError("the standby does not answer")
        await probe.rebuild(engine)
        return "rebuilt"
    except Exception as exc:
        if restarting is not None:
            restarting(str(exc))
        await model.systemd.restart(model.standby_unit, timeout=timeout)
        return "restarted"


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

    def memory_problem(self, run, memory) -> Optional[str]:
        """Why the preflight refuses this strategy's reload for memory (MEMORY:
        its reading), or None."""
        return None

    async def apply(self, run) -> None:
        """Run RUN (a checked reload.Reload) from its record stage to its end."""
        raise NotImplementedError

    # ------------------------------------------------------------ recovery

    def second_unit(self, model) -> Optional[str]:
        """The unit beside the main engine this strategy starts or changes."""
        return None

    async def recover_engine(self, model, where: dict, reload_weights: bool = False) -> str:
        """Recovery: bring the main engine back on the config on disk (the
        files are restored already; RELOAD_WEIGHTS: the main weight daemon
        holds another checkpoint than they name, after a swap, and loads it
        too); "restarted", or "left" when it cannot be done safely."""
        raise NotImplementedError

    async def recover_finish(self, model, outcome: str, where: dict) -> None:
        """Recovery's end, after OUTCOME (committed, left, restarted,
        restored): the gateway serving again, nothing left beside the main
        engine that the reload started."""
        raise NotImplementedError


class Restart(Strategy):
    """Drain, restart the engine, resume: 503 while it restarts."""

    name = "restart"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.DRAIN, Stage.RESTART, Stage.VERIFY,
              Stage.RESUME, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.DRAIN
    cancel_ends = "its drain"

    def memory_problem(self, run, memory) -> Optional[str]:
        return run.model.probe.memory_problem(run.target, memory)

    async def apply(self, run) -> None:
        """Record and drain; a drain that is cancelled, interrupted or fails
        leaves with the file restored (and the gateway resumed unless
        stopping); else the main engine is replaced."""
        op = run.op
        try:
            await run.record_stage()
            op.enter(Stage.DRAIN)
            await until_asked(op, self.drain(run))
            if await run.stopping():
                raise Interrupted("interrupted: the model is being stopped")
        except Exception as exc:  # drain timed out, was cancelled, or the gateway failed
            op.enter(Stage.RESTORE)
            try:
                run.restore()
                if not isinstance(exc, Interrupted):
                    await run.model.probe.resume("cancelled" if isinstance(exc, Cancelled) else "failed")
            except Exception as again:  # logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            return run.end(State.CANCELLED if isinstance(exc, Cancelled) else State.FAILED, str(exc))
        await run.replace_main(self.hand_back, "the gateway did not resume")

    @staticmethod
    async def drain(run) -> None:
        timeout = run.current.reload.drain_timeout
        result = await run.model.probe.drain(timeout)
        if not result.drained:
            raise TimeoutError(
                f"drain timed out after {timeout:g} s with "
                f"{result.remaining} request(s) still running; the old engine keeps serving"
            )

    @staticmethod
    async def hand_back(run, outcome: str) -> None:
        """The drained gateway serves again."""
        run.op.enter(Stage.RESUME)
        await run.model.probe.resume(outcome)

    async def recover_engine(self, model, where: dict, reload_weights: bool = False) -> str:
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

    async def recover_finish(self, model, outcome: str, where: dict) -> None:
        if outcome == "restored":
            return
        try:
            await model.probe.resume("recovered")
        except Exception as exc:  # the gateway may be down; it starts serving on its own then
            log.warning("recovery: resuming %s: %s", model.name, exc, extra=where)


async def restart_main(model, where: dict, reload_weights: bool = False) -> str:
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


class SecondEngine(Strategy):
    """The driver overlap and standby share: a second engine (SLOT) is made
    ready on the target config (PREPARE, verified on its own socket), the
    gateway switches to it, what runs on the main engine settles, then the
    main engine restarts on the target and takes over again: no 503 at any
    point. Cancel() is honoured until the switch; a stop interrupts it there
    too."""

    slot: str  # the gateway's name of the second engine
    prepare: Stage  # the stage that makes it ready
    old: str  # what the settle's refusal calls the main engine

    async def prepare_engine(self, run) -> None:
        raise NotImplementedError

    async def put_back(self, run, failed: Optional[str], served: bool, interrupted: bool) -> None:
        """RESTORE, after the gateway went back to main: the files (FAILED: why
        the second engine failed, if it did) and the second engine as they
        were; SERVED: the gateway had switched to it."""
        raise NotImplementedError

    async def after_hand_back(self, run, outcome: str) -> None:
        """The gateway serves from main again after OUTCOME: what the second engine does now."""
        raise NotImplementedError

    async def apply(self, run) -> None:
        op, probe = run.op, run.model.probe
        switched = False
        try:
            await run.record_stage()
            op.enter(self.prepare)
            began = time.monotonic()
            await until_asked(op, self.prepare_engine(run))
            op.enter(Stage.SWITCH)
            prepared = time.monotonic()
            await probe.switch(self.slot)
            switched = True
            # Where the time to "the new config serves" went (issue 34): the journal's phases.
            log.info("reload %d of %s: new requests go to the %s engine on %s: %s %.2f s, "
                     "switch %.3f s", op.id, op.model, self.slot, self.serves(run), self.prepare.value,
                     prepared - began, time.monotonic() - prepared, extra=op.fields())
            # What runs on the main engine finishes there before it restarts.
            op.enter(Stage.SETTLE)
            await self.settle_main(run)
        except Exception as exc:  # the second engine failed, or main did not settle: main never stopped
            interrupted = isinstance(exc, Interrupted) or await run.stopping()
            if isinstance(exc, (Cancelled, TimeoutError)) or interrupted:
                cause, failed = str(exc), None
            elif isinstance(exc, RebuildFailed):  # the standby's own answer
                cause = failed = str(exc)
            else:
                cause = failed = await self.failure_cause(run, exc)
            op.enter(Stage.RESTORE)
            outcome = State.CANCELLED if isinstance(exc, Cancelled) else \
                State.ROLLED_BACK if failed is not None and run.recorded else State.FAILED
            try:
                if switched and not interrupted:
                    await probe.switch("main", outcome.value)
                await self.put_back(run, failed, switched, interrupted)
            except Exception as again:  # logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            if interrupted:
                return run.end(State.FAILED, f"interrupted: the model is being stopped ({exc})")
            return run.end(outcome, cause)
        # The second engine serves the target config and nothing runs on the
        # main one: it restarts with the target config, then takes over.
        await run.replace_main(self.hand_back, "handing the gateway back to the main engine failed")

    def serves(self, run) -> str:
        """What the second engine serves once the gateway switched to it (the journal's words)."""
        return "the target config"

    async def failure_cause(self, run, exc: Exception) -> str:
        """Why the second engine failed: its own last error lines, else EXC."""
        return await run.model.probe.engine_error(str(exc), self.slot)

    async def hand_back(self, run, outcome: str) -> None:
        run.op.enter(Stage.RESUME)
        await run.model.probe.switch("main", outcome)
        await self.after_hand_back(run, outcome)

    @staticmethod
    async def settle(run, slot: str) -> int:
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

    async def settle_main(self, run) -> None:
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

    async def recover_engine(self, model, where: dict, reload_weights: bool = False) -> str:
        return await restart_main(model, where, reload_weights)  # nothing was drained: the gateway serves meanwhile

    async def recover_finish(self, model, outcome: str, where: dict) -> None:
        main_answers = await model.probe.engine_health() is not None
        if outcome != "restored" and main_answers:
            try:
                await model.probe.switch("main", "recovered")
            except Exception as exc:  # a gateway that is down starts on main by itself
                log.warning("recovery: switching %s's gateway to the main engine: %s", model.name, exc,
                            extra=where)
        await self.recover_second(model, outcome, main_answers, where)

    async def recover_second(self, model, outcome: str, main_answers: bool, where: dict) -> None:
        raise NotImplementedError


class Overlap(SecondEngine):
    """A second engine, model-engine-next@NAME, starts beside the serving one
    on the same weights; it serves while the main engine restarts, then
    retires."""

    name = "overlap"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.START_NEXT, Stage.SWITCH, Stage.SETTLE,
              Stage.RESTART, Stage.VERIFY, Stage.RESUME, Stage.RETIRE, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.START_NEXT
    cancel_ends = "its switch to the second engine"
    slot, prepare, old = "next", Stage.START_NEXT, "old"

    async def prepare_engine(self, run) -> None:
        """Start the second engine with the target config and verify it."""
        op, model = run.op, run.model
        await model.systemd.start(model.next_unit, timeout=job_timeout(run.target.timeouts.start))
        await run.verify(run.target, "next")
        health = await model.probe.engine_health("next")
        bridge = health.bridge if health is not None else None
        if bridge:  # vllm, sglang: the next engine runs on a KV budget of its own
            op.notes.append(f"bridge engine ran with {bridge}")
            log.info("reload %d of %s: the bridge engine runs with %s", op.id, op.model, bridge,
                     extra=op.fields())

    async def put_back(self, run, failed, served, interrupted) -> None:
        # The next engine stops before the intent goes (restore drops it): a
        # manager killed meanwhile leaves a record whose recovery stops it.
        await self.retire(run, served)
        run.restore(failed)

    async def after_hand_back(self, run, outcome: str) -> None:
        run.op.enter(Stage.RETIRE)
        await self.retire(run)

    async def retire(self, run, served: bool = True) -> None:
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

    def second_unit(self, model) -> Optional[str]:
        return model.next_unit

    async def stop_second(self, model, timeout: float) -> None:
        """Stop what this strategy started beside the main engine."""
        await model.systemd.stop(self.second_unit(model), timeout=timeout)

    async def recover_second(self, model, outcome, main_answers, where) -> None:
        """Exactly one engine is left: the next one stops, unless the main
        engine does not answer (then it keeps serving)."""
        if outcome == "restored" or main_answers:
            await self.stop_second(model, job_timeout(model.load().config.timeouts.stop))
        else:
            log.error("recovery: %s's main engine does not answer; its second engine (%s) keeps serving",
                      model.name, self.second_unit(model), extra=where)


class Swap(Overlap):
    """A checkpoint swap (a reload that changes `model:`): a second
    weight daemon, model-weights-next@NAME, loads the new checkpoint beside
    the serving pair, model-engine-swap@NAME serves from it in the second
    slot while the main pair (weight daemon, then engine) restarts on the
    new checkpoint, then both retire. An overlap on the weights as well as
    the engine: no 503, and at rest the main pair serves as ever."""

    name = "swap"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.LOAD_NEXT, Stage.START_NEXT, Stage.SWITCH,
              Stage.SETTLE, Stage.RESTART, Stage.VERIFY, Stage.RESUME, Stage.RETIRE, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.START_NEXT
    cancel_ends = "its switch to the new checkpoint's engine"
    slot, prepare, old = "next", Stage.LOAD_NEXT, "old"

    def memory_problem(self, run, memory) -> Optional[str]:
        return swap_problem(run, memory)

    async def prepare_engine(self, run) -> None:
        """LOAD_NEXT: the new checkpoint's weight daemon starts (it loads
        and checks the checkpoint: a missing shard or a bad config.json fails
        here, in its journal); START_NEXT: its engine starts and is verified
        on its own socket, attached to that daemon, on the daemon's digest."""
        op, model, probe = run.op, run.model, run.model.probe
        timeout = job_timeout(run.target.timeouts.start)
        await model.systemd.start(model.next_weights_unit, timeout=timeout)
        status = await probe.weights_status("next")
        if status is None:
            raise RuntimeError(f"{model.next_weights_unit} started but does not answer")
        fp = status.fingerprint
        described = (f"{fp.model_path} (architecture {fp.architecture}, dtype {fp.dtype}, "
                     f"content digest {fp.content_digest})")
        op.notes.append(f"new checkpoint: {described}")
        log.info("reload %d of %s: the new checkpoint is loaded: %s", op.id, op.model, described,
                 extra=op.fields(hostd_checkpoint=fp.model_path, hostd_content_digest=fp.content_digest))
        run.digest = fp.content_digest
        op.enter(Stage.START_NEXT)
        await model.systemd.start(model.swap_unit, timeout=timeout)
        await probe.verify_engine(run.target, (status.pid, status.socket_inode), "next", weights_slot="next")

    async def after_hand_back(self, run, outcome: str) -> None:
        await super().after_hand_back(run, outcome)
        if outcome == State.DONE.value:
            run.op.notes.append(f"the main pair serves the new checkpoint; {run.model.next_weights_unit} "
                                "and its engine stopped")

    def second_unit(self, model) -> Optional[str]:
        return model.swap_unit

    async def failure_cause(self, run, exc: Exception) -> str:
        """The new weight daemon's own words when the checkpoint did not
        load, else the swap engine's."""
        model = run.model
        unit = model.next_weights_unit if run.op.stage == Stage.LOAD_NEXT else model.swap_unit
        return await model.probe.engine_error(str(exc), "next", unit)

    async def stop_second(self, model, timeout: float) -> None:
        """The swap's engine, then the new checkpoint's weight daemon (its
        copy of the weights)."""
        await model.systemd.stop(model.swap_unit, timeout=timeout)
        await model.systemd.stop(model.next_weights_unit, timeout=timeout)


def checkpoint_bytes(directory: str) -> int:
    """The bytes of the weight files of the checkpoint DIRECTORY (what a
    second weight daemon holds of it, at the dtype it is stored in); 0 when
    it cannot be read (the daemon's load then says why)."""
    try:
        return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors") if p.is_file())
    except OSError:
        return 0


def swap_problem(run, memory) -> Optional[str]:
    """Why the new checkpoint's weights and a second engine do not fit beside
    the serving pair (the overlap preflight with the weights counted), or None.
    On GPUs each one holds its shard of the new copy (tensor parallel).
    Where upstream retains no weights (vllm, sglang on CPU) the new weight
    daemon holds none: the swap's engine, a bridge, loads its own copy, which
    its need (bridge_need) counts already."""
    cfg = run.target
    backend = backends.for_config(cfg)
    weights = 0 if backend.weights_not_retained(cfg) else checkpoint_bytes(run.checkpoint)
    if backend.uses_gpu(cfg):
        weights //= max(1, getattr(cfg, "tensor_parallel_size", 1))  # builtin: one GPU
    problem = run.model.probe.overlap_problem(run.target, run.health, memory, weights, swap=True)
    if problem:
        return f"a checkpoint swap does not fit: {problem}"
    return None


class Standby(SecondEngine):
    """The warm standby, model-engine-standby@NAME, rebuilds on the target
    config in its own process and serves while the main engine restarts;
    then it is standby again (never stopped), on the config main serves."""

    name = "standby"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.REBUILD, Stage.SWITCH, Stage.SETTLE,
              Stage.RESTART, Stage.VERIFY, Stage.RESUME, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.REBUILD
    cancel_ends = "its switch to the standby"
    slot, prepare, old = "standby", Stage.REBUILD, "main"

    async def prepare_engine(self, run) -> None:
        """The standby rebuilds on the target config in its own process and
        is verified on its own socket (as start-next verifies the next
        engine). An upstream standby (vllm, sglang) cannot rebuild: it is
        checked on the config it serves, which it keeps while the main engine
        restarts on the target."""
        op = run.op
        if not rebuilds(run.target):
            return await self.check_upstream_standby(run)
        answer = await run.model.probe.rebuild(msgspec.to_builtins(run.target.engine))
        phases = answer.get("rebuild_s") if isinstance(answer.get("rebuild_s"), dict) else {}
        seconds = sum(v for v in phases.values() if isinstance(v, (int, float)))
        op.notes.append(f"standby rebuilt in {seconds:.2f} s")
        log.info("reload %d of %s: the standby rebuilt on the target config in %.2f s (%s)", op.id,
                 op.model, seconds, json.dumps(phases), extra=op.fields())
        await run.verify(run.target, "standby")

    def serves(self, run) -> str:
        return "the target config" if rebuilds(run.target) else "the config it started with"

    async def check_upstream_standby(self, run) -> None:
        """vllm, sglang: the standby answers /health and a smoke request on
        its own socket; what it serves goes to the notes (new requests get
        that config until the main engine serves the target)."""
        op, probe = run.op, run.model.probe
        health = await probe.engine_health("standby")
        if health is None:
            raise RuntimeError(f"the standby ({run.model.standby_unit}) does not answer /health")
        await probe.smoke(run.target.served_model_name or run.model.name, "standby")
        serves = health.engine_config if isinstance(health.engine_config, dict) else {}
        words = ", ".join(f"{k} {v}" for k, v in sorted(serves.items())) or "its start's config"
        op.notes.append(f"the standby serves while the main engine restarts, on {words}"
                        + (f" and {health.bridge}" if health.bridge else ""))
        log.info("reload %d of %s: the %s standby serves on the config it started with (%s) while the main "
                 "engine restarts", op.id, op.model, run.target.backend, words, extra=op.fields())

    async def put_back(self, run, failed, served, interrupted) -> None:
        # The files first: a standby that cannot rebuild is restarted by
        # systemd, which reads them.
        run.restore(failed)
        if not interrupted and run.recorded and rebuilds(run.target):
            await self.standby_back(run)

    async def after_hand_back(self, run, outcome: str) -> None:
        if not rebuilds(run.target):  # the upstream standby never changed; done: serve the target too
            if outcome == State.DONE.value:
                await self.upstream_standby_follows(run)
        elif outcome != State.DONE.value:  # done: it runs the target, which main serves now
            await self.standby_back(run)

    @staticmethod
    async def upstream_standby_follows(run) -> None:
        """After a done reload of a vllm/sglang model: the standby keeps the
        config it started with when it answers the target's requests as the
        main engine does (only capacity keys differ: Backend.standby_restart_reason);
        else systemd restarts it on the config on disk (the target), in the
        background: the reload ends now, and until the standby serves again
        a crash of the main engine answers 503 (docs/operations.md)."""
        op, model = run.op, run.model
        health = await model.probe.engine_health("standby")
        running = health.engine_config if health is not None and isinstance(health.engine_config, dict) else None
        target = msgspec.to_builtins(run.target.engine)
        why = (backends.for_config(run.target).standby_restart_reason(running, target) if running is not None
               else "it does not answer")
        if why is None:
            op.notes.append("the standby keeps the config it started with: the reload changed no key that "
                            "alters which requests it accepts")
            return
        op.notes.append(f"the standby restarts on the new config in the background ({why})")
        log.info("reload %d of %s: the standby restarts on the new config in the background (%s)", op.id,
                 op.model, why, extra=op.fields())
        restart_in_background(model, model.standby_unit, job_timeout(run.target.timeouts.start))

    @staticmethod
    async def standby_back(run) -> None:
        """The standby back on what the main engine serves (the previous
        config). Its trouble never changes how the reload ended: it is in
        the journal and the Operation's notes."""
        op, model = run.op, run.model
        if run.running_engine is None:
            return

        def restarting(why: str) -> None:
            log.warning("reload %d of %s: the standby did not go back to the serving config (%s); restarting %s",
                        op.id, op.model, why, model.standby_unit,
                        extra=op.fields())
            op.notes.append(f"the standby was restarted: {why}")

        await put_standby_on(model, run.running_engine, job_timeout(run.current.timeouts.start), restarting)

    def second_unit(self, model) -> Optional[str]:
        return model.standby_unit

    async def recover_second(self, model, outcome, main_answers, where) -> None:
        """The standby on the config on disk (what main serves), never stopped.
        An upstream standby was never changed by the reload: systemd keeps
        it (Restart=on-failure)."""
        if outcome == "restored":
            return
        cfg = model.load().config
        if not rebuilds(cfg):
            return

        def restarting(why: str) -> None:
            log.warning("recovery: %s's standby (%s): %s; restarting it", model.name, model.standby_unit, why,
                        extra=where)

        try:
            if await put_standby_on(model, msgspec.to_builtins(cfg.engine), job_timeout(cfg.timeouts.start),
                                    restarting) == "rebuilt":
                log.info("recovery: %s's standby rebuilt on the config on disk", model.name, extra=where)
        except Exception as exc:
            log.error("recovery: restarting %s failed: %s", model.standby_unit, exc, extra=where)


def rebuilds(cfg) -> bool:
    """Does CFG's standby rebuild in its process (builtin), or serve the
    config it started with (vllm, sglang)?"""
    return backends.for_config(cfg).standby_rebuilds


# Jobs the manager started and does not wait for (restart_in_background):
# held here so that the event loop keeps them to their end.
_BACKGROUND: set = set()


def restart_in_background(model, unit: str, timeout: float) -> None:
    """systemd restarts UNIT of MODEL; the caller goes on. Its end is logged."""

    async def restart() -> None:
        try:
            await model.systemd.restart(unit, timeout=timeout)
            log.info("%s restarted on the config on disk", unit)
        except Exception as exc:  # systemd's Restart= and the journal have the rest
            log.error("restarting %s failed: %s", unit, exc)

    task = asyncio.ensure_future(restart())
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


RESTART, OVERLAP, STANDBY, SWAP = Restart(), Overlap(), Standby(), Swap()
STRATEGIES = {strategy.name: strategy for strategy in (RESTART, OVERLAP, STANDBY, SWAP)}


def named(name: str) -> Strategy:
    """The strategy NAME (an Intent's record on disk); records of an older
    manager had none and were all restarts, and so is a name this manager
    does not know (recovery then drains before it restarts anything)."""
    return STRATEGIES.get(name, RESTART)


async def choose(run, memory) -> tuple[Strategy, str]:
    """The preflight's choice for RUN (a reload.Reload after validate;
    MEMORY: the preflight's one reading) and why: standby when the model's
    warm standby can take it (standby_problem), else overlap when configured,
    possible for the backend and there is room for a second engine beside the
    first, else restart. Its notes go to the Operation; a refusal for
    memory raises (errors.InsufficientMemory, by the caller)."""
    op, current = run.op, run.current
    if run.checkpoint is not None:
        return choose_swap(run, memory)
    standby = await standby_problem(run)
    if standby is None:
        return STANDBY, ("the warm standby rebuilds on the new config" if rebuilds(current) else
                         "the warm standby serves while the main engine restarts")
    if standby:
        op.notes.append(f"no standby reload: {standby}")
        if not run.dry_run:
            log.info("reload %d of %s: no standby reload (%s); as without a standby", op.id, op.model,
                     standby, extra=op.fields())
    if current.reload.strategy == RESTART.name:
        return RESTART, "reload.strategy is restart"
    problem = run.model.probe.overlap_problem(run.target, run.health, memory)
    if problem:
        why = f"overlap does not fit, falling back to restart: {problem}"
        op.notes.append(f"strategy restart: {why}")  # a fallback: the Operation says why, as the journal does
        return RESTART, why
    return OVERLAP, "room for a second engine beside the serving one"


def choose_swap(run, memory) -> tuple[Strategy, str]:
    """A checkpoint swap: under reload.strategy restart, the model's weights
    and engine restart on the new checkpoint (503 meanwhile); otherwise the
    swap strategy, when the new weights and a second engine fit, else a
    refusal with the numbers. Never a silent fallback to restart: an
    unplanned 503 window of a whole weights load is not what `overlap` asks."""
    if run.current.reload.strategy == RESTART.name:
        return RESTART, ("reload.strategy is restart: the checkpoint swap stops the engine and weights "
                         "and starts them on the new checkpoint (503 meanwhile)")
    problem = swap_problem(run, memory)
    if problem:
        raise errors.InsufficientMemory(f"{problem}; with reload.strategy: restart the swap runs with a "
                                        "503 window instead")
    return SWAP, "room for the new checkpoint's weights and a second engine beside the serving pair"


async def standby_problem(run) -> Optional[str]:
    """Why the standby cannot take RUN's reload ("" when the model has
    none), or None when it can: standby: true, reload.strategy is not
    restart, the standby answers, and the gateway sends new requests to the
    main engine (not during a failover)."""
    current, probe = run.current, run.model.probe
    if not getattr(current, "standby", False) or current.reload.strategy == RESTART.name:
        return ""
    if await probe.engine_health("standby") is None:
        return f"the standby ({run.model.standby_unit}) does not answer"
    status = await probe.gateway_status()
    if status is None:
        return "the gateway does not answer"
    if status.slot != "main":
        return f"the gateway sends new requests to the {status.slot} engine (a failover), not the main one"
    return None
