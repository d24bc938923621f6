"""The reload of one model: an explicit state machine, one function per stage.

    validate -> preflight -> record -> drain -> restart -> verify -> resume -> commit
                                         |          \\________/
                                         |               | failure
                                   timeout/cancel     rollback -> (verify old) -> resume
                                         |               |
                                   restore, resume   rolled-back | failed (degraded)

Nothing is touched before validate and preflight pass: a refusal changes no
file, drains nothing and restarts nothing. From `record` on, the intent
(previous drop-in content and target config) is on disk in
/var/lib/hostd/NAME/reload-intent.json, so a manager that dies mid-way decides
on its next start: commit if the engine runs the target config, else roll back.

Drop-ins: a patch is written into /etc/hostd/models/NAME.d/90-reload.yaml
(atomically). An empty patch applies what is on disk now; if that fails, the
previous values are pinned in 99-rollback.yaml (the administrator's own files
are never edited) and the Operation says so.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import msgspec
import yaml

from hostd import config as hostd_config
from hostd import paths
from hostd.config import schema
from hostd.config.atomic import remove_durably, write_atomic

log = logging.getLogger("hostd.manager.reload")

RELOAD_DROPIN = "90-reload.yaml"
ROLLBACK_DROPIN = "99-rollback.yaml"
INTENT = "reload-intent.json"
COMMITTED = "committed.json"

# MESSAGE_IDs of the journal lines a reload writes (journalctl MESSAGE_ID=...).
MESSAGE_IDS = {
    "started": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a40",
    "done": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a41",
    "rolled-back": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a42",
    "failed": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a43",
    "cancelled": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a44",
}


class State(str, enum.Enum):
    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled-back"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Stage(str, enum.Enum):
    VALIDATE = "validate"
    PREFLIGHT = "preflight"
    RECORD = "record"
    DRAIN = "drain"
    RESTART = "restart"
    VERIFY = "verify"
    RESUME = "resume"
    COMMIT = "commit"
    ROLLBACK = "rollback"
    RESTORE = "restore"  # put the drop-in back after a drain that did not finish
    FINISHED = "finished"


# Which stage may follow which; anything else is a bug and raises.
TRANSITIONS: dict[Stage, set[Stage]] = {
    Stage.VALIDATE: {Stage.PREFLIGHT, Stage.FINISHED},
    Stage.PREFLIGHT: {Stage.RECORD, Stage.RESTORE, Stage.FINISHED},
    Stage.RECORD: {Stage.DRAIN, Stage.RESTORE},
    Stage.DRAIN: {Stage.RESTART, Stage.RESTORE},
    Stage.RESTART: {Stage.VERIFY, Stage.ROLLBACK},
    Stage.VERIFY: {Stage.RESUME, Stage.ROLLBACK},
    Stage.RESUME: {Stage.COMMIT, Stage.FINISHED},
    Stage.COMMIT: {Stage.FINISHED},
    Stage.ROLLBACK: {Stage.RESUME, Stage.FINISHED},
    Stage.RESTORE: {Stage.FINISHED},
    Stage.FINISHED: set(),
}


class Refused(Exception):
    """Validation or preflight refused the reload; nothing was changed."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind  # NoSuchModel, NotEditable, InvalidValue, Busy, NotRunning, InsufficientMemory


class Cancelled(Exception):
    pass


class Interrupted(Exception):
    """The model is being stopped: the reload gives way and touches no unit."""


