"""TEST DOUBLE support: the doubles' argument parsers, built from the flags
the real upstream parsers have (tests/upstream/flags/*.json, written by
tests/upstream/generate_flags.py from vLLM's and SGLang's own parsers).

So a double accepts exactly the option strings the upstream version it
imitates accepts, and rejects the rest as argparse does (exit 2,
"unrecognized arguments"). It checks each value as upstream's parser does
while parsing, by what the fixture recorded of upstream's own type function
and choices (tests/upstream/parser_dump.py): an int, a float, a JSON
document, one of the choices, with nargs. A value upstream's parser refuses
is refused here too (exit 2, "invalid int value", "invalid choice"). It does
not copy upstream's leniencies ('_' for '-', vLLM's human-readable '1k'
integers, dotted -cc.key=value): rejecting more than upstream is safe for a
double, accepting more is not. Values are kept as strings; a double converts
the few it reads.
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


def value_type(spec: dict):
    """An argparse type that refuses what upstream's type function refuses
    (SPEC's recorded kind and words) and returns the string unchanged; None
    when upstream takes any string (or checks it in a way not recorded)."""
    kind = spec.get("type")
    if kind not in ("int", "float", "json"):
        return None
    words = set(spec.get("words") or ())
    parse = {"int": int, "float": float, "json": json.loads}[kind]

    def check(value: str) -> str:
        if value not in words:
            parse(value)  # ValueError -> argparse: "invalid int value: 'abc'", exit 2
        return value

    check.__name__ = kind
    return check


def add_flags(parser: argparse.ArgumentParser, options: dict) -> None:
    """Add every option string of OPTIONS ({option: {dest, takes_value, nargs,
    type, choices}}) to PARSER, grouped by dest as upstream declares them."""
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
            spec = valued[0][1]
            kwargs: dict = {}
            if spec["nargs"] not in (None, "None"):
                kwargs["nargs"] = spec["nargs"]
            if value_type(spec) is not None:
                kwargs["type"] = value_type(spec)
            if spec.get("choices") is not None:
                kwargs["choices"] = spec["choices"]
            parser.add_argument(*(o for o, _ in valued), dest=dest, **kwargs)
