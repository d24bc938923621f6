"""The swap strategy (Swap), a checkpoint swap: the target's checkpoint is
not the one the main weight daemon holds. Its preflight (swap_problem) is
here, its choice in choose_swap (strategies/__init__.py).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.

swap: no 503 at any point; an overlap on the weights as well as the engine.

    validate -> preflight -> record -> load-next -> start-next -> switch -> settle -> restart -> verify -> resume -> retire -> commit -> finished (done)
                                          (fails, cancel, stop: as overlap's restore, the swap's pair stopped)

    load-next: model-weights-next@NAME loads the new checkpoint (its
      fingerprint to the Operation's notes and the journal);
    start-next: model-engine-swap@NAME (the second slot, on those weights)
      starts and is verified; Cancel() is honoured until here;
    switch, settle: as overlap's (overlap.py);
    restart: model-weights@NAME restarts on the new checkpoint and
      model-engine@NAME, bound to it, with it (systemd restarts a unit that
      BindsTo= the one restarted: the warm standby too); verify adds the digest;
    retire: the swap engine, then model-weights-next@NAME, stop.
    vllm, sglang: model-weights-next@NAME runs upstream's daemon with its
      sockets in a directory of its own (/run/hostd/NAME/next), and the swap
      engine is a bridge attached to it; where upstream retains no weights
      (CPU) the bridge loads the new checkpoint from disk.
    At rest the main pair serves, as after every reload.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from hostd import backends
from hostd.backends.base import checkpoint_bytes
from hostd.manager.operation import Stage, State
from hostd.manager.probe import VerifyFailed
from hostd.manager.strategies.overlap import Overlap
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.manager.strategies.base import Run
    from hostd.manager.reload import ModelHandles
    from hostd.manager.preflight import Memory

log = logging.getLogger("hostd.manager.reload")


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
    slot, prepare_stage, old = "next", Stage.LOAD_NEXT, "old"

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        return swap_problem(run, memory)

    async def prepare_engine(self, run: Run) -> None:
        """LOAD_NEXT: the new checkpoint's weight daemon starts (it loads
        and checks the checkpoint: a missing shard or a bad config.json fails
        here, in its journal); START_NEXT: its engine starts and is verified
        on its own socket, attached to that daemon, on the daemon's digest."""
        op, model, probe = run.op, run.model, run.model.probe
        timeout = job_timeout(run.target.timeouts.start)
        # A pair left by an earlier swap (a stop that failed after its end):
        # this reload would start on that daemon and its checkpoint.
        await retire_leftover_pair(model, job_timeout(run.target.timeouts.stop), f"before reload {op.id}")
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
        run.change.digest = fp.content_digest
        op.enter(Stage.START_NEXT)
        await model.systemd.start(model.swap_unit, timeout=timeout)
        await probe.verify_engine(run.target, (status.pid, status.socket_inode), "next", weights_slot="next")

    async def verify_main(self, run: Run) -> None:
        """The main engine runs the target on the weights the new
        checkpoint's daemon reported (its content digest)."""
        await super().verify_main(run)
        if run.change.digest is None:
            return
        health = await run.model.probe.engine_health()
        seen = health.content_digest if health is not None and isinstance(health.content_digest, str) else None
        if seen != run.change.digest:
            raise VerifyFailed(f"the main engine serves weights of content digest {seen}, "
                               f"not the new checkpoint's {run.change.digest}")

    async def after_hand_back(self, run: Run, outcome: str) -> None:
        await super().after_hand_back(run, outcome)
        if outcome == State.DONE.value:
            run.op.notes.append(f"the main pair serves the new checkpoint; {run.model.next_weights_unit} "
                                "and its engine stopped")

    def second_unit(self, model: ModelHandles) -> Optional[str]:
        return model.swap_unit

    async def failure_cause(self, run: Run, exc: Exception) -> str:
        """The new weight daemon's own words when the checkpoint did not
        load, else the swap engine's."""
        model = run.model
        unit = model.next_weights_unit if run.op.stage == Stage.LOAD_NEXT else model.swap_unit
        return await model.probe.engine_error(str(exc), "next", unit)

    async def stop_second(self, model: ModelHandles, timeout: float) -> None:
        await stop_pair(model, timeout)


async def stop_pair(model: ModelHandles, timeout: float) -> None:
    """The swap's engine, then the new checkpoint's weight daemon (its copy
    of the weights), the second even when the first stop fails (a full copy
    of the weights left on a GPU otherwise); the first failure is raised
    once both were asked."""
    failures = []
    for unit in (model.swap_unit, model.next_weights_unit):
        try:
            await model.systemd.stop(unit, timeout=timeout)
        except Exception as exc:
            log.error("stopping %s failed: %s", unit, exc, extra={"hostd_model": model.name})
            failures.append(exc)
    if failures:
        raise failures[0]


async def retire_leftover_pair(model: ModelHandles, timeout: Optional[float], when: str) -> bool:
    """Stop a swap's second pair (model-engine-swap@NAME,
    model-weights-next@NAME) that runs WHEN no reload accounts for it: at
    the manager's start for a model without an intent record, and before a
    swap's load-next. True when one ran; a stop that fails is raised."""
    running = [unit for unit in (model.swap_unit, model.next_weights_unit)
               if await model.systemd.active_state(unit) not in ("inactive", "failed")]
    if not running:
        return False
    log.warning("%s: %s ran with no reload accounting for it (a swap's second pair left behind); stopping it",
                when, " and ".join(running), extra={"hostd_model": model.name})
    await stop_pair(model, timeout)
    return True


def swap_problem(run: Run, memory: Memory) -> Optional[str]:
    """Why the new checkpoint's weights and a second engine do not fit beside
    the serving pair (the overlap preflight with the weights counted), or None.
    On GPUs each one holds its shard of the new copy (tensor parallel).
    Where upstream retains no weights (vllm, sglang on CPU) the new weight
    daemon holds none: the swap's engine, a bridge, loads its own copy, which
    its need (bridge_need) counts already."""
    cfg = run.target
    backend = backends.for_config(cfg)
    weights = 0 if backend.weights_not_retained(cfg) else checkpoint_bytes(run.change.checkpoint)
    if backend.uses_gpu(cfg):
        weights //= max(1, getattr(cfg, "tensor_parallel_size", 1))  # builtin: one GPU
    problem = run.model.probe.overlap_problem(run.target, run.health, memory, weights, swap=True)
    if problem:
        return f"a checkpoint swap does not fit: {problem}"
    return None
