"""A checkpoint's config.json, read the one guarded way.

One job: the text and the JSON object of CHECKPOINT/config.json, for every
reader of it: root's manager (a reload's check of `model=`, the backends'
refusals, the KV budget, the D-Bus properties any local user may ask for),
hostctl, the engines and the weight daemons. The checkpoint may be any
user's directory, and root's manager reads it on its only event loop, so
the file is read as the loader reads config files (config.yaml_files'
read_regular_file): opened non-blocking (a FIFO answers at once instead of
holding the reader until a writer comes), checked with fstat on that open
descriptor (no stat-then-open race with a rename), a regular file of at
most MAX_BYTES, and read at most that. A final symlink is followed:
Hugging Face's cache lays a checkpoint out as symlinks into its blobs, and
whatever the link names must pass the same checks; the content is parsed,
never echoed. Within shared_reads (one reload: its check of `model=`, the
backends' refusals, the budget, the strategy's steps) a checkpoint's
config.json is read once, and every later use gets that read.

Trusts nothing of the file.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import json
from pathlib import Path

from hostd.config.problems import ConfigError
from hostd.config.yaml_files import MAX_FILE_BYTES, read_regular_file

MAX_BYTES = MAX_FILE_BYTES  # a checkpoint's config.json takes kilobytes


class ConfigFileError(ValueError):
    """config.json cannot be used; the message names the file and why."""


def path_of(checkpoint) -> Path:
    return Path(checkpoint) / "config.json"


def read_text(checkpoint) -> str:
    """CHECKPOINT/config.json's text; ConfigFileError naming it otherwise
    (missing, unreadable, not a regular file, over MAX_BYTES, not UTF-8)."""
    path = path_of(checkpoint)
    try:
        data = read_regular_file(path, str(path))
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except ConfigError as exc:
        raise ConfigFileError("; ".join(str(p) for p in exc.problems)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{path}: not UTF-8 ({exc.reason} at byte {exc.start})") from None


_shared: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hostd_config_json_reads", default=None)


@contextlib.contextmanager
def shared_reads(reads: dict):
    """Within: read() of a checkpoint whose config.json READS holds gives
    that first read (a copy), or raises its first error, and a new one is
    kept there; tasks and threads started within inherit it (contextvars)."""
    token = _shared.set(reads)
    try:
        yield
    finally:
        _shared.reset(token)


def read(checkpoint) -> dict:
    """CHECKPOINT/config.json as a JSON object; ConfigFileError naming the
    file otherwise. Read once within shared_reads."""
    reads = _shared.get()
    if reads is None:
        return _read(checkpoint)
    key = str(path_of(checkpoint))
    if key not in reads:
        try:
            reads[key] = _read(checkpoint)
        except ConfigFileError as exc:
            reads[key] = exc
    if isinstance(reads[key], ConfigFileError):
        raise ConfigFileError(str(reads[key]))
    return copy.deepcopy(reads[key])


def _read(checkpoint) -> dict:
    path = path_of(checkpoint)
    try:
        config = json.loads(read_text(checkpoint))
    except json.JSONDecodeError as exc:
        raise ConfigFileError(f"{path}: not JSON ({exc})") from None
    except RecursionError:
        raise ConfigFileError(f"{path}: not JSON (nested too deeply)") from None
    if not isinstance(config, dict):
        raise ConfigFileError(f"{path}: not a JSON object")
    return config
