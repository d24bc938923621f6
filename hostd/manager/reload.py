"""The reload of one model: the skeleton every strategy shares, one
function per stage (validate, preflight, record, the main engine's restart
and verify, commit, rollback, restore), and the one driver (Reload._apply)
that runs it with one restore policy (_abandon, before the main engine's
restart) and one rollback policy (_replace_main, after it).

The strategy, chosen by the preflight (strategies.choose; Operation.strategy
says which, and why in the journal), supplies steps through its hooks
(strategies/base.py's Strategy: prepare, failure_cause, restore,
put_main_on, verify_main, hand_back); it never ends the run. Its stages, its
diagram and what recovery does after it are in its file in strategies/
(restart.py, overlap.py, standby.py, swap.py). Every strategy shares this
skeleton:

    validate -> preflight -> record -> (the strategy's) -> restart -> verify -> (hand back) -> commit -> finished
        |           |                          |                \\_______/                                    (done)
     refused     refused             (its restore: rolled-back,     rollback (main back on the previous config)
    (nothing touched)                 cancelled or failed)           -> (hand back) -> finished (rolled-back)
                                                                      \\ fails: failed (degraded)

A reload whose target engine config is what the engine runs already ends at
validate as `unchanged`, touching nothing (`systemctl restart
model-engine@NAME` restarts the engine regardless).

A check (check_only: the manager's CheckReload, `hostctl reload --check`)
runs validate and preflight and stops there, saying what would change and
which strategy would run; it refuses what the reload would refuse, in the
same words.

Nothing is touched before validate and preflight pass: a refusal changes no
file, drains nothing and restarts nothing. From `record` on, the intent
(previous drop-in content and target config) is in the manager's records
(records.py), so a manager that dies mid-way decides on its next start
(recovery.py): commit if the engine runs the target config; leave an engine that
runs the previous config alone (the crash came before its restart); else
drain, restart it with the previous config and resume. Recovery never stops an
engine that still has admitted requests without draining it first.

The states and stage names are in operation.py, the strategies in
strategies/ (one file each), the drop-in files root writes in dropins.py,
the recovery after a manager crash in recovery.py.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Optional

import msgspec

from hostd import backends, units
from hostd import config as hostd_config
from hostd.checkpoints import config_file
from hostd.config import schema
from hostd.config.atomic import write_atomic
from hostd.engine.health import EngineHealth
from hostd.manager import errors
from hostd.manager.change import Change, change_of
from hostd.manager.dropins import (
    RELOAD_DROPIN, RELOAD_HEADER, ROLLBACK_DROPIN, merge_patch, previous_engine, read_text, render,
    restore_file, rollback_header,
)
from hostd.manager import strategies
from hostd.manager.operation import MESSAGE_IDS, Cancelled, Interrupted, Operation, Stage, State
from hostd.manager.patch import check_checkpoint_values, check_patch_keys, check_patch_size, check_patch_types
from hostd.manager.probe import Probe, identity
from hostd.manager.records import Committed, Degraded, Intent, Records

log = logging.getLogger("hostd.manager.reload")

# ---------------------------------------------------------------- the run


class ModelHandles:
    """The handles a reload (and a recovery) acts on one model through: its
    units' and files' names, SYSTEMD (systemd1.Systemd), PROBE (probe.Probe),
    RECORDS (records.Records) and LOAD, the manager's cached parse of the
    model's YAML. The manager builds one per model (model_bus.py); tests give
    fakes."""

    def __init__(self, name: str, root: Path, systemd, probe, records: Optional[Records] = None,
                 load: Optional[Callable[[], hostd_config.LoadedModel]] = None):
        self.name, self.root, self.systemd, self.probe = name, root, systemd, probe
        self.records = records or Records()
        self._load = load
        self.engine_unit = units.engine(name)
        self.next_unit = units.engine(name, "next")
        self.standby_unit = units.engine(name, "standby")
        self.umbrella_unit = units.umbrella(name)
        self.weights_unit = units.weights(name)
        # A checkpoint swap's pair: the new checkpoint's weight daemon and its engine.
        self.next_weights_unit = units.weights(name, "next")
        self.swap_unit = units.swap_engine(name)

    @property
    def dropins(self) -> Path:
        return hostd_config.dropin_dir(self.name, self.root)

    def load(self) -> hostd_config.LoadedModel:
        return self._load() if self._load else hostd_config.load_model(self.name, self.root)


class Reload:
    """One reload of MODEL as OP. DRY_RUN: only check() will run (check_only):
    OP is never published, so it moves through no stage and the journal gets
    no line of it."""

    def __init__(self, model: ModelHandles, op: Operation, dry_run: bool = False):
        self.model, self.op, self.dry_run = model, op, dry_run
        self.previous_reload: Optional[str] = None
        self.previous_rollback: Optional[str] = None
        self.reload_data: Optional[dict] = None  # 90-reload.yaml with the patch merged
        self.reload_text: Optional[str] = None  # ... as the file root writes, within the loader's limits
        self.current = None  # effective config before the reload
        self.target = None  # effective config after it
        self.running_engine: Optional[dict] = None
        self.health: Optional[EngineHealth] = None  # the engine's /health as validate read it (preflight reuses it)
        self.weights_before: Optional[tuple[int, int]] = None
        self.recorded = False  # the previous files are known: restore() may write
        self.intent: Optional[Intent] = None  # what record() wrote
        self.unchanged = False  # validate found nothing to apply
        self.switched = False  # the gateway sends new requests to the strategy's second engine (SecondEngine)
        self.rebuilt: Optional[EngineHealth] = None  # the main engine's /health as its rebuild in place answered
        self.strategy_reason = ""
        self.change = Change()  # the limits, or a checkpoint swap (change.py): validate's answer
        self.config_reads: dict = {}  # each checkpoint's config.json, read once (checkpoints/config_file.py)

    # ------------------------------------------------------------ stages

    async def validate(self) -> None:
        name, patch = self.model.name, self.op.patch
        check_patch_size(patch)
        try:
            current = self.model.load()
        except hostd_config.NoSuchModel:
            raise  # errors.to_dbus: NoSuchModel
        except hostd_config.ConfigError as exc:
            raise errors.InvalidValue(f"the configuration on disk is invalid:\n{exc}")
        # "reloading": `systemctl reload model@NAME` is what called us.
        if await self.model.systemd.active_state(self.model.umbrella_unit) not in ("active", "reloading"):
            raise errors.NotRunning(f"model {name} is not running: systemctl start {self.model.umbrella_unit} first")
        swappable = schema.swappable_fields(current.config.backend)
        check_patch_keys(patch, current.config, name, self.model.umbrella_unit)
        check_patch_types(current.config.engine, {k: v for k, v in patch.items() if k not in swappable})
        check_checkpoint_values(patch, swappable)
        self.current = current.config
        health = self.health = await self.model.probe.engine_health()
        weights = await self.model.probe.weights_status()  # asked once: records.running, change_of, record
        self.weights_before = identity(weights)
        # What runs now, as last recorded: a verify's commit or the units' last
        # start, whichever came later (records.running).
        running = self.model.records.running(name, self.weights_before)
        # What the engine runs now: what a rollback must bring back.
        self.running_engine = previous_engine(current.config.backend, running, health)
        if patch:
            self.reload_data = merge_patch(self.model.dropins / RELOAD_DROPIN, patch, swappable)
            self.reload_text = render(RELOAD_DROPIN, RELOAD_HEADER, self.reload_data)
            self.target = target_config(self.model, self.reload_text, patch)
        else:
            self.target = current.config
        if running is not None:
            check_fixed_unchanged(self.model, running, self.target, swappable)
        if swappable:
            self.change = change_of(name, self.model.weights_unit, self.target, "model" in patch, weights)
        if not patch and self.running_engine is None:
            raise errors.NotRunning(f"the engine of {name} does not answer (or reports no valid engine section) "
                                    "and nothing is committed; cannot tell what it runs")
        problems = model_backend_refusals(self.target)
        if problems:
            raise errors.InvalidValue("; ".join(problems))
        # Nothing to apply when the engine answers and runs the target already, on its checkpoint.
        self.unchanged = (not self.change.swaps and health is not None
                          and Probe.runs(health, msgspec.to_builtins(self.target.engine)))

    async def preflight(self) -> None:
        """Choose the strategy and check the memory, asking each thing once:
        the engine's /health is validate's, and one memory reading serves the
        overlap check and the restart's."""
        props = await self.model.systemd.properties(self.model.engine_unit)
        memory = await self.model.probe.read_memory(self.target, props.get("MainPID", 0))
        strategy, self.strategy_reason = await strategies.choose(self, memory)
        self.op.strategy = strategy
        problem = strategy.memory_problem(self, memory)
        if problem:
            raise errors.InsufficientMemory(problem)

    async def record(self) -> None:
        directory = self.model.dropins
        self.previous_reload = read_text(directory / RELOAD_DROPIN)
        self.previous_rollback = read_text(directory / ROLLBACK_DROPIN)
        self.recorded = True
        self.intent = Intent(
            operation=self.op.id,
            strategy=self.op.strategy.name,
            patch=self.op.patch,
            previous_reload=self.previous_reload,
            previous_rollback=self.previous_rollback,
            previous_engine=self.running_engine,
            target_engine=msgspec.to_builtins(self.target.engine),
            weights=self.weights_before,
            previous_checkpoint=self.change.previous,
            checkpoint=self.change.checkpoint,
        )
        self.model.records.write_intent(self.model.name, self.intent)
        if self.reload_text is not None:
            write_atomic(directory / RELOAD_DROPIN, self.reload_text)

    async def restart(self) -> None:
        await self.op.strategy.put_main_on(self, self.target)

    async def verify(self, cfg, slot: str = "main", health: Optional[EngineHealth] = None) -> EngineHealth:
        """The engine in SLOT runs CFG on the weights the reload began with
        (HEALTH: its rebuild's answer, not asked again); the /health it
        checked. The weight daemon is asked again only for the main engine
        (the last verify of a reload)."""
        return await self.model.probe.verify_engine(cfg, self.weights_before, slot, ask_daemon=slot == "main",
                                                    health=health)

    async def commit(self) -> None:
        self.model.records.write_committed(self.model.name, self.target, self.weights_before)
        self.model.records.drop_intent(self.model.name)

    async def rollback(self, cause: str) -> None:
        """Put the previous config back and bring the previous engine up."""
        self.previous_on_disk(cause)
        restored = hostd_config.load_model(self.model.name, self.model.root).config
        await self.op.strategy.put_main_on(self, restored)
        await self.verify(restored)
        self.op.restored = True
        self.model.records.drop_intent(self.model.name)

    def previous_on_disk(self, cause: Optional[str]) -> None:
        """The previous config back on disk: 90-reload.yaml as it was; and when
        an engine refused (CAUSE) values that came from the administrator's own
        drop-in (an empty patch), those values pinned above it, so that no
        later engine start (planned or a crash) runs them."""
        directory = self.model.dropins
        if self.op.patch or cause is None:
            restore_file(directory / RELOAD_DROPIN, self.previous_reload)
            return
        # Pin the values the engine ran before rather than editing their file.
        if self.running_engine is None:
            raise RuntimeError("no committed or schema-valid previous values to pin")
        pinned = {"engine": self.running_engine}
        if self.change.swaps:  # a swap from the admin's files: the checkpoint that served, too
            pinned["model"] = self.change.previous
        pin = render(ROLLBACK_DROPIN, rollback_header(cause), pinned)
        # The intent first: a manager killed from here on leaves a record
        # whose recovery keeps (or writes) this pin rather than removing it.
        if self.intent is not None:
            self.intent = msgspec.structs.replace(self.intent, rollback_pin=pin)
            self.model.records.write_intent(self.model.name, self.intent)
        write_atomic(directory / ROLLBACK_DROPIN, pin)
        self.op.notes.append(f"previous values pinned in {directory / ROLLBACK_DROPIN}")

    def restore(self, cause: Optional[str] = None) -> None:
        """The previous config back on disk (previous_on_disk); the main engine
        was never restarted. CAUSE: why a new engine failed, if one did."""
        if not self.recorded:  # cancelled before anything was written
            return
        self.previous_on_disk(cause)
        self.op.restored = True
        self.model.records.drop_intent(self.model.name)

    async def stopping(self) -> bool:
        """Is the model being stopped (by the manager's Stop or by systemctl)?"""
        if self.op.interrupt_requested:
            return True
        state = await self.model.systemd.active_state(self.model.umbrella_unit)
        return state in ("deactivating", "inactive", "failed")

    # ------------------------------------------------------------ driver

    async def check(self) -> None:
        """Validate and preflight: raises errors.Refused, having touched nothing."""
        with config_file.shared_reads(self.config_reads):
            await self.validate()
            if self.unchanged:
                return
            if not self.dry_run:  # a dry run's Operation is nobody's: no stage to show
                self.op.enter(Stage.PREFLIGHT)
            await self.preflight()

    async def run(self) -> None:
        try:
            with config_file.shared_reads(self.config_reads):
                await self._apply()
        except Exception as exc:  # a bug or an unexpected error: never leave it running
            log.exception("reload %d of %s: unexpected error", self.op.id, self.op.model)
            if self.op.state == State.RUNNING:
                self.op.finish(State.FAILED, f"unexpected error: {exc}")

    def end(self, state: State, error: str = "") -> None:
        if self.op.stage != Stage.FINISHED:
            self.op.enter(Stage.FINISHED)
        self.op.finish(state, error)

    async def _apply(self) -> None:
        """The one driver: record, the strategy's prepare, then the main
        engine replaced (_replace_main); a prepare that fails, is cancelled or
        interrupted ends in _abandon. A strategy supplies steps (its hooks,
        strategies/base.py) and never ends the run itself."""
        op = self.op
        if self.unchanged:
            log.info("reload %d of %s: the engine runs this config already; nothing to do", op.id, op.model,
                     extra=op.fields())
            return self.end(State.UNCHANGED)
        log.info(
            "reload %d of %s started (strategy %s: %s): %s", op.id, op.model, op.strategy_name, self.strategy_reason,
            json.dumps(op.patch) if op.patch else "config on disk",
            extra=op.fields(message_id=MESSAGE_IDS["started"], hostd_strategy=op.strategy_name),
        )
        strategy = op.strategy
        try:
            if op.cancel_requested:  # asked before anything was written
                raise Cancelled("cancelled by request")
            op.enter(Stage.RECORD)
            await self.record()
            await strategy.prepare(self)
        except Exception as exc:
            return await self._abandon(strategy, exc)
        await self._replace_main(strategy)

    async def _abandon(self, strategy: strategies.Strategy, exc: Exception) -> None:
        """The restore policy (before the main engine's restart): the
        strategy undoes what its prepare did, the files go back; the outcome
        is computed here alone. Cancelled: cancelled; an engine that failed
        (the strategy's failure_cause): rolled-back; a stop: failed
        (interrupted), touching no unit; anything else (a drain or settle
        that timed out, a gateway that failed): failed."""
        op = self.op
        interrupted = isinstance(exc, Interrupted) or await self.stopping()
        failed = None
        if not interrupted and not isinstance(exc, (Cancelled, TimeoutError)):
            failed = await strategy.failure_cause(self, exc)
        outcome = State.CANCELLED if isinstance(exc, Cancelled) else \
            State.ROLLED_BACK if failed is not None and self.recorded else State.FAILED
        op.enter(Stage.RESTORE)
        try:
            await strategy.restore(self, outcome, failed, interrupted)
        except Exception as again:  # logged for operators
            log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
        if interrupted:
            return self.end(State.FAILED, str(exc) if isinstance(exc, Interrupted)
                            else f"interrupted: the model is being stopped ({exc})")
        return self.end(outcome, failed or str(exc))

    async def _replace_main(self, strategy: strategies.Strategy) -> None:
        """The main engine on the target config (the strategy's put_main_on)
        and verified, then the strategy's hand_back and commit; the rollback
        policy (after the restart): on failure the main engine back on the
        previous config, then hand_back. hand_back(run, outcome) tells the
        gateway how the reload ended, for its reload histogram."""
        op = self.op
        try:
            op.enter(strategy.main_stage)
            await self.restart()
            op.enter(Stage.VERIFY)
            await strategy.verify_main(self)
        except Exception as exc:
            if await self.stopping():
                # A stop replaced our restart job: put the file back, start nothing.
                op.enter(Stage.ROLLBACK)
                self.restore()
                return self.end(State.FAILED, f"interrupted: the model is being stopped ({exc})")
            cause = await self.model.probe.engine_error(str(exc))
            op.enter(Stage.ROLLBACK)
            try:
                await self.rollback(cause)
                await strategy.hand_back(self, State.ROLLED_BACK.value)
            except Exception as again:
                log.error("reload %d of %s: rollback failed too: %s", op.id, op.model, again)
                # restart: the gateway stays paused, nothing safe to serve;
                # overlap, standby: the gateway stays on the second engine,
                # which passed the verify on the target config: the one
                # engine known to work keeps answering (docs/operations.md).
                error = f"{cause}; rollback failed: {again}"
                self.model.records.write_degraded(self.model.name, Degraded(operation=op.id, cause=error))
                return self.end(State.FAILED, error)
            self.model.records.clear_degraded(self.model.name)  # the previous config serves again
            return self.end(State.ROLLED_BACK, cause)
        # Verified: the engine attached the same weight daemon (PID, inode),
        # which holds the weights unless the backend says they are not retained.
        not_retained = weights_not_retained(self.target)
        # A checkpoint swap loaded new weights: none were reused.
        op.weights_reused = self.weights_before is not None and not not_retained and not self.change.swaps
        if not_retained:
            op.notes.append(f"weights not retained ({not_retained}): the engine loaded them from disk")
            log.info("reload %d of %s: weights not retained (%s); the engine loaded them from disk",
                     op.id, op.model, not_retained)
        try:
            await strategy.hand_back(self, State.DONE.value)
        except Exception as exc:  # the engine runs the target: commit, but say so
            op.enter(Stage.COMMIT)
            await self.commit()
            return self.end(State.FAILED, f"the new config runs, but {strategy.hand_back_fails}: {exc}")
        op.enter(Stage.COMMIT)
        await self.commit()
        self.model.records.clear_degraded(self.model.name)  # the target config serves
        self.end(State.DONE)