@dataclass
class Operation:
    """One reload, as the D-Bus Operation object shows it."""

    id: int
    model: str
    patch: dict
    state: State = State.RUNNING
    stage: Stage = Stage.VALIDATE
    error: str = ""
    weights_reused: bool = False
    restored: bool = False
    created: float = field(default_factory=time.time)
    finished: float = 0.0
    notes: list[str] = field(default_factory=list)
    on_change: Optional[Callable[["Operation"], None]] = None
    done_event: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_requested: bool = False
    interrupt_requested: bool = False  # the model is being stopped
    degraded: bool = False

    def enter(self, stage: Stage) -> None:
        if stage not in TRANSITIONS[self.stage]:
            raise RuntimeError(f"reload {self.id}: no transition {self.stage.value} -> {stage.value}")
        self.stage = stage
        log.info(
            "reload %d of %s: stage %s", self.id, self.model, stage.value,
            extra={"hostd_model": self.model, "hostd_operation": str(self.id), "hostd_stage": stage.value},
        )
        self._changed()

    def finish(self, state: State, error: str = "") -> None:
        self.state, self.error, self.finished = state, error, time.time()
        if self.stage != Stage.FINISHED:
            self.stage = Stage.FINISHED
        log.log(
            logging.INFO if state == State.DONE else logging.WARNING,
            "reload %d of %s %s%s", self.id, self.model, state.value, f": {error}" if error else "",
            extra={"hostd_model": self.model, "hostd_operation": str(self.id),
                   "hostd_stage": "finished", "message_id": MESSAGE_IDS[state.value]},
        )
        self._changed()
        self.done_event.set()

    def _changed(self) -> None:
        if self.on_change:
            self.on_change(self)


# ---------------------------------------------------------------- files


def state_dir(name: str) -> Path:
    """Root's records of NAME's reloads (the manager runs as root)."""
    directory = paths.manager_state_dir(name)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    return directory


def read_text(path: Path) -> Optional[str]:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def restore_file(path: Path, content: Optional[str]) -> None:
    if content is None:
        remove_durably(path)
    else:
        write_atomic(path, content)


def engine_section(cfg) -> dict:
    return msgspec.to_builtins(cfg.engine)


# ---------------------------------------------------------------- the run


class Model:
    """What a reload needs to act on one model; the manager provides it."""

    def __init__(self, name: str, root: Path, systemd, probe):
        self.name = name
        self.root = root
        self.systemd = systemd
        self.probe = probe  # hostd.manager.probe.Probe

    @property
    def dropins(self) -> Path:
        return hostd_config.dropin_dir(self.name, self.root)

    @property
    def engine_unit(self) -> str:
        return f"model-engine@{self.name}.service"

    @property
    def umbrella_unit(self) -> str:
        return f"model@{self.name}.service"


