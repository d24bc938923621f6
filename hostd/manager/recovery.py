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

On the bus (claim, recover_claimed): each recovery is an Operation of kind
"recovery", claimed before the manager owns its bus name, so the model is
busy to any caller until its recovery ends.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import msgspec

from hostd.engine.health import EngineHealth
from hostd.manager import strategies
from hostd.manager.dropins import RELOAD_DROPIN, ROLLBACK_DROPIN, pin_checkpoint, restore_file
from hostd.manager.operation import State, journal_fields
from hostd.manager.records import Intent
from hostd.manager.reload import ModelHandles
from hostd.manager.strategies.swap import retire_leftover_pair
from hostd.manager.systemd1 import job_timeout

log = logging.getLogger("hostd.manager.reload")


async def recover(model: ModelHandles, intent: Intent) -> str:
    """End the reload a previous manager left half done (INTENT is its record).
    Returns what it did: committed, left (the engine runs the previous config),
    restarted, rebuilt (in place, the in-place strategy's), or restored (the
    model is stopped: files only).

    The decision is made on the main engine, whatever the strategy; the
    strategy the intent names (strategies.named) says how the main engine is
    brought back (after a drain, or not: an overlap or standby reload drained
    nothing, and the gateway may be serving from the second engine meanwhile)
    and what is left beside it at the end (exactly one engine after an
    overlap; the standby on the config main serves)."""
    name, probe, systemd = model.name, model.probe, model.systemd
    where = journal_fields(name, intent.operation)
    try:
        cfg = model.load().config
    except Exception:  # a broken file: the standby's variant cannot be told; the registry's is kept
        cfg = None
    strategy = strategies.named(intent.strategy, cfg)
    # An engine restarted just before the crash may still be starting: let it
    # finish (or fail) before deciding what it runs.
    await systemd.settle(model.engine_unit, timeout=300)
    second = strategy.second_unit(model)
    if second is not None:
        await systemd.settle(second, timeout=300)
    health = await probe.engine_health()
    # After a checkpoint swap: the main pair counts as on the target only
    # when its weight daemon holds the target's checkpoint.
    held = await _checkpoint_held(model) if intent.checkpoint is not None else None
    target = await _verified_target(model, intent, health, where, held)
    if target is not None:
        log.info("recovery: %s runs the target of reload %s and passes its verify; committing",
                 name, intent.operation, extra=where)
        weights = intent.weights if intent.checkpoint is None else await probe.weights_identity()
        model.records.write_committed(name, target, weights)
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
        if intent.checkpoint is not None and held is not None and held == intent.previous_checkpoint \
                and _on_disk(model) != held:
            # A swap from the administrator's own files (no 90-reload.yaml
            # to restore) that ended before the main pair changed: the
            # checkpoint that serves is pinned rather than loaded away.
            pin_checkpoint(directory, held, f"recovery: the checkpoint swap of reload {intent.operation} "
                           "did not finish")
            log.warning("recovery: %s keeps serving %s; pinned in %s", name, held, directory / ROLLBACK_DROPIN,
                        extra=where)
        # A swap's main weight daemon on another checkpoint than the
        # restored files name: it loads theirs again.
        reload_weights = intent.checkpoint is not None and held != _on_disk(model)
        if (health is not None and previous is not None and probe.runs(health, previous)
                and not reload_weights):
            log.info("recovery: %s still runs the config before reload %s; files restored, engine left alone",
                     name, intent.operation, extra=where)
            outcome = "left"
        elif await systemd.active_state(model.umbrella_unit) in ("active", "reloading"):
            log.warning("recovery: %s does not run the target of reload %s; restarting its %s (%s strategy)",
                        name, intent.operation, "weights and engine" if reload_weights else "engine",
                        strategy.name, extra=where)
            outcome = await strategy.recover_engine(model, where, reload_weights)
        else:  # never start a stopped model
            log.info("recovery: %s is stopped; files restored", name, extra=where)
            outcome = "restored"
    await strategy.recover_finish(model, outcome, where)
    model.records.drop_intent(name)
    return outcome


async def _checkpoint_held(model: ModelHandles) -> Optional[str]:
    """The checkpoint directory the main weight daemon holds (resolved), or None."""
    status = await model.probe.weights_status()
    return None if status is None else status.fingerprint.model_path


def _on_disk(model: ModelHandles) -> str:
    """The checkpoint directory the files on disk name (resolved)."""
    return str(Path(model.load().config.model).resolve())


