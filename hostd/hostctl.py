"""hostctl: the administrator's command line.

Commands that only read configuration (`config`, `edit`) work with no daemon
running; the others talk to the manager (org.hostd1) over the system bus
through hostd.client, with the verbs people already type for systemctl.
Exit codes: 0 success, 1 the operation failed or was rolled back or refused,
2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import yaml
from dbus_fast.errors import DBusError

from hostd import config, units
from hostd.config import show
from hostd.manager import api


def cmd_config(args: argparse.Namespace) -> int:
    root = config.config_root(args.config_dir)
    if args.check:
        names = [args.name] if args.name else None
        problems = config.check(root, names)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(f"{len(problems)} problem(s) in {root}", file=sys.stderr)
            return 1
        checked = names or config.list_models(root)
        print(f"{root}: ok ({len(checked)} model(s): {', '.join(checked) or 'none'})")
        return 0
    if not args.name:
        print("hostctl config: give a model NAME, or --check", file=sys.stderr)
        return 2
    try:
        loaded = config.load_model(args.name, root)
    except config.ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(show.with_origins(loaded), indent=2))
    else:
        sys.stdout.write(show.render(loaded))
    return 0


def _client():
    from hostd.client import Client

    return Client()


def _dbus_error(exc: Exception) -> int:
    name = getattr(exc, "type", type(exc).__name__)
    print(f"hostctl: {name}: {getattr(exc, 'text', exc)}", file=sys.stderr)
    return 1


def parse_assignments(pairs: list[str]) -> dict:
    """key=value words -> patch; values are YAML scalars (16, 0.5, true, null)."""
    patch = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"hostctl: {pair!r} is not KEY=VALUE")
        patch[key] = yaml.safe_load(value) if value else ""
    return patch


def _progress(props: dict) -> None:
    print(f"  operation {props['Id']}: {props['State']}, stage {props['Stage']}", file=sys.stderr, flush=True)


def cmd_reload(args: argparse.Namespace) -> int:
    patch = parse_assignments(args.assignments)
    with _client() as hostd:
        result = hostd.reload(args.name, patch, wait=not args.no_wait,
                              on_change=None if args.quiet else _progress)
    if args.no_wait:
        print(result["path"])
        return 0
    state = result["State"]
    line = f"reload of {args.name}: {state}"
    facts = [f"strategy {result['Strategy']}"] if result.get("Strategy") else []
    if result.get("WeightsReused"):
        facts.append("weights reused")
    if facts:
        line += f" ({', '.join(facts)})"
    if result.get("Error"):
        line += f": {result['Error']}"
    for note in result.get("Notes", []):
        line += f"; {note}"
    ok = state in api.SUCCESS_STATES
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_list(args: argparse.Namespace) -> int:
    with _client() as hostd:
        models = hostd.list_models()
    print(f"{'MODEL':<28} STATE")
    for m in models:
        print(f"{m['name']:<28} {m['state']}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _client() as hostd:
        props = hostd.model(args.name)
    engine = props["Config"].get("engine", {})
    print(f"model {props['Name']} ({props['Backend']}): {props['State']}, {props['InFlight']} in flight")
    print(f"  engine limits: {json.dumps(engine, sort_keys=True)}")
    print(f"  editable: {', '.join(props['EditableFields'])}")
    if props["ActiveOperation"] != "/":
        print(f"  active operation: {props['ActiveOperation']}")
    return 0


def cmd_operations(args: argparse.Namespace) -> int:
    with _client() as hostd:
        ops = hostd.operations()
    print(f"{'ID':>5} {'MODEL':<20} {'KIND':<8} {'STATE':<12} STAGE")
    for op in ops:
        print(f"{op['id']:>5} {op['model']:<20} {op['kind']:<8} {op['state']:<12} {op['stage']}")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client() as hostd:
        hostd.cancel(args.id)
    return 0


def cmd_unit_verb(args: argparse.Namespace) -> int:
    with _client() as hostd:
        result = getattr(hostd, args.command)(args.name)
    print(f"{args.command} {args.name}: {result['State']}{': ' + result['Error'] if result['Error'] else ''}")
    return 0 if result["State"] == "done" else 1


# Above the manager's 90-reload.yaml (an administrator's edit wins over values
# set by `hostctl reload`), below 99-rollback.yaml (a failed reload's pin wins).
EDIT_DROPIN = "95-override.yaml"


def cmd_edit(args: argparse.Namespace) -> int:
    """Edit NAME.d/95-override.yaml (EDIT_DROPIN) in $EDITOR; save it only if the result is valid."""
    root = config.config_root(args.config_dir)
    target = config.dropin_dir(args.name, root) / EDIT_DROPIN
    if not config.model_file(args.name, root).exists():
        print(f"hostctl: no model {args.name!r} under {root}", file=sys.stderr)
        return 1
    original = target.read_text() if target.exists() else (
        f"# Drop-in for model {args.name}; applied after {args.name}.yaml.\n"
        "# Editable keys go under engine: (apply with systemctl reload model@NAME).\n"
    )
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w+", suffix=".yaml", prefix=f"{args.name}-") as scratch:
        scratch.write(original)
        scratch.flush()
        subprocess.run([*shlex.split(editor), scratch.name], check=False)
        edited = Path(scratch.name).read_text()
    if edited == original:
        print("hostctl: no changes", file=sys.stderr)
        return 0
    # Validate the tree as it would be with the edited drop-in, touching nothing.
    try:
        data = config.load.parse_yaml(edited, str(target))
        merged, problems = config.load.merge_model(args.name, root, overlay={EDIT_DROPIN: data})
        if problems:
            raise config.ConfigError(problems)
        config.load.validate(merged, config.load.model_type(merged))
    except config.ConfigError as exc:
        print(exc, file=sys.stderr)
        print(f"hostctl: not saved: {target} would be invalid", file=sys.stderr)
        return 1
    config.write_atomic(target, edited)
    print(f"saved {target}; apply with: systemctl reload {units.umbrella(args.name)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hostctl", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config-dir",
        metavar="DIR",
        help="configuration root (default: $HOSTD_CONFIG_DIR or /etc/hostd)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser(
        "config", help="show a model's effective config with origins, or --check all"
    )
    p.add_argument("name", nargs="?", metavar="NAME")
    p.add_argument("--check", action="store_true", help="validate; list every problem")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_config)

    p = commands.add_parser("reload", help="apply KEY=VALUE limits (or the config on disk) without reloading weights")
    p.add_argument("name", metavar="NAME")
    p.add_argument("assignments", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--no-wait", action="store_true", help="print the operation path and return")
    p.add_argument("--quiet", action="store_true", help="no stage progress")
    p.add_argument("--from-unit", dest="quiet", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_reload)

    p = commands.add_parser("list", help="models and their states")
    p.set_defaults(func=cmd_list)
    p = commands.add_parser("status", help="one model's state, limits and operation")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_status)
    p = commands.add_parser("operations", help="operations since the manager started")
    p.set_defaults(func=cmd_operations)
    p = commands.add_parser("cancel", help="cancel an operation (during its drain)")
    p.add_argument("id", type=int, metavar="ID")
    p.set_defaults(func=cmd_cancel)
    for verb in ("start", "stop", "restart"):
        p = commands.add_parser(verb, help=f"{verb} a model (all its units) and wait")
        p.add_argument("name", metavar="NAME")
        p.set_defaults(func=cmd_unit_verb)
    p = commands.add_parser("edit", help="edit a drop-in in $EDITOR; saved only when valid")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_edit)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DBusError as exc:  # the manager's refusals and the bus's own errors
        return _dbus_error(exc)


if __name__ == "__main__":
    sys.exit(main())
