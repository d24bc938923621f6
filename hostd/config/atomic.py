"""Write a config file so that readers see the old content or the new, never a mix.

One job: the atomic replace the manager uses for drop-ins (90-reload.yaml,
99-rollback.yaml) and the state it records. Temp file in the same directory
(hidden, so the loader skips it), fsync, rename over the target, fsync the
directory so the rename itself survives a crash.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: os.PathLike | str, text: str, mode: int = 0o644) -> None:
    """Replace PATH with TEXT atomically and durably."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def remove_durably(path: os.PathLike | str) -> bool:
    """Unlink PATH (if it exists) and fsync its directory; True when it existed."""
    path = Path(path)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
