"""hostctl: the administrator's command line.

Commands that only read configuration (`config`, `edit`) work with no daemon
running; the others talk to the manager (org.hostd1) over the system bus
through hostd.client (`reload --check` too: only the manager can preflight a
reload, and the check changes nothing there), with the verbs people
already type for systemctl, and systemctl's conventions: `--json=short|pretty`
on every command that prints data, `--no-legend`, `--no-pager`, `--version`,
and its exit codes:

    0  success
    1  the operation failed, was rolled back or refused; any other error
    2  usage
    3  the model does not serve (status NAME, is-active): engine down,
       degraded, paused, starting, stopping, stopped or failed
       (is-failed: 0 only when failed, 1 otherwise)
    4  no such model

Errors are one line on stderr (no bus, no manager, a refusal, a closed pipe,
^C), never a traceback.

This module is the parser, main() and the commands that read files only
(config, edit, logs); the commands over the bus are hostctl_bus.py, the
output conventions (exit codes, --json, tables) hostctl_output.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import typing
from pathlib import Path
from typing import Optional

from dbus_fast.errors import DBusError

import hostd
from hostd import backends, config, host_check, units
from hostd.config import schema, show
from hostd.hostctl_bus import (dbus_error, cmd_cancel, cmd_is_active, cmd_is_failed, cmd_list, cmd_log_level,
                               cmd_operations, cmd_reload, cmd_show, cmd_status, cmd_unit_verb)
from hostd.hostctl_output import EXIT_FAILED, EXIT_NO_SUCH_MODEL, EXIT_USAGE, PrintableOnly, emit_json
from hostd.manager import api


def cmd_config_check(args: argparse.Namespace, root: Path) -> int:
    """`config --check [NAME]`, or `--check --file F --as TARGET`: every
    problem, one per line on stderr (or all in --json), exit 1 when any."""
    if bool(args.file) != bool(args.as_):
        print("hostctl config: --file and --as go together (--as NAME or NAME.d/FILE.yaml)", file=sys.stderr)
        return EXIT_USAGE
    if args.file:
        names = [args.as_.partition(".d/")[0]]
        problems = host_check.check_candidate(Path(args.file), args.as_, root, backends.for_config)
        warnings: list[str] = []
    else:
        names = [args.name] if args.name else config.list_models(root)
        problems = host_check.check(root, [args.name] if args.name else None, backends.for_config)
        warnings = host_check.exposure_warnings(root, [args.name] if args.name else None)
    if args.json:
        emit_json(args, {"root": str(root), "models": names, "warnings": warnings,
                         "problems": [{"file": p.file, "line": p.line, "key": p.key, "message": p.message}
                                      for p in problems]}, ok=not problems)
        return 1 if problems else 0
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{len(problems)} problem(s) in {args.file or root}", file=sys.stderr)
        return 1
    if args.file:
        print(f"{args.file}: ok as {args.as_} in {root}")
    else:
        print(f"{root}: ok ({len(names)} model(s): {', '.join(names) or 'none'})")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    root = config.config_root(args.config_dir)
    if args.check:
        return cmd_config_check(args, root)
    if args.file or args.as_:
        print("hostctl config: --file and --as need --check", file=sys.stderr)
        return EXIT_USAGE
    if not args.name:
        print("hostctl config: give a model NAME, or --check", file=sys.stderr)
        return EXIT_USAGE
    try:
        loaded = config.load_model(args.name, root)
    except config.NoSuchModel as exc:
        print(f"hostctl: {exc.reason}", file=sys.stderr)
        return EXIT_NO_SUCH_MODEL
    except config.ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    # As on D-Bus: only root sees env: values and secret flags' values (the
    # engine's user may read the file, and so could anyone it is readable to).
    redacted = os.geteuid() != 0
    if args.json:
        emit_json(args, show.with_origins(loaded, redacted))
    else:
        sys.stdout.write(show.render(loaded, redacted))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """journalctl's own output, so its options and pager conventions hold:
    every unit of the model and upstream's stderr carry HOSTD_MODEL=NAME
    (the units' LogExtraFields=), the manager's lines about it too. Only
    lines of those units (_SYSTEMD_UNIT=, which journald sets) are shown:
    any local user can write HOSTD_MODEL=NAME into the journal. journalctl
    replaces hostctl (exec), so that stopping hostctl stops it (Cockpit's
    journal pane runs `hostctl logs --follow`)."""
    argv = journal_argv(args.name)
    if args.follow:
        argv.append("--follow")
    if args.lines:
        argv += ["--lines", args.lines]
    argv.append("--no-pager")  # hostctl never pages
    if args.json:
        argv += ["--output", "json" if args.json == "short" else "json-pretty"]
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        print("hostctl logs: journalctl is not installed", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"hostctl logs: cannot run journalctl: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED


def journal_argv(name: str) -> list[str]:
    """journalctl matching model NAME's lines: HOSTD_MODEL=NAME and one of
    its units (journalctl ANDs different fields and ORs one field's values)."""
    return ["journalctl", f"HOSTD_MODEL={name}", *(f"_SYSTEMD_UNIT={unit}" for unit in units.journal_units(name))]


# Above the manager's 90-reload.yaml (an administrator's edit wins over values
# set by `hostctl reload`), below 99-rollback.yaml (a failed reload's pin wins).
EDIT_DROPIN = "95-override.yaml"


def cmd_edit(args: argparse.Namespace) -> int:
    """Edit NAME.d/95-override.yaml (EDIT_DROPIN) in $EDITOR; save it only if the result is valid."""
    root = config.config_root(args.config_dir)
    try:  # the name rule before any path is made of NAME ("../x" must name nothing)
        config.load.existing_model_file(args.name, root)
    except config.NoSuchModel as exc:
        print(f"hostctl: {exc.reason}", file=sys.stderr)
        return 1
    target = config.dropin_dir(args.name, root) / EDIT_DROPIN
    original = target.read_text() if target.exists() else (
        f"# Drop-in for model {args.name}; applied after {args.name}.yaml.\n"
        "# Editable keys go under engine: (apply with systemctl reload model@NAME).\n"
    )
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w+", suffix=".yaml", prefix=f"{args.name}-") as scratch:
        scratch.write(original)
        scratch.flush()
        subprocess.run([*shlex.split(editor), scratch.name], check=False)
        edited = Path(scratch.name).read_bytes()
    if edited == original.encode():
        print("hostctl: no changes", file=sys.stderr)
        return 0
    # Validate the tree as it would be with the edited drop-in, touching nothing.
    try:
        config.load_model(args.name, root, overlay=(EDIT_DROPIN, edited))
    except config.ConfigError as exc:
        print(exc, file=sys.stderr)
        print(f"hostctl: not saved: {target} would be invalid", file=sys.stderr)
        return 1
    config.write_atomic(target, edited.decode())  # UTF-8: the loader checked
    print(f"saved {target}; apply with: systemctl reload {units.umbrella(args.name)}")
    return 0


def common_options() -> argparse.ArgumentParser:
    """Options accepted before or after the command, as systemctl's are.
    SUPPRESS: a subcommand's unset option never overwrites one given before it."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", nargs="?", const="pretty", choices=["short", "pretty"], default=argparse.SUPPRESS,
                        metavar="MODE", help="print JSON: short (one line) or pretty (the default)")
    common.add_argument("--no-legend", action="store_true", default=argparse.SUPPRESS,
                        help="no column headers and no footer")
    common.add_argument("--no-pager", action="store_true", default=argparse.SUPPRESS,
                        help="accepted for systemctl's sake: hostctl never pages")
    common.add_argument("--config-dir", metavar="DIR", default=argparse.SUPPRESS,
                        help="configuration root (default: $HOSTD_CONFIG_DIR or /etc/hostd)")
    return common


def build_parser() -> argparse.ArgumentParser:
    common = common_options()
    parser = argparse.ArgumentParser(prog="hostctl", description=__doc__.splitlines()[0], parents=[common],
                                     epilog="Exit codes: 0 ok, 1 failed, 2 usage, 3 not serving, 4 no such model.")
    parser.add_argument("--version", action="version", version=f"hostctl (hostd) {hostd.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], **kwargs)

    p = command("config", help="show a model's effective config with origins, or --check all")
    p.add_argument("name", nargs="?", metavar="NAME")
    p.add_argument("--check", action="store_true", help="validate; list every problem")
    p.add_argument("--file", metavar="F", help="with --check and --as: validate F as if installed there")
    p.add_argument("--as", dest="as_", metavar="TARGET",
                   help="NAME (F is NAME.yaml) or NAME.d/FILE.yaml (F is that drop-in)")
    p.set_defaults(func=cmd_config)

    p = command("logs", help="the model's journal across its units (journalctl HOSTD_MODEL=NAME _SYSTEMD_UNIT=...)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    p.add_argument("--lines", "-n", metavar="N", help="the last N lines only")
    p.set_defaults(func=cmd_logs)

    p = command("reload", help="apply KEY=VALUE limits (or the config on disk) without reloading weights")
    p.add_argument("name", metavar="NAME")
    p.add_argument("assignments", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--check", action="store_true",
                   help="validate and preflight only: print the keys that would change (old -> new) and "
                        "the strategy that would run, and change nothing; exit 0 when the reload would run "
                        "or change nothing, else as the reload's refusal (its message on stderr)")
    p.add_argument("--no-wait", action="store_true", help="print the operation path and return")
    p.add_argument("--quiet", action="store_true", help="no stage progress")
    p.add_argument("--from-unit", dest="quiet", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_reload)

    p = command("list", help="models and their states")
    p.set_defaults(func=cmd_list)
    p = command("status", help="every model's overview, or one model's detail")
    p.add_argument("name", nargs="?", metavar="NAME")
    p.set_defaults(func=cmd_status)
    p = command("is-active", help="print the model's state; exit 0 only when it serves")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing, exit code only")
    p.set_defaults(func=cmd_is_active)
    p = command("is-failed", help="print the model's state; exit 0 only when it failed")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--quiet", "-q", action="store_true", help="print nothing, exit code only")
    p.set_defaults(func=cmd_is_failed)
    p = command("show", help="the model's D-Bus properties as NAME=VALUE lines (systemctl show)")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--property", "-p", action="append", default=[], metavar="PROP",
                   help="only PROP (repeat, or PROP1,PROP2); a property the model lacks prints nothing")
    p.add_argument("--value", action="store_true", help="print the values only")
    p.set_defaults(func=cmd_show)
    p = command("operations", help="operations since the manager started")
    p.set_defaults(func=cmd_operations)
    p = command("cancel", help="cancel a reload (while its Cancellable property is true)")
    p.add_argument("id", type=int, metavar="ID")
    p.set_defaults(func=cmd_cancel)
    for verb, what in (("start", "start a model (all its units)"), ("stop", "stop a model (all its units)"),
                       ("restart", "restart a model (all its units)"),
                       ("revert", "remove the manager's drop-ins (90-reload.yaml, a rollback pin 99-rollback.yaml) "
                                  "and reload the administrator's own files")):
        p = command(verb, help=f"{what}, and wait")
        p.add_argument("name", metavar="NAME")
        p.add_argument("--no-block", action="store_true", help="ask for it and return at once (systemctl's)")
        p.set_defaults(func=cmd_unit_verb)
    p = command("log-level", help="change the log level of a model's running processes (no restart)",
                description="Set LEVEL in model NAME's running processes of ROLE (without ROLE: its gateway, "
                            "engines and weights daemon; manager: the manager, for every model) now, without "
                            "restarting them; each keeps it until it restarts, when hostd.yaml's log_level "
                            "applies again. vLLM's and SGLang's own lines keep their level (a restart changes "
                            "it). Needs root, the admin group or polkit action org.hostd1.log-level.")
    p.add_argument("name", metavar="NAME")
    p.add_argument("role", nargs="?", choices=api.LOG_ROLES, metavar="ROLE",
                   help="gateway, engine (every engine slot), weights or manager; default: all of the model's")
    p.add_argument("level", choices=typing.get_args(schema.LogLevel), metavar="LEVEL",
                   help="debug, info, warning or error")
    p.set_defaults(func=cmd_log_level)
    p = command("edit", help="edit a drop-in in $EDITOR; saved only when valid")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=cmd_edit)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    if not isinstance(sys.stdout, PrintableOnly):
        sys.stdout, sys.stderr = PrintableOnly(sys.stdout), PrintableOnly(sys.stderr)
    args = build_parser().parse_args(argv)
    for option, default in (("json", None), ("no_legend", False), ("no_pager", False), ("config_dir", None)):
        if not hasattr(args, option):
            setattr(args, option, default)
    try:
        return args.func(args)
    except DBusError as exc:  # the manager's refusals and the bus's own errors
        return dbus_error(exc)
    except BrokenPipeError:  # `hostctl ... | head`: the reader has gone; so do we, quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("hostctl: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # no system bus socket, a refused connection
        print(f"hostctl: cannot reach the system bus (is dbus running?): {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug: still one line, with what to report
        print(f"hostctl: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
