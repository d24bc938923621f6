"""Run by a real vLLM's or SGLang's Python (imported by vllm_parser.py and
sglang_parser.py, never by hostd): what one argparse option of upstream's
parser takes, for tests/upstream/flags/.

For each option string: its dest, whether it takes a value and its nargs (as
before), and now what upstream checks of the value while parsing: the
value's kind, read by giving upstream's own type function sample strings
(its wrappers, such as vLLM's optional_type(int), are closures a name does
not tell), the non-numeric words a numeric type also takes ('None', 'auto'),
and the choices. The test doubles (tests/doubles/double_flags.py) check
values by these, so they refuse at parse time (exit 2) what upstream's
parser refuses there.
"""

from __future__ import annotations

import argparse

# A word no numeric or JSON parser takes, a float, an int, a JSON object.
WORD, FLOAT, INT, OBJECT = "x-y", "0.5", "1", "{}"
# Words a numeric type may also take (vLLM: optional_type -> '' and 'None';
# human_readable_int_or_auto -> 'auto').
WORDS = ("", "None", "none", "auto", "-1")


def _takes(kind, value: str) -> bool:
    try:
        kind(value)
    except Exception:  # argparse turns ValueError, TypeError and ArgumentTypeError into exit 2
        return False
    return True


def value_kind(action: argparse.Action):
    """'str' (any string), 'float', 'int', 'json' (a JSON document), 'other'
    (checked by upstream in a way not recorded: the doubles take any value),
    or None for a switch."""
    if action.nargs == 0:
        return None
    kind = action.type
    if kind is None or _takes(kind, WORD):
        return "str"
    if _takes(kind, FLOAT):
        return "json" if _takes(kind, OBJECT) else "float"
    if _takes(kind, INT):
        return "int"
    if _takes(kind, OBJECT):
        return "json"
    return "other"


def spec(action: argparse.Action) -> dict:
    kind = value_kind(action)
    entry = {
        "dest": action.dest,
        "takes_value": action.nargs != 0,
        "nargs": action.nargs if isinstance(action.nargs, (int, str, type(None))) else str(action.nargs),
        "type": kind,
        "choices": sorted(str(c) for c in action.choices) if action.choices is not None else None,
    }
    if kind in ("int", "float") and action.type is not None:
        entry["words"] = [w for w in WORDS if w != "-1" and _takes(action.type, w)]
    return entry


def flags_of(parser: argparse.ArgumentParser) -> dict:
    """{option string: spec} of PARSER's options (help excluded)."""
    entries = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            entries[option] = spec(action)
    return dict(sorted(entries.items()))
