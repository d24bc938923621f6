"""What a reload is asked to change, checked before anything reads it.

One job: the checks a reload patch passes before validation merges it into a
config (reload.py's Reload.validate): plain values out of D-Bus variants, the
size cap that any local user's CheckReload meets first, the types the
engine's struct takes, and a swapped checkpoint's path. Each refusal is an
InvalidValue naming the key, and nothing has been touched when it comes.

Trust: a patch comes from any local user (CheckReload) or a polkit-allowed
caller (Reload): it is weighed before it is parsed, converted or rendered,
and a checkpoint path is only stat()ed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hostd import config as hostd_config
from hostd.checkpoints import config_file
from hostd.config import schema
from hostd.manager import errors


def patch_from_variants(patch: dict[str, Any]) -> dict:
    """D-Bus a{sv} -> plain values (Variant.value). Counted before anything
    is built from it: an entry takes at least two bytes of MAX_PATCH_BYTES,
    so more than MAX_PATCH_ENTRIES can never be a patch (a million cost
    the manager's loop 0.9 s to build and then refuse)."""
    if len(patch) > MAX_PATCH_ENTRIES:
        raise errors.InvalidValue(f"the patch has {len(patch)} entries; a reload patch holds at most "
                                  f"{MAX_PATCH_ENTRIES} (an engine's limits take a few)")
    return {k: getattr(v, "value", v) for k, v in patch.items()}


# Any local user may ask CheckReload, and the bus carries 32 MiB: a patch is
# weighed before anything parses, converts or renders it, since rendering a
# multi-megabyte value to YAML held root's only event loop for seconds
# (issue 33, N1). An engine's editable values take a few hundred bytes.
MAX_PATCH_BYTES = 8192
MAX_PATCH_ENTRIES = MAX_PATCH_BYTES // 2  # a key and its value: two bytes at least


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


def check_checkpoint_values(patch: dict, swappable: tuple[str, ...]) -> None:
    """Refuse (InvalidValue naming the key) a SWAPPABLE key of PATCH that is
    not an absolute path, or whose config.json is not a JSON object in a
    regular file of sane size, read by the one guarded reader
    (checkpoints/config_file.py: opened without blocking, checked on the
    open file): the backend's checks read it as root, on root's only event
    loop, and a FIFO or a device there would hold or exhaust the manager."""
    for key in swappable:
        if key not in patch:
            continue
        value = patch[key]
        if not isinstance(value, str) or not value.startswith("/") or "\0" in value:
            raise errors.InvalidValue(f"{key}: expected the absolute path of a checkpoint directory, "
                                      f"got {str(value)[:200]!r}")
        try:
            config_file.read(value)
        except ValueError as exc:
            raise errors.InvalidValue(f"{key}: {str(exc)[:500]}") from None


def check_patch_types(engine: msgspec.Struct, patch: dict) -> None:
    """Refuse (InvalidValue naming the key) a PATCH that ENGINE's struct does not
    take, before it is rendered: the loader would refuse the file it makes anyway."""
    try:
        msgspec.convert({**msgspec.to_builtins(engine), **patch}, type(engine))
    except msgspec.ValidationError as exc:
        path, message, _ = hostd_config.load.validation_problem(exc, type(engine))
        if not path:
            raise errors.InvalidValue(f"the patch makes an invalid engine section: {message}") from None
        raise errors.InvalidValue(f"engine.{'.'.join(path)}: {message}") from None


def check_patch_keys(patch: dict, cfg, name: str, umbrella_unit: str) -> None:
    """Refuse (NotEditable naming the key and what is editable) a key of PATCH
    that a reload of the model NAME, whose config is CFG, may not change: a
    fixed key needs `systemctl restart UMBRELLA_UNIT`, an unknown one is no
    field of the backend."""
    editable = schema.editable_fields(cfg.backend)
    swappable = schema.swappable_fields(cfg.backend)
    fixed = {f.name for f in msgspec.structs.fields(type(cfg))} - {"engine"}
    for key in patch:
        if key in editable or key in swappable:
            continue
        if key in fixed:
            why = (
                f"{key!r} is fixed (it describes the weights or the units); change it in "
                f"/etc/hostd/models/{name}.yaml and run `systemctl restart {umbrella_unit}`, "
                "which loads the weights again"
            )
        else:
            why = f"{key!r} is not a field of the {cfg.backend} backend"
        raise errors.NotEditable(f"{why}; editable: {', '.join(swappable + editable)}")
