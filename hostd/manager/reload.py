"""The reload of one model: one function per stage of the state machine
(operation.py holds its states, stages and transitions) and the driver that
runs them to every way a reload can end.

Three strategies, chosen by the preflight (Operation.strategy says which, and
why in the journal): `standby` (a model with `standby: true` whose standby
answers and the gateway serves from main), `overlap` (the default otherwise)
and `restart` (forced by reload.strategy: restart, and the fallback when the
backend cannot run two engines or there is no room for a second one).

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
      honoured until here;
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
      Cancel() is honoured until here (operation.CANCELLABLE);
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

The states and stages are in operation.py, the drop-in files root writes in
dropins.py, the recovery after a manager crash in recovery.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec

from hostd import backends, units
from hostd import config as hostd_config
from hostd.config import schema
from hostd.config.atomic import write_atomic
from hostd.manager import errors
from hostd.manager.dropins import (
    RELOAD_DROPIN, RELOAD_HEADER, ROLLBACK_DROPIN, merge_patch, previous_engine, read_text, render,
    restore_file, rollback_header,
)
from hostd.manager.operation import MESSAGE_IDS, Cancelled, Interrupted, Operation, Stage, State, Strategy
from hostd.manager.probe import Probe, RebuildFailed
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
        self.health: Optional[dict] = None  # the engine's /health as validate read it (preflight reuses it)
        self.weights_before: Optional[tuple[int, int]] = None
        self.recorded = False  # the previous files are known: restore() may write
        self.intent: Optional[Intent] = None  # what record() wrote
        self.unchanged = False  # validate found nothing to apply
        self.strategy_reason = ""

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
        editable = schema.editable_fields(current.config.backend)
        fixed = {f.name for f in msgspec.structs.fields(type(current.config))} - {"engine"}
        for key in patch:
            if key in editable:
                continue
            if key in fixed:
                why = (
                    f"{key!r} is fixed (it describes the weights or the units); change it in "
                    f"/etc/hostd/models/{name}.yaml and run `systemctl restart {self.model.umbrella_unit}`, "
                    "which loads the weights again"
                )
            else:
                why = f"{key!r} is not a field of the {current.config.backend} backend"
            raise errors.NotEditable(f"{why}; editable: {', '.join(editable)}")
        check_patch_types(current.config.engine, patch)
        committed = self.model.records.committed(name)
        self.current = current.config
        health = self.health = await self.model.probe.engine_health()
        # What the engine runs now: what a rollback must bring back.
        self.running_engine = previous_engine(current.config.backend, committed, health)
        if patch:
            self.reload_data = merge_patch(self.model.dropins / RELOAD_DROPIN, patch)
            self.reload_text = render(RELOAD_DROPIN, RELOAD_HEADER, self.reload_data)
            self.target = self.config_with(self.reload_text, patch)
        else:
            self.target = current.config
        if committed is not None and not await self.restarted_since(committed):
            self.check_fixed_unchanged(committed)
        if not patch and self.running_engine is None:
            raise errors.NotRunning(f"the engine of {name} does not answer (or reports no valid engine section) "
                                    "and nothing is committed; cannot tell what it runs")
        problems = self.model_backend_refusals(self.target)
        if problems:
            raise errors.InvalidValue("; ".join(problems))
        # Nothing to apply when the engine answers and runs the target already.
        self.unchanged = health is not None and Probe.runs(health, msgspec.to_builtins(self.target.engine))

    def config_with(self, reload_text: str, patch: dict):
        """The effective config if 90-reload.yaml held RELOAD_TEXT (the loader's
        answer, load_model with that overlay); a key a later drop-in overrides
        is refused."""
        reload_file = self.model.dropins / RELOAD_DROPIN
        try:
            loaded = hostd_config.load_model(self.model.name, self.model.root, overlay=(RELOAD_DROPIN, reload_text))
        except hostd_config.NoSuchModel as exc:
            raise errors.NoSuchModel(exc.reason) from None
        except hostd_config.ConfigError as exc:
            # The patch's own problems by key (the file is not written yet), any other file's in full.
            raise errors.InvalidValue("; ".join(
                f"{p.key}: {p.message}" if p.file == str(reload_file) else str(p) for p in exc.problems)) from None
        cfg, merged = loaded.config, loaded.merged
        for key in patch:
            origin = merged.origin(("engine", key))
            if origin != str(reload_file):
                raise errors.InvalidValue(
                    f"engine.{key} is set by {origin}, which comes after {RELOAD_DROPIN} and "
                    "would override the reload; change that file and `systemctl reload` instead",
                )
        return cfg

    async def restarted_since(self, committed: Committed) -> bool:
        """Has another weight daemon started since COMMITTED was written (a
        `systemctl restart model@NAME`, which is how a fixed key is applied)?
        Then the units read the disk at that start, and the record's fixed
        fields describe what ran before it."""
        if committed.weights is None:  # a record of an older manager: compare as before
            return False
        now = await self.model.probe.weights_identity()
        return now is not None and tuple(now) != tuple(committed.weights)

    def check_fixed_unchanged(self, committed: Committed) -> None:
        if not committed.fixed:  # a record of an older manager, without them
            return
        now = Committed.of(self.target).fixed
        # reload.* steers the manager at each reload, never the units: not fixed.
        now.pop("reload", None)
        running_fixed = {k: v for k, v in committed.fixed.items() if k != "reload"}
        changed = sorted(k for k in set(now) | set(running_fixed) if now.get(k) != running_fixed.get(k))
        if changed:
            raise errors.NotEditable(
                f"fixed field(s) {', '.join(changed)} changed on disk; a reload cannot apply them: "
                f"run `systemctl restart {self.model.umbrella_unit}` (a full restart loads the weights again)",
            )

    def weights_not_retained(self) -> str:
        return backends.for_config(self.target).weights_not_retained(self.target) or ""

    def model_backend_refusals(self, cfg) -> list[str]:
        """The backend's refusals from the config alone; never its
        install_refusals(), which run upstream code (the engine unit checks
        those as the model's user when it starts)."""
        backend = backends.for_config(cfg)
        return backend.refusals(cfg) + backend.start_refusals(cfg)

    async def preflight(self) -> None:
        """Choose the strategy and check the memory, asking each thing once:
        the engine's /health is validate's, and one memory reading serves the
        overlap check and the restart's."""
        props = await self.model.systemd.properties(self.model.engine_unit)
        memory = await self.model.probe.read_memory(self.target, props.get("MainPID", 0))
        standby = await self.standby_problem()
        if standby is None:
            self.op.strategy, self.strategy_reason = Strategy.STANDBY.value, "the warm standby rebuilds on the new config"
            return
        if standby:
            self.op.notes.append(f"no standby reload: {standby}")
        if standby and not self.dry_run:
            log.info("reload %d of %s: no standby reload (%s); as without a standby", self.op.id, self.op.model,
                     standby, extra={"hostd_model": self.op.model, "hostd_operation": str(self.op.id)})
        strategy, why = self.choose_strategy(memory)
        self.op.strategy, self.strategy_reason = strategy.value, why
        if strategy == Strategy.RESTART and self.current.reload.strategy != strategy.value:
            self.op.notes.append(f"strategy restart: {why}")  # a fallback: the Operation says why, as the journal does
        if strategy == Strategy.RESTART:
            problem = self.model.probe.memory_problem(self.target, memory)
            if problem:
                raise errors.InsufficientMemory(problem)

    async def standby_problem(self) -> Optional[str]:
        """Why the standby cannot take this reload ("" when the model has
        none), or None when it can: standby: true, reload.strategy is not
        restart, the standby answers, and the gateway sends new requests to
        the main engine (not during a failover)."""
        if not getattr(self.current, "standby", False) or self.current.reload.strategy == Strategy.RESTART.value:
            return ""
        if await self.model.probe.engine_health("standby") is None:
            return f"the standby ({self.model.standby_unit}) does not answer"
        status = await self.model.probe.gateway_status()
        if status is None:
            return "the gateway does not answer"
        if status.slot != "main":
            return f"the gateway sends new requests to the {status.slot} engine (a failover), not the main one"
        return None

    def choose_strategy(self, memory) -> tuple[Strategy, str]:
        """overlap when configured, possible for the backend and there is room
        for a second engine beside the first (MEMORY: the preflight's reading);
        else restart. Returns the reason."""
        if self.current.reload.strategy == Strategy.RESTART.value:
            return Strategy.RESTART, "reload.strategy is restart"
        problem = self.model.probe.overlap_problem(self.target, self.health, memory)
        if problem:
            return Strategy.RESTART, f"overlap does not fit, falling back to restart: {problem}"
        return Strategy.OVERLAP, "room for a second engine beside the serving one"

    async def record(self) -> None:
        directory = self.model.dropins
        self.previous_reload = read_text(directory / RELOAD_DROPIN)
        self.previous_rollback = read_text(directory / ROLLBACK_DROPIN)
        self.recorded = True
        self.weights_before = await self.model.probe.weights_identity()
        self.intent = Intent(
            operation=self.op.id,
            strategy=self.op.strategy,
            patch=self.op.patch,
            previous_reload=self.previous_reload,
            previous_rollback=self.previous_rollback,
            previous_engine=self.running_engine,
            target_engine=msgspec.to_builtins(self.target.engine),
            weights=self.weights_before,
        )
        self.model.records.write_intent(self.model.name, self.intent)
        if self.reload_text is not None:
            write_atomic(directory / RELOAD_DROPIN, self.reload_text)

    async def drain(self) -> None:
        result = await self.model.probe.drain(self.current.reload.drain_timeout)
        if not result.drained:
            raise TimeoutError(
                f"drain timed out after {self.current.reload.drain_timeout:g} s with "
                f"{result.remaining} request(s) still running; the old engine keeps serving"
            )

    async def restart(self) -> None:
        await self.model.systemd.restart(self.model.engine_unit, timeout=self.target.timeouts.start + 30)

    async def verify(self, cfg, slot: str = "main") -> None:
        await self.model.probe.verify_engine(cfg, self.weights_before, slot)

    async def start_next(self) -> None:
        """Start the second engine with the target config and verify it."""
        await self.model.systemd.start(self.model.next_unit, timeout=self.target.timeouts.start + 30)
        await self.verify(self.target, "next")
        bridge = ((await self.model.probe.engine_health("next")) or {}).get("bridge")
        if bridge:  # vllm, sglang: the next engine runs on a KV budget of its own
            self.op.notes.append(f"bridge engine ran with {bridge}")
            log.info("reload %d of %s: the bridge engine runs with %s", self.op.id, self.op.model, bridge,
                     extra={"hostd_model": self.op.model, "hostd_operation": str(self.op.id)})

    async def settle(self, slot: str) -> int:
        """Wait until the requests running on SLOT's engine end, up to
        reload.drain_timeout; how many still run then (0 also when the
        gateway is older than settle: Probe.settle says so in the journal)."""
        timeout = self.current.reload.drain_timeout
        settled = await self.model.probe.settle(slot, timeout)
        if settled is None or settled.settled:
            return 0
        log.warning("reload %d of %s: %d request(s) still running on the %s engine after "
                    "reload.drain_timeout (%g s)", self.op.id, self.op.model, settled.remaining, slot, timeout,
                    extra={"hostd_model": self.op.model, "hostd_operation": str(self.op.id)})
        return settled.remaining

    async def settle_main(self, which: str) -> None:
        """SETTLE of the overlap and standby strategies: the requests running
        on the main engine end before it restarts; raises when some still
        run after reload.drain_timeout (WHICH names that engine: the main
        engine then keeps serving, and the reload rolls back)."""
        remaining = await self.settle("main")
        if remaining:
            raise TimeoutError(
                f"{remaining} request(s) still running on the {which} engine after reload.drain_timeout "
                f"({self.current.reload.drain_timeout:g} s); the {which} engine keeps serving"
            )

    async def retire_next(self, served: bool = True) -> None:
        """Stop the second engine; when it SERVED (the gateway switched to
        it), once what it admitted has finished (up to reload.drain_timeout;
        then its engine.shutdown_timeout applies)."""
        remaining = 0
        if served:
            try:
                remaining = await self.settle("next")
            except Exception as exc:  # the gateway does not answer: nothing to wait for through it
                log.warning("reload %d of %s: cannot ask the gateway what runs on the next engine: %s",
                            self.op.id, self.op.model, exc)
        if remaining:
            self.op.notes.append(f"{remaining} request(s) still ran on the second engine after "
                                 f"reload.drain_timeout; it was stopped with engine.shutdown_timeout")
        await self.model.systemd.stop(self.model.next_unit, timeout=self.target.timeouts.stop + 30)

    async def commit(self) -> None:
        self.model.records.write_committed(self.model.name, self.target, self.weights_before)
        self.model.records.drop_intent(self.model.name)

    async def rollback(self, cause: str) -> None:
        """Put the previous config back and bring the previous engine up."""
        self.previous_on_disk(cause)
        restored = hostd_config.load_model(self.model.name, self.model.root).config
        await self.model.systemd.restart(self.model.engine_unit, timeout=restored.timeouts.start + 30)
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
        pin = render(ROLLBACK_DROPIN, rollback_header(cause), {"engine": self.running_engine})
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
        await self.validate()
        if self.unchanged:
            return
        if not self.dry_run:  # a dry run's Operation is nobody's: no stage to show
            self.op.enter(Stage.PREFLIGHT)
        await self.preflight()

    def verdict(self) -> dict:
        """What the checked reload would do (CheckReload's answer): `outcome`
        reload or unchanged; `changes`, every engine key whose value differs,
        {key: {old, new}}: old is what the engine runs (what it reports on
        /health, validated as an engine section; else the last committed
        values; else the config on disk), new the target; the `strategy` the
        preflight chose and its `reason`; the preflight's `notes`; and
        `weights_not_retained`, why the new engine would load the weights
        from disk ("" when it attaches the retained ones). Engine sections
        hold no secrets (env: and the argument lists are fixed fields)."""
        new = msgspec.to_builtins(self.target.engine)
        old = (previous_engine(self.current.backend, None, self.health) or self.running_engine
               or msgspec.to_builtins(self.current.engine))
        changes = {key: {"old": old.get(key), "new": new.get(key)}
                   for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}
        if self.unchanged:
            strategy, reason = "", "the engine runs this config already: a reload would restart nothing"
        else:
            strategy, reason = self.op.strategy, self.strategy_reason
        return {"model": self.model.name, "outcome": "unchanged" if self.unchanged else "reload",
                "patch": self.op.patch, "changes": changes, "strategy": strategy, "reason": reason,
                "notes": list(self.op.notes), "weights_not_retained": self.weights_not_retained()}

    def start(self) -> asyncio.Task:
        """Apply the checked reload in the background; the Operation reports."""
        return asyncio.create_task(self.run())

    async def run(self) -> None:
        try:
            await self._apply()
        except Exception as exc:  # a bug or an unexpected error: never leave it running
            log.exception("reload %d of %s: unexpected error", self.op.id, self.op.model)
            if self.op.state == State.RUNNING:
                self.op.finish(State.FAILED, f"unexpected error: {exc}")

    def _end(self, state: State, error: str = "") -> None:
        if self.op.stage != Stage.FINISHED:
            self.op.enter(Stage.FINISHED)
        self.op.finish(state, error)

    async def _record_stage(self) -> None:
        """A cancel asked for before anything was written ends here; else record."""
        if self.op.cancel_requested:
            raise Cancelled("cancelled by request")
        self.op.enter(Stage.RECORD)
        await self.record()

    async def _drain_stage(self) -> None:
        """Record and drain; Cancelled, Interrupted or the drain's own failure
        leave with the file restored (and the gateway resumed unless stopping)."""
        op = self.op
        try:
            await self._record_stage()
            op.enter(Stage.DRAIN)
            drain = asyncio.create_task(self.drain())
            asked = asyncio.create_task(op.asked.wait())
            await asyncio.wait({drain, asked}, return_when=asyncio.FIRST_COMPLETED)
            asked.cancel()
            if not drain.done():
                drain.cancel()
            try:
                await drain
            except asyncio.CancelledError:
                if op.interrupt_requested:
                    raise Interrupted("interrupted: the model is being stopped")
                raise Cancelled("cancelled during drain")
            if op.cancel_requested:  # asked for as the drain finished: still honoured
                raise Cancelled("cancelled during drain")
            if await self.stopping():
                raise Interrupted("interrupted: the model is being stopped")
        except Exception as exc:  # drain timed out, was cancelled, or the gateway failed
            op.enter(Stage.RESTORE)
            try:
                self.restore()
                if not isinstance(exc, Interrupted):
                    await self.model.probe.resume("cancelled" if isinstance(exc, Cancelled) else "failed")
            except Exception as again:  # logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            raise

    async def _apply(self) -> None:
        op = self.op
        if self.unchanged:
            log.info("reload %d of %s: the engine runs this config already; nothing to do", op.id, op.model,
                     extra={"hostd_model": op.model, "hostd_operation": str(op.id)})
            return self._end(State.UNCHANGED)
        log.info(
            "reload %d of %s started (strategy %s: %s): %s", op.id, op.model, op.strategy, self.strategy_reason,
            json.dumps(op.patch) if op.patch else "config on disk",
            extra={"hostd_model": op.model, "hostd_operation": str(op.id), "message_id": MESSAGE_IDS["started"],
                   "hostd_strategy": op.strategy},
        )
        if op.strategy == Strategy.OVERLAP.value:
            return await self._apply_overlap()
        if op.strategy == Strategy.STANDBY.value:
            return await self._apply_standby()
        try:
            await self._drain_stage()
        except Exception as exc:
            return self._end(State.CANCELLED if isinstance(exc, Cancelled) else State.FAILED, str(exc))
        await self._replace_main(self._resume, "the gateway did not resume")

    async def _resume(self, outcome: str) -> None:
        """restart: the drained gateway serves again."""
        self.op.enter(Stage.RESUME)
        await self.model.probe.resume(outcome)

    async def _hand_back(self, outcome: str) -> None:
        """overlap: new requests go to the main engine again; the next one stops."""
        self.op.enter(Stage.RESUME)
        await self.model.probe.switch("main", outcome)
        self.op.enter(Stage.RETIRE)
        await self.retire_next()

    async def _replace_main(self, hand_back, hand_back_failed: str) -> None:
        """Restart the main engine with the target config and verify it, then
        HAND_BACK the gateway to it and commit; on failure roll back (the main
        engine back on the previous config), then HAND_BACK. HAND_BACK(outcome)
        tells the gateway how the reload ended, for its reload histogram."""
        op = self.op
        try:
            op.enter(Stage.RESTART)
            await self.restart()
            op.enter(Stage.VERIFY)
            await self.verify(self.target)
        except Exception as exc:
            if await self.stopping():
                # A stop replaced our restart job: put the file back, start nothing.
                op.enter(Stage.ROLLBACK)
                self.restore()
                return self._end(State.FAILED, f"interrupted: the model is being stopped ({exc})")
            cause = await self.model.probe.engine_error(str(exc))
            op.enter(Stage.ROLLBACK)
            try:
                await self.rollback(cause)
                await hand_back(State.ROLLED_BACK.value)
            except Exception as again:
                log.error("reload %d of %s: rollback failed too: %s", op.id, op.model, again)
                # restart: the gateway stays paused, nothing safe to serve;
                # overlap, standby: the gateway stays on the second engine,
                # which passed the verify on the target config: the one
                # engine known to work keeps answering (docs/operations.md).
                error = f"{cause}; rollback failed: {again}"
                self.model.records.write_degraded(self.model.name, Degraded(operation=op.id, cause=error))
                return self._end(State.FAILED, error)
            self.model.records.clear_degraded(self.model.name)  # the previous config serves again
            return self._end(State.ROLLED_BACK, cause)
        # Verified: the engine attached the same weight daemon (PID, inode),
        # which holds the weights unless the backend says they are not retained.
        not_retained = self.weights_not_retained()
        op.weights_reused = self.weights_before is not None and not not_retained
        if not_retained:
            op.notes.append(f"weights not retained ({not_retained}): the engine loaded them from disk")
            log.info("reload %d of %s: weights not retained (%s); the engine loaded them from disk",
                     op.id, op.model, not_retained)
        try:
            await hand_back(State.DONE.value)
        except Exception as exc:  # the engine runs the target: commit, but say so
            op.enter(Stage.COMMIT)
            await self.commit()
            return self._end(State.FAILED, f"the new config runs, but {hand_back_failed}: {exc}")
        op.enter(Stage.COMMIT)
        await self.commit()
        self.model.records.clear_degraded(self.model.name)  # the target config serves
        self._end(State.DONE)

    async def _until_asked(self, work) -> None:
        """Run WORK unless, or until, a Cancel() or a stop asks otherwise:
        then WORK is abandoned (its unit is stopped by the caller's restore)."""
        op = self.op
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

    async def _apply_overlap(self) -> None:
        """The overlap strategy (module docstring): the gateway always has an
        engine that answers, so no request is ever refused. Cancel() is
        honoured until the switch; a stop interrupts it there too."""
        op = self.op
        switched = False
        try:
            await self._record_stage()
            op.enter(Stage.START_NEXT)
            await self._until_asked(self.start_next())
            op.enter(Stage.SWITCH)
            await self.model.probe.switch("next")
            switched = True
            # What runs on the main engine finishes there before it restarts.
            op.enter(Stage.SETTLE)
            await self.settle_main("old")
        except Exception as exc:  # the new engine failed, or the old one did not settle: it never stopped
            interrupted = isinstance(exc, Interrupted) or await self.stopping()
            if isinstance(exc, (Cancelled, TimeoutError)) or interrupted:
                cause, failed = str(exc), None
            else:
                cause = failed = await self.model.probe.engine_error(str(exc), "next")
            op.enter(Stage.RESTORE)
            outcome = State.CANCELLED if isinstance(exc, Cancelled) else \
                State.ROLLED_BACK if failed is not None and self.recorded else State.FAILED
            try:
                if switched and not interrupted:
                    await self.model.probe.switch("main", outcome.value)
                await self.retire_next(served=switched)
                self.restore(failed)
            except Exception as again:  # logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            if interrupted:
                return self._end(State.FAILED, f"interrupted: the model is being stopped ({exc})")
            return self._end(outcome, cause)
        # The next engine serves new requests and nothing runs on the main one:
        # it restarts with the target config, then takes over.
        await self._replace_main(self._hand_back, "handing the gateway back to the main engine failed")


    # ------------------------------------------------------------ standby

    async def rebuild_standby(self) -> None:
        """The standby rebuilds on the target config in its own process and
        is verified on its own socket (as start-next verifies the next engine)."""
        answer = await self.model.probe.rebuild(msgspec.to_builtins(self.target.engine))
        phases = answer.get("rebuild_s") if isinstance(answer.get("rebuild_s"), dict) else {}
        seconds = sum(v for v in phases.values() if isinstance(v, (int, float)))
        self.op.notes.append(f"standby rebuilt in {seconds:.2f} s")
        log.info("reload %d of %s: the standby rebuilt on the target config in %.2f s (%s)", self.op.id,
                 self.op.model, seconds, json.dumps(phases),
                 extra={"hostd_model": self.op.model, "hostd_operation": str(self.op.id)})
        await self.verify(self.target, "standby")

    async def standby_back(self, engine: Optional[dict]) -> None:
        """The standby ends on ENGINE (what the main engine serves): rebuilt
        when it runs anything else, restarted by systemd (on the config on
        disk) when that fails. Its trouble never changes how the reload
        ended: it is in the journal and the Operation's notes."""
        if engine is None:
            return
        probe = self.model.probe
        health = await probe.engine_health("standby")
        if health is not None and probe.runs(health, engine):
            return
        try:
            if health is None:
                raise RuntimeError("the standby does not answer")
            await probe.rebuild(engine)
        except Exception as exc:
            log.warning("reload %d of %s: the standby did not go back to the serving config (%s); restarting %s",
                        self.op.id, self.op.model, exc, self.model.standby_unit,
                        extra={"hostd_model": self.op.model, "hostd_operation": str(self.op.id)})
            self.op.notes.append(f"the standby was restarted: {exc}")
            await self.model.systemd.restart(self.model.standby_unit, timeout=self.current.timeouts.start + 30)

    async def _hand_back_standby(self, outcome: str) -> None:
        """standby: new requests go to the main engine again; the standby is
        standby again, on the config main serves (the target when done, the
        previous one after a rollback)."""
        self.op.enter(Stage.RESUME)
        await self.model.probe.switch("main", outcome)
        if outcome != State.DONE.value:
            await self.standby_back(self.running_engine)

    async def _apply_standby(self) -> None:
        """The standby strategy (module docstring): the gateway always has an
        engine that answers; the new config serves once the standby has
        rebuilt. Cancel() is honoured until the switch; a stop interrupts it
        there too."""
        op = self.op
        switched = False
        try:
            await self._record_stage()
            op.enter(Stage.REBUILD)
            await self._until_asked(self.rebuild_standby())
            op.enter(Stage.SWITCH)
            await self.model.probe.switch("standby")
            switched = True
            op.enter(Stage.SETTLE)
            await self.settle_main("main")
        except Exception as exc:  # the rebuild failed, or main did not settle: main never stopped
            interrupted = isinstance(exc, Interrupted) or await self.stopping()
            if isinstance(exc, (Cancelled, TimeoutError)) or interrupted:
                cause, failed = str(exc), None
            elif isinstance(exc, RebuildFailed):
                cause = failed = str(exc)
            else:
                cause = failed = await self.model.probe.engine_error(str(exc), "standby")
            op.enter(Stage.RESTORE)
            outcome = State.CANCELLED if isinstance(exc, Cancelled) else \
                State.ROLLED_BACK if failed is not None and self.recorded else State.FAILED
            try:
                if switched and not interrupted:
                    await self.model.probe.switch("main", outcome.value)
                self.restore(failed)
                if not interrupted and self.recorded:
                    await self.standby_back(self.running_engine)
            except Exception as again:  # logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            if interrupted:
                return self._end(State.FAILED, f"interrupted: the model is being stopped ({exc})")
            return self._end(outcome, cause)
        # The standby serves the target config and nothing runs on the main
        # engine: it restarts with the target config, then takes over again.
        await self._replace_main(self._hand_back_standby, "handing the gateway back to the main engine failed")


async def check_only(model: ModelHandles, patch: dict) -> dict:
    """What Reload(PATCH) of MODEL would do (Reload.verdict), by the reload's
    own validate and preflight: the same refusals (errors.Refused and the
    loader's, raised as a reload raises them), nothing written, no unit
    started, stopped or restarted, no gateway asked to change, and no
    Operation: the stages run on one that is never published and takes no
    operation id (id 0)."""
    run = Reload(model, Operation(id=0, model=model.name, patch=patch), dry_run=True)
    await run.check()
    return run.verdict()


def patch_from_variants(patch: dict[str, Any]) -> dict:
    """D-Bus a{sv} -> plain values (Variant.value)."""
    return {k: getattr(v, "value", v) for k, v in patch.items()}


# Any local user may ask CheckReload, and the bus carries 32 MiB: a patch is
# weighed before anything parses, converts or renders it, since rendering a
# multi-megabyte value to YAML held root's only event loop for seconds
# (issue 33, N1). An engine's editable values take a few hundred bytes.
MAX_PATCH_BYTES = 8192


def check_patch_size(patch: dict) -> None:
    """Refuse (InvalidValue naming the key) a PATCH over MAX_PATCH_BYTES."""
    total = 0
    for key, value in patch.items():
        size = len(str(key)) + _weight(value)
        if size > MAX_PATCH_BYTES:
            raise errors.InvalidValue(
                f"engine.{key}: the value takes more than {MAX_PATCH_BYTES} bytes; a reload patch holds at most "
                f"{MAX_PATCH_BYTES} in all (an engine's limits take a few hundred)")
        total += size
    if total > MAX_PATCH_BYTES:
        raise errors.InvalidValue(f"the patch takes more than {MAX_PATCH_BYTES} bytes; send fewer or smaller values")


def _weight(value: Any) -> int:
    """About the bytes VALUE takes as JSON, counted without recursion and no
    further than just past MAX_PATCH_BYTES (the caller refuses it then)."""
    total, stack = 0, [value]
    while stack and total <= MAX_PATCH_BYTES:
        item = stack.pop()
        item = getattr(item, "value", item)  # a D-Bus Variant inside a container
        if isinstance(item, (str, bytes)):
            total += len(item) + 2
        elif isinstance(item, dict):
            total += 2 + len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            total += 2 + len(item)
            stack.extend(item)
        else:
            total += 8
    return total


def check_patch_types(engine: msgspec.Struct, patch: dict) -> None:
    """Refuse (InvalidValue naming the key) a PATCH that ENGINE's struct does not
    take, before it is rendered: the loader would refuse the file it makes anyway."""
    try:
        msgspec.convert({**msgspec.to_builtins(engine), **patch}, type(engine))
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).rpartition(" - at `$.")
        if not message:
            raise errors.InvalidValue(f"the patch makes an invalid engine section: {exc}") from None
        raise errors.InvalidValue(f"engine.{where.rstrip('`')}: {message}") from None