def weights_not_retained(cfg) -> str:
    """Why CFG's engine does not attach retained weights ("" when it does)."""
    return backends.for_config(cfg).weights_not_retained(cfg) or ""


def target_config(model: ModelHandles, reload_text: str, patch: dict):
    """The effective config of MODEL if 90-reload.yaml held RELOAD_TEXT (the loader's
    answer, load_model with that overlay); a key a later drop-in overrides
    is refused."""
    reload_file = model.dropins / RELOAD_DROPIN
    try:
        loaded = hostd_config.load_model(model.name, model.root, overlay=(RELOAD_DROPIN, reload_text))
    except hostd_config.NoSuchModel as exc:
        raise errors.NoSuchModel(exc.reason) from None
    except hostd_config.ConfigError as exc:
        # The patch's own problems by key (the file is not written yet), any other file's in full.
        raise errors.InvalidValue("; ".join(
            f"{p.key}: {p.message}" if p.file == str(reload_file) else str(p) for p in exc.problems)) from None
    cfg, merged = loaded.config, loaded.merged
    swappable = schema.swappable_fields(cfg.backend)
    for key in patch:
        where = (key,) if key in swappable else ("engine", key)
        origin = merged.origin(where)
        if origin != str(reload_file):
            raise errors.InvalidValue(
                f"{'.'.join(where)} is set by {origin}, which comes after {RELOAD_DROPIN} and "
                "would override the reload; change that file and `systemctl reload` instead",
            )
    return cfg