class Reload:
    def __init__(self, model: Model, op: Operation):
        self.model, self.op = model, op
        self.previous_reload: Optional[str] = None
        self.previous_rollback: Optional[str] = None
        self.current = None  # effective config before the reload
        self.target = None  # effective config after it
        self.running_engine: Optional[dict] = None
        self.weights_before: Optional[tuple[int, int]] = None
        self.drained = False

    # ------------------------------------------------------------ stages

    async def validate(self) -> None:
        name, patch = self.model.name, self.op.patch
        try:
            current = hostd_config.load_model(name, self.model.root)
        except hostd_config.ConfigError as exc:
            if not hostd_config.model_file(name, self.model.root).exists():
                raise Refused("NoSuchModel", f"no model {name!r}: /etc/hostd/models/{name}.yaml does not exist")
            raise Refused("InvalidValue", f"the configuration on disk is invalid:\n{exc}")
        # "reloading": `systemctl reload model@NAME` is what called us.
        if await self.model.systemd.active_state(self.model.umbrella_unit) not in ("active", "reloading"):
            raise Refused("NotRunning", f"model {name} is not running: systemctl start model@{name} first")
        editable = schema.editable_fields(current.config.backend)
        fixed = {f.name for f in msgspec.structs.fields(type(current.config))} - {"engine"}
        for key in patch:
            if key in editable:
                continue
            if key in fixed:
                why = (
                    f"{key!r} is fixed (it describes the weights or the units); change it in "
                    f"/etc/hostd/models/{name}.yaml and run `systemctl restart model@{name}`, "
                    "which loads the weights again"
                )
            else:
                why = f"{key!r} is not a field of the {current.config.backend} backend"
            raise Refused("NotEditable", f"{why}; editable: {', '.join(editable)}")
        committed = self.read_committed()
        self.current = current.config
        health = await self.model.probe.engine_health()
        # What the engine runs now: what a rollback must bring back.
        self.running_engine = (health or {}).get("engine_config") or (committed or {}).get("engine")
        self.target = self.config_with(patch) if patch else current.config
        if committed is not None:
            self.check_fixed_unchanged(committed)
        if not patch:
            if self.running_engine is None:
                raise Refused("NotRunning", f"the engine of {name} does not answer; cannot tell what it runs")
        problems = self.model_backend_refusals(self.target)
        if problems:
            raise Refused("InvalidValue", "; ".join(problems))

    def config_with(self, patch: dict):
        """The effective config if 90-reload.yaml also held PATCH, every drop-in
        in its lexical place; a key a later drop-in overrides is refused."""
        reload_file = self.model.dropins / RELOAD_DROPIN
        data = yaml.safe_load(read_text(reload_file) or "") or {}
        if not isinstance(data, dict):
            data = {}
        data = {**data, "engine": {**(data.get("engine") or {}), **patch}}
        merged, problems = hostd_config.load.merge_model(
            self.model.name, self.model.root, overlay={RELOAD_DROPIN: data}
        )
        if problems:
            raise Refused("InvalidValue", "\n".join(map(str, problems)))
        try:
            cfg = hostd_config.load.validate(merged, hostd_config.load.model_type(merged))
        except hostd_config.ConfigError as exc:
            raise Refused("InvalidValue", "; ".join(f"{p.key}: {p.message}" for p in exc.problems)) from None
        for key in patch:
            origin = merged.origin(("engine", key))
            if origin != str(reload_file):
                raise Refused(
                    "InvalidValue",
                    f"engine.{key} is set by {origin}, which comes after {RELOAD_DROPIN} and "
                    "would override the reload; change that file and `systemctl reload` instead",
                )
        return cfg

    def check_fixed_unchanged(self, committed: dict) -> None:
        running_fixed = committed.get("fixed")
        if running_fixed is None:
            return
        now = msgspec.to_builtins(self.target)
        now.pop("engine", None)
        changed = sorted(k for k in set(now) | set(running_fixed) if now.get(k) != running_fixed.get(k))
        if changed:
            raise Refused(
                "NotEditable",
                f"fixed field(s) {', '.join(changed)} changed on disk; a reload cannot apply them: "
                f"run `systemctl restart model@{self.model.name}` (a full restart loads the weights again)",
            )

    def weights_not_retained(self) -> str:
        from hostd import backends

        return backends.for_config(self.target).weights_not_retained(self.target) or ""

    def model_backend_refusals(self, cfg) -> list[str]:
        from hostd import backends

        return backends.for_config(cfg).refusals(cfg)

    async def preflight(self) -> None:
        props = await self.model.systemd.unit_properties(self.model.engine_unit)
        problem = await self.model.probe.memory_problem(self.target, props.get("MainPID", 0))
        if problem:
            raise Refused("InsufficientMemory", problem)

    async def record(self) -> None:
        directory = self.model.dropins
        self.previous_reload = read_text(directory / RELOAD_DROPIN)
        self.previous_rollback = read_text(directory / ROLLBACK_DROPIN)
        self.weights_before = await self.model.probe.weights_identity()
        intent = {
            "operation": self.op.id,
            "patch": self.op.patch,
            "previous_reload": self.previous_reload,
            "previous_rollback": self.previous_rollback,
            "previous_engine": self.running_engine,
            "target_engine": engine_section(self.target),
            "weights": list(self.weights_before) if self.weights_before else None,
            "at": time.time(),
        }
        write_atomic(state_dir(self.model.name) / INTENT, json.dumps(intent, indent=1), mode=0o600)
        if self.op.patch:
            merged = yaml.safe_load(self.previous_reload or "") or {}
            if not isinstance(merged, dict):
                merged = {}
            engine = merged.setdefault("engine", {})
            engine.update(self.op.patch)
            header = "# Written by hostd's manager on reload; hostctl config NAME shows the effect.\n"
            write_atomic(directory / RELOAD_DROPIN, header + yaml.safe_dump(merged, sort_keys=True))

    async def drain(self) -> None:
        result = await self.model.probe.drain(self.current.reload.drain_timeout)
        self.drained = True
        if not result["drained"]:
            raise TimeoutError(
                f"drain timed out after {self.current.reload.drain_timeout:g} s with "
                f"{result['remaining']} request(s) still running; the old engine keeps serving"
            )

    async def restart(self) -> None:
        await self.model.systemd.restart(self.model.engine_unit, timeout=self.target.timeouts.start + 30)

    async def verify(self, cfg) -> None:
        await self.model.probe.verify_engine(cfg, self.weights_before)

    async def resume(self) -> None:
        await self.model.probe.resume()

    async def commit(self) -> None:
        self.write_committed(self.target)
        remove_durably(state_dir(self.model.name) / INTENT)

    async def rollback(self, cause: str) -> None:
        """Put the previous config back and bring the previous engine up."""
        directory = self.model.dropins
        if self.op.patch:
            restore_file(directory / RELOAD_DROPIN, self.previous_reload)
        else:
            # The new values came from the administrator's own drop-in: pin the
            # values the engine ran before above it rather than editing their file.
            pinned = {"engine": self.running_engine}
            write_atomic(
                directory / ROLLBACK_DROPIN,
                "# Written by hostd's manager: the reload of these values failed "
                f"({cause.splitlines()[0][:200]}).\n# Remove this file once the config is fixed.\n"
                + yaml.safe_dump(pinned, sort_keys=True),
            )
            self.op.notes.append(f"previous values pinned in {directory / ROLLBACK_DROPIN}")
        restored = hostd_config.load_model(self.model.name, self.model.root).config
        await self.model.systemd.restart(self.model.engine_unit, timeout=restored.timeouts.start + 30)
        await self.verify(restored)
        self.op.restored = True
        remove_durably(state_dir(self.model.name) / INTENT)

    async def restore(self, resume: bool = True) -> None:
        directory = self.model.dropins
        restore_file(directory / RELOAD_DROPIN, self.previous_reload)
        self.op.restored = True
        remove_durably(state_dir(self.model.name) / INTENT)
        if resume:
            await self.model.probe.resume()

    async def stopping(self) -> bool:
        """Is the model being stopped (by the manager's Stop or by systemctl)?"""
        if self.op.interrupt_requested:
            return True
        state = await self.model.systemd.active_state(self.model.umbrella_unit)
        return state in ("deactivating", "inactive", "failed")

    # ------------------------------------------------------------ committed config

    def read_committed(self) -> Optional[dict]:
        text = read_text(state_dir(self.model.name) / COMMITTED)
        return json.loads(text) if text else None

    def write_committed(self, cfg) -> None:
        data = msgspec.to_builtins(cfg)
        engine = data.pop("engine")
        write_atomic(
            state_dir(self.model.name) / COMMITTED,
            json.dumps({"engine": engine, "fixed": data, "at": time.time()}, indent=1),
            mode=0o600,
        )

    # ------------------------------------------------------------ driver

    def check_cancel(self) -> None:
        if self.op.cancel_requested:
            raise Cancelled("cancelled by request")

    async def check(self) -> None:
        """Validate and preflight: raises Refused, having touched nothing."""
        await self.validate()
        self.op.enter(Stage.PREFLIGHT)
        await self.preflight()

    def start(self) -> asyncio.Task:
        """Apply the checked reload in the background; the Operation reports."""
        return asyncio.create_task(self._guarded())

    async def _guarded(self) -> None:
        try:
            await self._apply()
        except Exception as exc:  # a bug or an unexpected error: never leave it running
            log.exception("reload %d of %s: unexpected error", self.op.id, self.op.model)
            if self.op.state == State.RUNNING:
                self.op.finish(State.FAILED, f"unexpected error: {exc}")

    async def _apply(self) -> None:
        op = self.op
        log.info(
            "reload %d of %s started: %s", op.id, op.model, json.dumps(op.patch) if op.patch else "config on disk",
            extra={"hostd_model": op.model, "hostd_operation": str(op.id), "message_id": MESSAGE_IDS["started"]},
        )
        try:
            self.check_cancel()
            op.enter(Stage.RECORD)
            await self.record()
            op.enter(Stage.DRAIN)
            drain = asyncio.create_task(self.drain())
            while not drain.done():
                await asyncio.wait({drain}, timeout=0.2)
                if (op.cancel_requested or op.interrupt_requested) and not drain.done():
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
                await self.restore(resume=not isinstance(exc, Interrupted))
            except Exception as again:  # pragma: no cover - logged for operators
                log.exception("reload %d: restoring after %s failed: %s", op.id, exc, again)
            state = State.CANCELLED if isinstance(exc, Cancelled) else State.FAILED
            op.enter(Stage.FINISHED)
            op.finish(state, str(exc))
            return
        try:
            op.enter(Stage.RESTART)
            await self.restart()
            op.enter(Stage.VERIFY)
            await self.verify(self.target)
        except Exception as exc:
            if await self.stopping():
                # A stop replaced our restart job: put the file back, start nothing.
                op.enter(Stage.ROLLBACK)
                restore_file(self.model.dropins / RELOAD_DROPIN, self.previous_reload)
                remove_durably(state_dir(self.model.name) / INTENT)
                op.restored = True
                op.enter(Stage.FINISHED)
                op.finish(State.FAILED, f"interrupted: the model is being stopped ({exc})")
                return
            cause = await self.model.probe.engine_error(str(exc))
            op.enter(Stage.ROLLBACK)
            try:
                await self.rollback(cause)
                op.enter(Stage.RESUME)
                await self.resume()
            except Exception as again:
                log.error("reload %d of %s: rollback failed too: %s", op.id, op.model, again)
                op.degraded = True  # the gateway stays paused: nothing safe to serve
                op.enter(Stage.FINISHED)
                op.finish(State.FAILED, f"{cause}; rollback failed: {again}")
                return
            op.enter(Stage.FINISHED)
            op.finish(State.ROLLED_BACK, cause)
            return
        # Verified: the engine attached the same weight daemon (PID, inode),
        # which holds the weights unless the backend says they are not retained.
        not_retained = self.weights_not_retained()
        op.weights_reused = self.weights_before is not None and not not_retained
        if not_retained:
            op.notes.append(f"weights not retained ({not_retained}): the engine loaded them from disk")
            log.info("reload %d of %s: weights not retained (%s); the engine loaded them from disk",
                     op.id, op.model, not_retained)
        op.enter(Stage.RESUME)
        try:
            await self.resume()
        except Exception as exc:  # the engine runs the target: commit, but say so
            await self.commit()
            op.enter(Stage.COMMIT)
            op.enter(Stage.FINISHED)
            op.finish(State.FAILED, f"the new config runs, but the gateway did not resume: {exc}")
            return
        op.enter(Stage.COMMIT)
        await self.commit()
        op.enter(Stage.FINISHED)
        op.finish(State.DONE)


def patch_from_variants(patch: dict[str, Any]) -> dict:
    """D-Bus a{sv} -> plain values (Variant.value)."""
    return {k: getattr(v, "value", v) for k, v in patch.items()}
