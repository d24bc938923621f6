"""The manager's records on disk: everything under /var/lib/hostd/.manager.

One job: own that layout. Nothing else in hostd knows the file names.

    .manager/next-operation          the operation counter (ids survive restarts)
    .manager/NAME/reload-intent.json a reload in progress: what to restore
    .manager/NAME/committed.json     the config the engine was last verified to run
    .manager/NAME/started.json       the config on disk when the model's units last started
    .manager/NAME/degraded.json      a reload whose rollback failed too: the model is degraded

Each record is a msgspec Struct here (Intent, Committed, Degraded): the only spelling of
its fields. Fields added later have defaults, so a record an older manager
wrote still reads.

Trust: the directory is root's (0700), apart from the service user's
/var/lib/hostd/NAME, so the service user cannot forge what root acts on.
Reading never creates anything; the first write creates the directories.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import msgspec

from hostd import paths
from hostd.config.atomic import remove_durably, write_atomic

log = logging.getLogger("hostd.manager.records")

INTENT = "reload-intent.json"
COMMITTED = "committed.json"
COUNTER = "next-operation"
DEGRADED = "degraded.json"
STARTED = "started.json"


class Intent(msgspec.Struct, kw_only=True):
    """A reload in progress (written at its `record` stage, dropped when it
    ends): what recovery needs to finish or undo it after a manager crash."""

    operation: int
    strategy: str = "restart"  # operation.Strategy; older records had none and were all restarts
    patch: dict[str, Any] = {}
    previous_reload: Optional[str] = None  # 90-reload.yaml before the reload; None: there was none
    previous_rollback: Optional[str] = None  # the same for 99-rollback.yaml
    # 99-rollback.yaml as the reload's own rollback pins it (an engine refused
    # the administrator's drop-in): written here before the file, so recovery
    # keeps the pin instead of putting previous_rollback back. None: no pin.
    rollback_pin: Optional[str] = None
    previous_engine: Optional[dict[str, Any]] = None  # the engine section a rollback brings back
    target_engine: dict[str, Any] = {}  # the engine section the reload applies
    weights: Optional[tuple[int, int]] = None  # the weight daemon's (pid, socket inode) before it
    at: float = 0.0  # when it was written (time.time())
    # A checkpoint swap (strategy swap, or a restart that swaps): the
    # checkpoint directories (resolved) the main weight daemon held before it
    # and is to hold after it. None: the reload keeps the weights.
    previous_checkpoint: Optional[str] = None
    checkpoint: Optional[str] = None


class Degraded(msgspec.Struct, kw_only=True):
    """A reload failed and so did its rollback: the model's State is degraded
    (restart: the gateway stays paused; overlap, standby: it serves from the
    second engine, on the target config) until a reload ends done or rolled-back, or
    the model is stopped or restarted. On disk, so that it survives the next
    operation starting and a restart of the manager."""

    operation: int  # the reload that left it so
    cause: str  # its error
    at: float = 0.0


class Committed(msgspec.Struct, kw_only=True):
    """The config the engine was last verified to run: its engine section, and
    the rest (the fixed fields, reload.* included) apart."""

    engine: dict[str, Any]
    fixed: dict[str, Any] = {}
    # The weight daemon's (pid, socket inode) when it was written. Another
    # daemon since means the model's units started again and read the disk:
    # `fixed` then says what ran before that start, not what runs now.
    weights: Optional[tuple[int, int]] = None
    at: float = 0.0

    @classmethod
    def of(cls, cfg, weights: Optional[tuple[int, int]] = None) -> "Committed":
        """The record of the effective config CFG (a config.schema model)."""
        data = msgspec.to_builtins(cfg)
        return cls(engine=data.pop("engine"), fixed=data, weights=weights, at=time.time())


class Records:
    def __init__(self, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else paths.manager_state_root()
        self._next_id: Optional[int] = None

    def _dir(self, name: str) -> Path:
        return self.root / name

    def _write(self, path: Path, text: str) -> None:
        for directory in (self.root, path.parent):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomic(path, text, mode=0o600)

    @staticmethod
    def _read(path: Path) -> Optional[str]:
        try:
            return path.read_text()
        except FileNotFoundError:
            return None

    # ------------------------------------------------------------ intent

    def intent(self, name: str) -> Optional[Intent]:
        """The intent record of a reload of NAME that has not ended, or None;
        msgspec.DecodeError (ValidationError included) for a broken record."""
        text = self._read(self._dir(name) / INTENT)
        return _decode(text, Intent) if text else None

    def intent_path(self, name: str) -> Path:
        """For messages to operators only."""
        return self._dir(name) / INTENT

    def write_intent(self, name: str, intent: Intent) -> None:
        self._write(self._dir(name) / INTENT, _encode(msgspec.structs.replace(intent, at=time.time())))

    def drop_intent(self, name: str) -> None:
        remove_durably(self._dir(name) / INTENT)

    # ------------------------------------------------------------ committed config

    def committed_text(self, name: str) -> Optional[str]:
        return self._read(self._dir(name) / COMMITTED)

    def committed(self, name: str) -> Optional[Committed]:
        """The config last verified to run, or None."""
        text = self.committed_text(name)
        return _decode(text, Committed) if text else None

    def write_committed(self, name: str, cfg, weights: Optional[tuple[int, int]] = None) -> None:
        """CFG (a config.schema model) is what the engine was verified to run,
        on the weight daemon WEIGHTS ((pid, socket inode), when known)."""
        self._write(self._dir(name) / COMMITTED, _encode(Committed.of(cfg, weights)))

    def started(self, name: str) -> Optional[Committed]:
        """The config on disk when the model's weight daemon last started
        (start_record.py, its unit's ExecStartPre=, as root), or None."""
        text = self._read(self._dir(name) / STARTED)
        return _decode(text, Committed) if text else None

    def write_started(self, name: str, cfg) -> None:
        self._write(self._dir(name) / STARTED, _encode(Committed.of(cfg)))

    def running(self, name: str, weights: Optional[tuple[int, int]] = None) -> Optional[Committed]:
        """What runs, as last recorded: the newer of the committed record (a
        verify) and the start record (a start of the units, which read the
        disk). None when nothing says: no record, or a committed one older
        than a weight daemon (WEIGHTS: its identity now, when known) that
        started without writing a start record (units of an older hostd)."""
        committed, started = self.committed(name), self.started(name)
        if started is not None and (committed is None or started.at > committed.at):
            return started
        if committed is not None and weights is not None and committed.weights is not None \
                and tuple(weights) != tuple(committed.weights):
            return None
        return committed

    # ------------------------------------------------------------ degraded

    def degraded(self, name: str) -> Optional[Degraded]:
        """Why NAME is degraded, or None. A record that does not decode still
        says degraded: only the manager writes it, after a failed rollback."""
        path = self._dir(name) / DEGRADED
        text = self._read(path)
        if not text:
            return None
        try:
            return _decode(text, Degraded)
        except msgspec.DecodeError as exc:
            return Degraded(operation=0, cause=f"{path} does not decode: {exc}")

    def write_degraded(self, name: str, record: Degraded) -> None:
        self._write(self._dir(name) / DEGRADED, _encode(msgspec.structs.replace(record, at=time.time())))

    def clear_degraded(self, name: str) -> None:
        if self._read(self._dir(name) / DEGRADED) is not None:
            remove_durably(self._dir(name) / DEGRADED)

    # ------------------------------------------------------------ operation ids

    def next_operation_id(self) -> int:
        if self._next_id is None:
            try:
                self._next_id = int(self._read(self.root / COUNTER) or 1)
            except ValueError:
                self._next_id = 1
        op_id = self._next_id
        self._next_id += 1
        try:
            self._write(self.root / COUNTER, str(self._next_id))
        except OSError as exc:
            log.warning("cannot persist the operation counter: %s", exc)
        return op_id


def _encode(record: msgspec.Struct) -> str:
    return msgspec.json.format(msgspec.json.encode(record).decode(), indent=1)


def _decode(text: str, kind: type):
    return msgspec.json.decode(text, type=kind)