def check_fixed_unchanged(model: ModelHandles, running: Committed, target, swappable: tuple[str, ...] = ()) -> None:
    """Refuse a reload when a fixed field on disk (TARGET: the effective
    config) differs from what RUNNING (records.running) says runs;
    SWAPPABLE fields (schema.swappable_fields) a checkpoint swap applies."""
    if not running.fixed:  # a record of an older manager, without them
        return
    now = Committed.of(target).fixed
    # reload.* steers the manager at each reload, never the units: not fixed.
    for key in ("reload", *swappable):
        now.pop(key, None)
    running_fixed = {k: v for k, v in running.fixed.items() if k not in ("reload", *swappable)}
    changed = sorted(k for k in set(now) | set(running_fixed) if now.get(k) != running_fixed.get(k))
    if changed:
        raise errors.NotEditable(
            f"fixed field(s) {', '.join(changed)} changed on disk; a reload cannot apply them: "
            f"run `systemctl restart {model.umbrella_unit}` (a full restart loads the weights again)",
        )


def model_backend_refusals(cfg) -> list[str]:
    """The backend's refusals from the config alone; never its
    install_refusals(), which run upstream code (the engine unit checks
    those as the model's user when it starts)."""
    backend = backends.for_config(cfg)
    return backend.refusals(cfg) + backend.start_refusals(cfg)


