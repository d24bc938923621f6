"""The drop-in files a reload writes under /etc/hostd/models/NAME.d, as root.

Drop-ins: a patch is merged into /etc/hostd/models/NAME.d/90-reload.yaml by
one function (merge_patch, parsing with the config loader) and written
atomically. An empty patch applies what is on disk now; if that fails, the
previous values are pinned in 99-rollback.yaml (the administrator's own files
are never edited) and the Operation says so.

Trust: root writes only what it computed from validated data. A patch and a
pin are rendered within the config loader's limits before anything is
written (render); the pin holds the last committed engine section, never what
the engine reported as such (previous_engine); a failure message in a comment
is one bounded line without control characters (comment_text).
"""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Optional

import msgspec

from hostd import config as hostd_config
from hostd.config import schema, yaml_files
from hostd.config.atomic import remove_durably, write_atomic
from hostd.engine.health import EngineHealth, sent
from hostd.manager import errors
from hostd.manager.records import Committed

log = logging.getLogger("hostd.manager.reload")

RELOAD_DROPIN = "90-reload.yaml"
ROLLBACK_DROPIN = "99-rollback.yaml"


def rollback_header(cause: str) -> str:
    """The comment lines of 99-rollback.yaml: the cause made safe and bounded
    (comment_text), wrapped at words, never cut mid-word."""
    lines = textwrap.wrap(f"Written by hostd's manager: the reload of these values failed: {comment_text(cause)}",
                          76, break_long_words=False, break_on_hyphens=False)
    lines.append("Remove this file once the config is fixed.")
    return "".join(f"# {line}\n" for line in lines)


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


def merge_patch(dropin: Path, patch: dict, top_level: tuple[str, ...] = ()) -> dict:
    """What DROPIN (90-reload.yaml) holds once PATCH is merged into its engine
    section (its TOP_LEVEL keys, schema.swappable_fields, at the top): the one
    place a patch meets the file, parsed by the config loader."""
    try:
        data = yaml_files.read_yaml(dropin).data if dropin.exists() else {}
    except hostd_config.ConfigError as exc:
        raise errors.InvalidValue(f"{RELOAD_DROPIN} cannot be merged with the patch:\n{exc}") from None
    engine = data.get("engine")
    limits = {k: v for k, v in patch.items() if k not in top_level}
    top = {k: v for k, v in patch.items() if k in top_level}
    return {**data, **top, "engine": {**(engine if isinstance(engine, dict) else {}), **limits}}


RELOAD_HEADER = "# Written by hostd's manager on reload; hostctl config NAME shows the effect.\n"
COMMENT_LIMIT = 500  # characters of a failure message in a drop-in's comment


def render(file_name: str, header: str, data: dict) -> str:
    """The text of a drop-in root writes: refused (InvalidValue naming the key)
    where the config loader would refuse the file, before anything is written."""
    try:
        return yaml_files.render_yaml(data, file_name, header)
    except hostd_config.ConfigError as exc:
        raise errors.InvalidValue("; ".join(map(str, exc.problems))) from None


def pin_checkpoint(directory: Path, checkpoint: str, cause: str) -> None:
    """Pin `model: CHECKPOINT` in DIRECTORY's 99-rollback.yaml, beside what
    it pins already: after a checkpoint swap from the administrator's own
    files that did not finish, the checkpoint that serves stays the one the
    files name (the administrator's file is not edited)."""
    path = directory / ROLLBACK_DROPIN
    try:
        data = yaml_files.read_yaml(path).data if path.exists() else {}
    except hostd_config.ConfigError:
        data = {}
    write_atomic(path, render(ROLLBACK_DROPIN, rollback_header(cause), {**data, "model": checkpoint}))


def comment_text(message: str, limit: int = COMMENT_LIMIT) -> str:
    """MESSAGE (the engine's journal lines among others: not root's text) fit
    for one comment line: control and other non-printable characters (YAML
    line breaks such as U+2028 included) become spaces, whitespace collapses,
    and at most LIMIT characters are kept, cut at a word."""
    text = " ".join("".join(c if c.isprintable() else " " for c in message).split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 4]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + " ..."


def previous_engine(backend: str, committed: Optional[Committed], health: Optional[EngineHealth]) -> Optional[dict]:
    """The engine section a rollback brings back, as values root computed: the
    last COMMITTED section (records.py, written by root after a verify), else
    (nothing committed yet) the section the engine reports, only if it is a
    valid engine section of BACKEND, re-rendered from the schema's type. Text
    the engine sent is never written as such; None when neither is usable."""
    engine_type = schema.ENGINE_TYPES[backend]
    for source in (committed.engine if committed else None, sent(health.engine_config) if health is not None else None):
        if source is None:
            continue
        try:
            return msgspec.to_builtins(msgspec.convert(source, engine_type))
        except (msgspec.ValidationError, TypeError):
            log.warning("previous engine values refused: not a valid %s engine section", backend)
    return None


async def revert(directory: Path, reload: Callable[[], Awaitable[str]], forget: Callable[[], None]) -> tuple[str, str]:
    """`hostctl revert` (Manager.Revert): the model back to its
    administrator's own files. The manager's RELOAD_DROPIN and a rollback pin
    (ROLLBACK_DROPIN) in DIRECTORY are removed, then RELOAD() (a reload of the
    config on disk) starts; its Operation's path, and a note naming what was
    removed. A reload refused at its check puts both files back as they were:
    nothing changed. FORGET: the model's cached config is stale."""
    kept = {path: read_text(path) for path in (directory / RELOAD_DROPIN, directory / ROLLBACK_DROPIN)}
    removed = [path for path, text in kept.items() if text is not None]
    for path in removed:
        remove_durably(path)
    forget()
    try:
        path = await reload()
    except BaseException:
        for path in removed:
            restore_file(path, kept[path])
        forget()
        raise
    return path, (f"revert removed {', '.join(map(str, removed))}" if removed else
                  "revert: no drop-in of the manager's to remove")
