"""Recovery: the end of a reload that a previous manager left half done (its
intent is in the manager's records, records.py, from the `record` stage on).

It decides on its next start: commit if the engine runs the target config
and passes the reload's full verify (the record written from the intent);
otherwise the files go back to what they were before the reload, except a
99-rollback.yaml the reload's own rollback pinned (Intent.rollback_pin),
which stays; then leave an engine that runs the previous config alone (the crash came before its
restart); else restart it with the previous config and resume (after a drain
for the restart strategy). Recovery never stops an engine that still has
admitted requests without draining it first, and after an overlap reload
leaves exactly one engine serving. After a standby reload it leaves the main
engine serving and the standby on the config main serves (committed or
rolled back): rebuilt there, or restarted by systemd when that fails.
"""

from __future__ import annotations

import logging
from typing import Optional

import msgspec

from hostd.manager.dropins import RELOAD_DROPIN, ROLLBACK_DROPIN, restore_file
from hostd.manager.operation import Strategy
from hostd.manager.records import Intent
from hostd.manager.reload import ModelHandles

log = logging.getLogger("hostd.manager.reload")

async def recover(model: ModelHandles, intent: Intent) -> str:
    """End the reload a previous manager left half done (INTENT is its record).
    Returns what it did: committed, left (the engine runs the previous config),
    restarted, or restored (the model is stopped: files only).

    The decision is made on the main engine, whatever the strategy. After an
    overlap reload nothing was drained (the gateway may be serving from the
    second engine meanwhile), so the main engine restarts without a drain, and
    at the end the gateway goes back to it and the second engine stops: exactly
    one engine is left."""
    name, probe, systemd = model.name, model.probe, model.systemd
    where = {"hostd_model": name, "hostd_operation": str(intent.operation)}
    standby = intent.strategy == Strategy.STANDBY.value
    overlap = standby or intent.strategy == Strategy.OVERLAP.value  # nothing was drained
    # An engine restarted just before the crash may still be starting: let it
    # finish (or fail) before deciding what it runs.
    await systemd.settle(model.engine_unit, timeout=300)
    if overlap:
        await systemd.settle(model.standby_unit if standby else model.next_unit, timeout=300)
    health = await probe.engine_health()
    target = await _verified_target(model, intent, health, where)
    if target is not None:
        log.info("recovery: %s runs the target of reload %s and passes its verify; committing",
                 name, intent.operation, extra=where)
        model.records.write_committed(name, target, intent.weights)
        outcome = "committed"
    else:
        directory = model.dropins
        restore_file(directory / RELOAD_DROPIN, intent.previous_reload)
        # The reload's own rollback may have pinned the values an engine
        # refused away (Intent.rollback_pin): that pin stays, or no later
        # engine start would be safe from them.
        pin = intent.rollback_pin if intent.rollback_pin is not None else intent.previous_rollback
        restore_file(directory / ROLLBACK_DROPIN, pin)
        previous = intent.previous_engine
        if health is not None and previous is not None and probe.runs(health, previous):
            log.info("recovery: %s still runs the config before reload %s; files restored, engine left alone",
                     name, intent.operation, extra=where)
            outcome = "left"
        elif await systemd.active_state(model.umbrella_unit) in ("active", "reloading"):
            log.warning("recovery: %s does not run the target of reload %s; restarting its engine%s",
                        name, intent.operation, "" if overlap else " after a drain", extra=where)
            outcome = await (_restart_main(model, where) if overlap else _restart_drained(model))
        else:  # never start a stopped model
            log.info("recovery: %s is stopped; files restored", name, extra=where)
            outcome = "restored"
    if overlap:
        await _leave_one_engine(model, outcome, where, standby)
    elif outcome != "restored":
        try:
            await probe.resume("recovered")
        except Exception as exc:  # the gateway may be down; it starts serving on its own then
            log.warning("recovery: resuming %s: %s", name, exc, extra=where)
    model.records.drop_intent(name)
    return outcome


