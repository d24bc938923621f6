"""hostctl's output conventions, shared by every command: systemctl's exit
codes, `--json=short|pretty` (one versioned document shape), and its
tables (`--no-legend`).

One job: how hostctl prints. Trusts nothing it prints to be short or safe
beyond what the caller hands it (the manager's words, the config's values):
what it writes to a terminal or a pipe passes PrintableOnly, so a model's
error text or a note cannot carry escape sequences to the reader's terminal.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import msgspec

EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_NO_SUCH_MODEL = 1, 2, 3, 4

# C0 controls but tab and newline, DEL, and C1 (CSI, OSC, ... as one code point).
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class PrintableOnly:
    """A text stream's wrapper that writes every control character but tab
    and newline as U+FFFD (what systemctl does with unprintable text)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(CONTROL.sub("\ufffd", text))
        return len(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


# The one shape of every --json output (but `logs --json`, which is
# journalctl's own): {"version", "command", "ok", "data"}, snake_case keys
# throughout. VERSION rises when a key changes meaning or goes.
JSON_VERSION = 1


class JsonDocument(msgspec.Struct, forbid_unknown_fields=True):
    """What every `hostctl ... --json` prints (but `logs`): a reader decodes
    this and checks VERSION before it reads DATA."""

    version: int
    command: str  # the hostctl command: status, reload, config, ...
    ok: bool  # the command's exit status is 0
    data: Any  # the command's answer: an object or a list, snake_case keys


def emit_json(args: argparse.Namespace, data, ok: bool = True) -> None:
    """DATA as hostctl's JSON document for this command (JSON_VERSION):
    --json=short one line, --json=pretty indented (systemd's two modes). OK:
    the command's exit status is 0."""
    document = {"version": JSON_VERSION, "command": args.command, "ok": ok, "data": data}
    if getattr(args, "json", None) == "short":
        print(json.dumps(document, sort_keys=True, separators=(",", ":")))
    else:
        print(json.dumps(document, indent=2, sort_keys=True))


def snake_case(name: str) -> str:
    """A D-Bus property's name as a key of hostctl's JSON: CreatedUSec ->
    created_usec, EnginePID -> engine_pid, WeightsReused -> weights_reused."""
    name = re.sub(r"USec$", "Usec", name)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def snake_keys(properties: dict) -> dict:
    """PROPERTIES (a D-Bus object's, as hostd.client reads them) with
    snake_case names; the values as they are."""
    return {snake_case(name): value for name, value in properties.items()}


def table(args: argparse.Namespace, header: list[str], rows: list[list]) -> None:
    """Columns as systemctl prints them; the header and the count are the
    legend (--no-legend drops both)."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    lines = [] if args.no_legend else [header]
    for row in (lines + cells):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    if not args.no_legend:
        print(f"\n{len(rows)} model(s) listed." if header[0] == "MODEL" else f"\n{len(rows)} listed.")

