"""The standby strategy (Standby): a reload through the model's warm
standby, model-engine-standby@NAME, and the helpers that put the standby
back on what the main engine serves. When it is chosen: standby_problem
and choose() (strategies/__init__.py).

Trust: the package's (strategies/__init__.py); nothing here is read from
outside the manager.

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
    switch, settle, restart, verify: as overlap's (overlap.py), with the standby serving;
    resume: the gateway sends new requests to model-engine@NAME again; the
      standby, already on the target config, is standby again: nothing
      retires. After a rollback it is rebuilt back on the previous config
      (restarted by systemd if that fails).
    At rest model-engine@NAME serves and model-engine-standby@NAME waits on the
    committed config: the roles never swap, so `systemctl restart
    model-engine@NAME` and the journal mean what they always meant.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Optional

import msgspec

from hostd import backends
from hostd.manager import tasks
from hostd.manager.operation import Stage, State
from hostd.manager.strategies.second_engine import SecondEngine
from hostd.manager.systemd1 import job_timeout

if TYPE_CHECKING:
    from hostd.manager.strategies.base import Run
    from hostd.manager.preflight import Memory
    from hostd.manager.reload import ModelHandles

log = logging.getLogger("hostd.manager.reload")


class Standby(SecondEngine):
    """The warm standby, model-engine-standby@NAME, rebuilds on the target
    config in its own process and serves while the main engine restarts;
    then it is standby again (never stopped), on the config main serves."""

    name = "standby"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.REBUILD, Stage.SWITCH, Stage.SETTLE,
              Stage.RESTART, Stage.VERIFY, Stage.RESUME, Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.REBUILD
    cancel_ends = "its switch to the standby"
    slot, prepare_stage, old = "standby", Stage.REBUILD, "main"

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        """The main engine restarts on the target as under restart, while the
        standby serves: a builtin standby grows to the target's full KV cache
        beside it (Preflight.memory_problem's STANDBY_GROWS)."""
        return run.model.probe.memory_problem(run.target, memory, standby_grows=True)

    async def prepare_engine(self, run: Run) -> None:
        """The standby rebuilds on the target config in its own process and
        is verified on its own socket (as start-next verifies the next
        engine)."""
        op = run.op
        answer = await run.model.probe.rebuild(msgspec.to_builtins(run.target.engine))
        phases = answer.rebuild_s or {}
        seconds = sum(phases.values())
        op.notes.append(f"standby rebuilt in {seconds:.2f} s")
        log.info("reload %d of %s: the standby rebuilt on the target config in %.2f s (%s)", op.id,
                 op.model, seconds, json.dumps(phases), extra=op.fields())
        await run.verify(run.target, "standby", health=answer)

    async def put_back(self, run: Run, failed: Optional[str], served: bool, interrupted: bool) -> None:
        # The files first: a standby that cannot rebuild is restarted by
        # systemd, which reads them.
        run.restore(failed)
        if not interrupted and run.recorded:
            await self.standby_back(run)

    async def after_hand_back(self, run: Run, outcome: str) -> None:
        if outcome != State.DONE.value:  # done: it runs the target, which main serves now
            await self.standby_back(run)

    @staticmethod
    async def standby_back(run: Run) -> None:
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

    def second_unit(self, model: ModelHandles) -> Optional[str]:
        return model.standby_unit

    async def recover_second(self, model: ModelHandles, outcome: str, main_answers: bool, where: dict) -> None:
        """The standby on the config on disk (what main serves), never stopped.
        An upstream standby was never changed by the reload: systemd keeps
        it (Restart=on-failure)."""
        if outcome == "restored":
            return
        cfg = model.load().config

        def restarting(why: str) -> None:
            log.warning("recovery: %s's standby (%s): %s; restarting it", model.name, model.standby_unit, why,
                        extra=where)

        try:
            if await put_standby_on(model, msgspec.to_builtins(cfg.engine), job_timeout(cfg.timeouts.start),
                                    restarting) == "rebuilt":
                log.info("recovery: %s's standby rebuilt on the config on disk", model.name, extra=where)
        except Exception as exc:
            log.error("recovery: restarting %s failed: %s", model.standby_unit, exc, extra=where)


class UpstreamStandby(Standby):
    """The standby of a vllm or sglang model: upstream cannot rebuild a
    running server, so it serves the config it started with while the main
    engine restarts on the target; after a done reload it keeps that config
    or systemd restarts it on the target (upstream_standby_follows). The
    reload's stages are the builtin standby's; its rebuild stage only checks
    the standby (/health, a smoke request)."""

    def memory_problem(self, run: Run, memory: Memory) -> Optional[str]:
        """The main engine restarts on the target as under restart; the
        standby keeps the memory it holds."""
        return run.model.probe.memory_problem(run.target, memory)

    def serves(self, run: Run) -> str:
        return "the config it started with"

    async def prepare_engine(self, run: Run) -> None:
        """The standby answers /health and a smoke request on its own socket;
        what it serves goes to the notes (new requests get that config until
        the main engine serves the target)."""
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

    async def put_back(self, run: Run, failed: Optional[str], served: bool, interrupted: bool) -> None:
        run.restore(failed)  # the standby never changed

    async def after_hand_back(self, run: Run, outcome: str) -> None:
        if outcome == State.DONE.value:  # it never changed; done: serve the target too
            await self.upstream_standby_follows(run)

    @staticmethod
    async def upstream_standby_follows(run: Run) -> None:
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

    async def recover_second(self, model: ModelHandles, outcome: str, main_answers: bool, where: dict) -> None:
        """The reload never changed it: systemd keeps it (Restart=on-failure)."""


async def put_standby_on(model: ModelHandles, engine: dict, timeout: float,
                         restarting: Optional[Callable[[str], None]] = None) -> str:
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


def restart_in_background(model: ModelHandles, unit: str, timeout: float) -> None:
    """systemd restarts UNIT of MODEL; the caller goes on. Its end is logged."""

    async def restart() -> None:
        try:
            await model.systemd.restart(unit, timeout=timeout)
            log.info("%s restarted on the config on disk", unit)
        except Exception as exc:  # systemd's Restart= and the journal have the rest
            log.error("restarting %s failed: %s", unit, exc)

    tasks.keep(asyncio.ensure_future(restart()))  # the manager's one keeper