async def check_only(model: ModelHandles, patch: dict) -> dict:
    """What Reload(PATCH) of MODEL would do (verdict), by the reload's
    own validate and preflight: the same refusals (errors.Refused and the
    loader's, raised as a reload raises them), nothing written, no unit
    started, stopped or restarted, no gateway asked to change, and no
    Operation: the stages run on one that is never published and takes no
    operation id (id 0)."""
    run = Reload(model, Operation(id=0, model=model.name, patch=patch), dry_run=True)
    await run.check()
    return verdict(run)


def verdict(run: Reload) -> dict:
    """What RUN, a checked reload, would do (CheckReload's answer): `outcome`
    reload or unchanged; `changes`, every engine key whose value differs,
    {key: {old, new}}: old is what the engine runs (what it reports on
    /health, validated as an engine section; else the last committed
    values; else the config on disk), new the target; the `strategy` the
    preflight chose and its `reason`; the preflight's `notes`; and
    `weights_not_retained`, why the new engine would load the weights
    from disk ("" when it attaches the retained ones). Engine sections
    hold no secrets (env: and the argument lists are fixed fields)."""
    new = msgspec.to_builtins(run.target.engine)
    old = (previous_engine(run.current.backend, None, run.health) or run.running_engine
           or msgspec.to_builtins(run.current.engine))
    changes = {key: {"old": old.get(key), "new": new.get(key)}
               for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
    if run.change.swaps:  # a checkpoint swap: the directories, resolved
        changes["model"] = {"old": run.change.previous, "new": run.change.checkpoint}
    if run.unchanged:
        strategy, reason = "", "the engine runs this config already: a reload would restart nothing"
    else:
        strategy, reason = run.op.strategy_name, run.strategy_reason
    return {"model": run.model.name, "outcome": "unchanged" if run.unchanged else "reload",
            "patch": run.op.patch, "changes": changes, "strategy": strategy, "reason": reason,
            "notes": list(run.op.notes), "weights_not_retained": weights_not_retained(run.target)}
