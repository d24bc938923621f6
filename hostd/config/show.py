"""Render a model's effective config with the file each value came from,
the way `systemd-analyze cat-config` shows where settings live."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from hostd.config import redact
from hostd.config.load import LoadedModel

COMMENT_COLUMN = 44


def effective(loaded: LoadedModel, redacted: bool = False) -> dict:
    """The effective config as plain data, defaults included; REDACTED: with
    env: values and secret flags' values replaced (hostd/config/redact.py)."""
    data = msgspec.to_builtins(loaded.config)
    return redact.config(data) if redacted else data


def with_origins(loaded: LoadedModel, redacted: bool = False) -> dict[str, dict[str, Any]]:
    """{dotted key: {"value": ..., "origin": file or "(default)"}} for every
    leaf; REDACTED as for effective()."""
    out: dict[str, dict[str, Any]] = {}

    def walk(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, dict) and value and _is_struct(loaded, path):
            for key, item in value.items():
                walk(item, path + (key,))
            return
        out[".".join(path)] = {"value": value, "origin": loaded.origin(path)}

    walk(effective(loaded, redacted), ())
    return out


def _is_struct(loaded: LoadedModel, path: tuple[str, ...]) -> bool:
    """Sections of the schema are walked into; free-form mappings (env) are leaves."""
    node: Any = loaded.config
    for key in path:
        node = getattr(node, key, None)
    return isinstance(node, msgspec.Struct)


def render(loaded: LoadedModel, redacted: bool = False) -> str:
    """YAML text of the effective config, each value commented with its
    origin; REDACTED as for effective(), and said in the header."""
    lines = [
        f"# model {loaded.name}: effective configuration",
        "# files, lowest first: " + (", ".join(loaded.merged.files) or "(none)"),
    ]
    if redacted:
        lines.append(f"# env: values and secret flags' values shown as {redact.REDACTED} (run as root to see them)")
    printed: set[tuple[str, ...]] = set()
    for dotted, item in with_origins(loaded, redacted).items():
        path = tuple(dotted.split("."))
        for depth in range(1, len(path)):
            if path[:depth] not in printed:
                printed.add(path[:depth])
                lines.append("  " * (depth - 1) + f"{path[depth - 1]}:")
        text = "  " * (len(path) - 1) + f"{path[-1]}: {json.dumps(item['value'])}"
        lines.append(f"{text.ljust(COMMENT_COLUMN)} # {item['origin']}")
    return "\n".join(lines) + "\n"
