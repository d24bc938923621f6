"""What one reload changes: the engine's limits, or the checkpoint.

One job: the answer validate builds once (change_of) and everything after
it asks (Change.swaps) instead of testing a directory for None: the
preflight's choice (swap or not), the main engine's restart (the engine
alone, or the pair with its weight daemon), verify (the new checkpoint's
digest), the rollback's pin (the checkpoint that served), the weights'
reuse, CheckReload's answer and the intent record.

Below the manager, the engine and the backends still take a `swap` flag of
their own: it says which weight slot an engine process attaches (the
swap's engine runs on the smaller KV cache of reload.bridge_kv_mib), a fact
of that process, not of the reload.

Trust: the weight daemon's status it reads is typed and capped by its
client (weights/client.py); the checkpoint paths are root's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hostd.manager import errors


@dataclass
class Change:
    """A reload of the engine's limits (CHECKPOINT None), or a checkpoint
    swap: CHECKPOINT the new one's resolved directory, PREVIOUS the one the
    main weight daemon holds, DIGEST the new one's content digest once its
    daemon reported it (the swap's load-next)."""

    checkpoint: Optional[str] = None
    previous: Optional[str] = None
    digest: Optional[str] = None

    @property
    def swaps(self) -> bool:
        return self.checkpoint is not None


def change_of(name: str, weights_unit: str, target, asked: bool, status) -> Change:
    """What a reload of model NAME to TARGET changes: a checkpoint swap when
    the target's checkpoint directory (resolved: a symlink moved to another
    directory counts) is not the one the main weight daemon holds (STATUS,
    validate's one reading; None: it did not answer), else the limits.
    ASKED: the patch names `model`; then a daemon that does not answer is
    refused (no telling what it holds), else the reload is one of limits,
    as ever."""
    if status is None:
        if asked:
            raise errors.NotRunning(f"the weight daemon of {name} ({weights_unit}) "
                                    "does not answer: cannot tell which checkpoint it holds")
        return Change()
    wanted = str(Path(target.model).resolve())
    held = status.fingerprint.model_path
    return Change(checkpoint=wanted, previous=held) if wanted != held else Change()
