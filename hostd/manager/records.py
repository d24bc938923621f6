"""The manager's records on disk: everything under /var/lib/hostd/.manager.

One job: own that layout. Nothing else in hostd knows the file names.

    .manager/next-operation          the operation counter (ids survive restarts)
    .manager/NAME/reload-intent.json a reload in progress: what to restore
    .manager/NAME/committed.json     the config the engine was last verified to run

Trust: the directory is root's (0700), apart from the service user's
/var/lib/hostd/NAME, so the service user cannot forge what root acts on.
Reading never creates anything; the first write creates the directories.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import msgspec

from hostd import paths
from hostd.config.atomic import remove_durably, write_atomic

log = logging.getLogger("hostd.manager.records")

INTENT = "reload-intent.json"
COMMITTED = "committed.json"
COUNTER = "next-operation"


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

    def intent(self, name: str) -> Optional[dict]:
        """The intent record of a reload of NAME that has not ended, or None."""
        text = self._read(self._dir(name) / INTENT)
        return json.loads(text) if text else None

    def intent_path(self, name: str) -> Path:
        """For messages to operators only."""
        return self._dir(name) / INTENT

    def write_intent(self, name: str, intent: dict) -> None:
        self._write(self._dir(name) / INTENT, json.dumps({**intent, "at": time.time()}, indent=1))

    def drop_intent(self, name: str) -> None:
        remove_durably(self._dir(name) / INTENT)

    # ------------------------------------------------------------ committed config

    def committed_text(self, name: str) -> Optional[str]:
        return self._read(self._dir(name) / COMMITTED)

    def committed(self, name: str) -> Optional[dict]:
        """{"engine": ..., "fixed": ..., "at": ...} last verified, or None."""
        text = self.committed_text(name)
        return json.loads(text) if text else None

    def write_committed(self, name: str, cfg) -> None:
        data = msgspec.to_builtins(cfg)
        engine = data.pop("engine")
        self._write(self._dir(name) / COMMITTED,
                    json.dumps({"engine": engine, "fixed": data, "at": time.time()}, indent=1))

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
