"""hostctl's output conventions, shared by every command: systemctl's exit
codes, `--json=short|pretty`, and its tables (`--no-legend`).

One job: how hostctl prints. Trusts nothing it prints to be short or safe
beyond what the caller hands it (the manager's words, the config's values).
"""

from __future__ import annotations

import argparse
import json

EXIT_FAILED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_NO_SUCH_MODEL = 1, 2, 3, 4


def emit_json(args: argparse.Namespace, data) -> None:
    """--json=short: one line; --json=pretty: indented (systemd's two modes)."""
    if getattr(args, "json", None) == "short":
        print(json.dumps(data, sort_keys=True, separators=(",", ":")))
    else:
        print(json.dumps(data, indent=2, sort_keys=True))


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