async def _verified_target(model: ModelHandles, intent: Intent, health: Optional[dict], where: dict):
    """The reload's target config (the intent's engine section over the fixed
    fields on disk) when the engine runs it, the files on disk still say it
    (not so after a crash inside a rollback, which restores them first) and it
    passes the reload's full verify (health, a smoke request, the same weight
    daemon); else None: the reload did not succeed and recovery undoes it."""
    if health is None or not model.probe.runs(health, intent.target_engine):
        return None
    cfg = model.load().config
    if msgspec.to_builtins(cfg.engine) != intent.target_engine:
        log.warning("recovery: %s runs the target of reload %s, but its files say otherwise "
                    "(the crash came inside its rollback); finishing the rollback",
                    model.name, intent.operation, extra=where)
        return None
    target = msgspec.structs.replace(cfg, engine=msgspec.convert(intent.target_engine, type(cfg.engine)))
    try:
        await model.probe.verify_engine(target, intent.weights)
    except Exception as exc:
        log.warning("recovery: %s runs the target of reload %s, but it fails verification: %s",
                    model.name, intent.operation, exc, extra=where)
        return None
    return target


async def _restart_main(model: ModelHandles, where: dict) -> str:
    """Restart the main engine with the config on disk (overlap: no drain)."""
    try:
        await model.systemd.restart(model.engine_unit, timeout=model.load().config.timeouts.start + 30)
    except Exception as exc:
        log.error("recovery: restarting the engine of %s failed: %s", model.name, exc, extra=where)
    return "restarted"


async def _leave_one_engine(model: ModelHandles, outcome: str, where: dict, standby: bool = False) -> None:
    """After an overlap: the gateway back on the main engine, the next one
    stopped. After a standby reload: the gateway back on the main engine, the
    standby on the config on disk (what main serves), never stopped."""
    main_answers = await model.probe.engine_health() is not None
    if outcome != "restored" and main_answers:
        try:
            await model.probe.switch("main", "recovered")
        except Exception as exc:  # a gateway that is down starts on main by itself
            log.warning("recovery: switching %s's gateway to the main engine: %s", model.name, exc, extra=where)
    if standby:
        if outcome != "restored":
            await _standby_on_disk_config(model, where)
        return
    if outcome == "restored" or main_answers:
        await model.systemd.stop(model.next_unit, timeout=model.load().config.timeouts.stop + 30)
    else:
        log.error("recovery: %s's main engine does not answer; its second engine (%s) keeps serving",
                  model.name, model.next_unit, extra=where)


async def _standby_on_disk_config(model: ModelHandles, where: dict) -> None:
    """The standby rebuilt on the engine section on disk (what the main
    engine serves now) unless it runs it already; restarted when it cannot."""
    engine = msgspec.to_builtins(model.load().config.engine)
    health = await model.probe.engine_health("standby")
    if health is not None and model.probe.runs(health, engine):
        return
    try:
        if health is None:
            raise RuntimeError("it does not answer")
        await model.probe.rebuild(engine)
        log.info("recovery: %s's standby rebuilt on the config on disk", model.name, extra=where)
    except Exception as exc:
        log.warning("recovery: %s's standby (%s): %s; restarting it", model.name, model.standby_unit, exc,
                    extra=where)
        try:
            await model.systemd.restart(model.standby_unit, timeout=model.load().config.timeouts.start + 30)
        except Exception as again:
            log.error("recovery: restarting %s failed: %s", model.standby_unit, again, extra=where)


async def _restart_drained(model: ModelHandles) -> str:
    """Restart the engine with the config on disk, after draining what it admitted."""
    cfg = model.load().config
    try:
        drained = (await model.probe.drain(cfg.reload.drain_timeout)).drained
    except Exception as exc:  # no gateway: nothing was admitted through it
        log.warning("recovery: draining %s: %s", model.name, exc)
        drained = True
    if not drained:
        log.error("recovery: %s did not drain in %g s; its engine is left running (systemctl reload %s "
                  "once it is idle)", model.name, cfg.reload.drain_timeout, model.umbrella_unit)
        return "left"
    try:
        await model.systemd.restart(model.engine_unit, timeout=cfg.timeouts.start + 30)
    except Exception as exc:
        log.error("recovery: restarting the engine of %s failed: %s", model.name, exc)
    return "restarted"