async def _verified_target(model: ModelHandles, intent: Intent, health: Optional[EngineHealth], where: dict,
                           held: Optional[str] = None):
    """The reload's target config (the intent's engine section over the fixed
    fields on disk) when the engine runs it, the files on disk still say it
    (not so after a crash inside a rollback, which restores them first) and it
    passes the reload's full verify (health, a smoke request, the same weight
    daemon; after a checkpoint swap, the daemon that answers now, which must
    hold the target's checkpoint: HELD); else None: the reload did not
    succeed and recovery undoes it."""
    if health is None or not model.probe.runs(health, intent.target_engine):
        return None
    swap = intent.checkpoint is not None
    if swap and (held != intent.checkpoint or _on_disk(model) != intent.checkpoint):
        return None
    cfg = model.load().config
    if msgspec.to_builtins(cfg.engine) != intent.target_engine:
        log.warning("recovery: %s runs the target of reload %s, but its files say otherwise "
                    "(the crash came inside its rollback); finishing the rollback",
                    model.name, intent.operation, extra=where)
        return None
    target = msgspec.structs.replace(cfg, engine=msgspec.convert(intent.target_engine, type(cfg.engine)))
    try:
        await model.probe.verify_engine(target, await model.probe.weights_identity() if swap else intent.weights)
    except Exception as exc:
        log.warning("recovery: %s runs the target of reload %s, but it fails verification: %s",
                    model.name, intent.operation, exc, extra=where)
        return None
    return target



# ---------------------------------------------------------------- on the bus
# MANAGER is the service.Manager (its models, records, new_operation and
# publish), handed in: this module imports nothing of the bus.


def claim(manager) -> list:
    """A visible recovery Operation for every model a previous manager left
    mid-reload (its intent record): the model is busy from here on, so that
    a Reload (the call that may have D-Bus-activated this manager) answers
    Busy instead of racing the recovery. Call before owning the bus name.
    Returns (model, intent, operation) for each."""
    claimed = []
    for name, model in list(manager.models.items()):
        try:
            intent = manager.records.intent(name)
        except msgspec.DecodeError as exc:
            log.error("the intent record of %s is broken (%s); it stays in %s for an operator",
                      name, exc, manager.records.intent_path(name), extra={"hostd_model": name})
            continue
        if intent is None:
            continue
        iface = manager.new_operation(model, "recovery", dict(intent.patch))
        iface.op.strategy = strategies.named(intent.strategy)
        iface.op.notes.append(f"finishes reload {intent.operation}, which a previous manager left half done")
        manager.publish(iface)
        claimed.append((model, intent, iface))
    return claimed


async def recover_claimed(manager, claimed: list) -> None:
    """End the reloads a previous manager left half done (recover), each
    under the recovery Operation claim made for it; then stop a swap's
    second pair that runs for a model no reload accounts for."""
    await _retire_leftovers(manager, {model.model_name for model, _, _ in claimed})
    for model, intent, iface in claimed:
        name = model.model_name
        try:
            outcome = await recover(model.handles, intent)
        except Exception as exc:
            log.exception("recovery of %s failed; its intent record stays in %s", name,
                          manager.records.intent_path(name), extra={"hostd_model": name})
            iface.op.finish(State.FAILED, f"recovery of reload {intent.operation} failed: {exc}")
        else:
            log.info("recovery: %s %s", name, outcome, extra={"hostd_model": name})
            state = State.DONE if outcome == "committed" else State.ROLLED_BACK
            iface.op.finish(state, "" if outcome == "committed" else f"reload {intent.operation}: {outcome}")
        model.forget()
        model.refresh()


async def _retire_leftovers(manager, claimed: set[str]) -> None:
    """A swap's second pair left running with no intent record (a stop
    that failed after a swap ended, then a manager restart): stopped, and
    said in the journal (swap.retire_leftover_pair). A failure is logged."""
    for name, model in list(manager.models.items()):
        if name in claimed:
            continue
        loaded = model.loaded()  # None for a config that does not load: the units' own stop timeout
        timeout = job_timeout(loaded.config.timeouts.stop) if loaded is not None else None
        try:
            await retire_leftover_pair(model.handles, timeout, "at the manager's start")
        except Exception as exc:
            log.error("%s: a swap's second pair could not be stopped: %s", name, exc, extra={"hostd_model": name})
