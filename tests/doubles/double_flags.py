"""TEST DOUBLE support: the doubles' argument parsers, built from the flags
the real upstream parsers have (tests/upstream/flags/*.json, written by
tests/upstream/generate_flags.py from vLLM's and SGLang's own parsers).

So a double accepts exactly the option strings the upstream version it
imitates accepts, and rejects the rest as argparse does (exit 2,
"unrecognized arguments"). It does not copy upstream's leniencies ('_' for
'-'); rejecting more than upstream is safe for a double, accepting more is
not. Values are kept as strings; a double converts the few it reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FLAGS = Path(__file__).resolve().parents[1] / "upstream" / "flags"


def fixture(upstream: str, version: str) -> dict:
    """The flags of UPSTREAM at VERSION, else of the newest version recorded."""
    exact = FLAGS / f"{upstream}-{version}.json"
    if exact.exists():
        return json.loads(exact.read_text())
    newest = sorted(FLAGS.glob(f"{upstream}-*.json"))[-1]
    return json.loads(newest.read_text())


def add_flags(parser: argparse.ArgumentParser, options: dict) -> None:
    """Add every option string of OPTIONS ({option: {dest, takes_value, nargs}})
    to PARSER, grouped by dest as upstream declares them."""
    by_dest: dict[str, list[tuple[str, dict]]] = {}
    for option, spec in options.items():
        by_dest.setdefault(spec["dest"], []).append((option, spec))
    for dest, entries in sorted(by_dest.items()):
        switches = [o for o, spec in entries if not spec["takes_value"]]
        valued = [(o, spec) for o, spec in entries if spec["takes_value"]]
        if switches:
            negations = [o for o in switches if o.startswith("--no-")]
            positives = [o for o in switches if o not in negations]
            if positives:
                parser.add_argument(*positives, dest=dest, action="store_true", default=None)
            if negations:
                parser.add_argument(*negations, dest=dest, action="store_false", default=None)
        if valued:
            nargs = valued[0][1]["nargs"]
            kwargs = {"nargs": nargs} if nargs not in (None, "None") else {}
            parser.add_argument(*(o for o, _ in valued), dest=dest, **kwargs)
