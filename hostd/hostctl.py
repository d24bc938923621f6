"""hostctl: the administrator's command line.

Commands that only read configuration (`config`) work with no daemon running;
commands that act on models talk to the manager over D-Bus (added with the
manager).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from hostd import config
from hostd.config import show


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
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
