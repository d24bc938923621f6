"""hostd: entry point of hostd's daemons; each daemon is a subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import hostd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hostd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hostd {hostd.__version__}")
    parser.add_argument(
        "--config-dir",
        metavar="DIR",
        help="configuration root (default: $HOSTD_CONFIG_DIR or /etc/hostd)",
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
