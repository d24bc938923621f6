"""Run by a real vLLM's Python (not hostd's): vLLM's own `vllm` CLI parser.

Builds the parser exactly as `vllm` (vllm/entrypoints/cli/main.py) does, with
every subcommand, and for each command line read as JSON from stdin answers
whether vLLM accepts it: parse_args, then the subcommand's own validate(),
nothing started. `--dump` prints instead every flag of `preload` and `serve`
(option strings, whether and what value it takes: parser_dump.py) and the
quantization methods vLLM knows, for tests/upstream/flags/.

Only hostd's tests run this; it imports vLLM, so it never runs in hostd.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import sys


def build():
    import vllm.entrypoints.cli.preload
    import vllm.entrypoints.cli.serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    parser.add_argument("-v", "--version", action="version", version=importlib.metadata.version("vllm"))
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    commands, subs = {}, {}
    for module in (vllm.entrypoints.cli.serve, vllm.entrypoints.cli.preload):
        for cmd in module.cmd_init():
            subs[cmd.name] = cmd.subparser_init(subparsers)
            commands[cmd.name] = cmd
    return parser, commands, subs


def check(parser, commands, argv: list[str]) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
            commands[args.subparser].validate(args)
    except SystemExit as exc:
        return {"ok": False, "code": exc.code, "error": err.getvalue().strip().splitlines()[-1:]}
    except Exception as exc:  # validate() raising: upstream refuses the command line
        return {"ok": False, "code": None, "error": [f"{type(exc).__name__}: {exc}"]}
    return {"ok": True}


def quantization_methods() -> list[str]:
    """The methods vLLM's ModelConfig takes for --quantization (its parser
    takes any string and ModelConfig refuses the rest when the engine starts)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    return sorted(QUANTIZATION_METHODS)


def dump(subs) -> dict:
    from parser_dump import flags_of

    flags = {name: flags_of(sub) for name, sub in subs.items()}
    return {"upstream": "vllm", "version": importlib.metadata.version("vllm"), "flags": flags,
            "quantization_methods": quantization_methods()}


def main() -> int:
    parser, commands, subs = build()
    if sys.argv[1:] == ["--dump"]:
        json.dump(dump(subs), sys.stdout, indent=1, sort_keys=True)
        return 0
    argvs = json.load(sys.stdin)
    json.dump([check(parser, commands, argv) for argv in argvs], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
