"""Run by a real SGLang's Python (not hostd's): SGLang's own argument parsers.

For each command line read as JSON from stdin ({"kind": "server"|"daemon",
"argv": [...]}, argv without `python -m MODULE`), answers whether SGLang's
parser accepts it, as `python -m sglang.launch_server` and
`python -m sglang.srt.weight_cache.daemon` parse theirs: the daemon's own
flags first (parse_known_args), then ServerArgs.add_cli_args' parser for the
rest. ServerArgs' post-init checks need a GPU and are not run. `--dump`
prints every flag of both parsers (and what value each takes:
parser_dump.py) for tests/upstream/flags/.

Only hostd's tests run this; it imports SGLang, so it never runs in hostd.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import json
import sys


def build():
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.weight_cache.daemon import WeightCacheDaemonArgs

    server = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(server)
    daemon = argparse.ArgumentParser(add_help=False)
    WeightCacheDaemonArgs.add_cli_args(daemon)
    return server, daemon


def check(server, daemon, kind: str, argv: list[str]) -> dict:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "daemon":
                _, argv = daemon.parse_known_args(argv)
            server.parse_args(argv)
    except SystemExit as exc:
        return {"ok": False, "code": exc.code, "error": err.getvalue().strip().splitlines()[-1:]}
    return {"ok": True}


def main() -> int:
    server, daemon = build()
    if sys.argv[1:] == ["--dump"]:
        from parser_dump import flags_of

        server_flags = flags_of(server)
        daemon_flags = {**server_flags, **flags_of(daemon)}
        json.dump({"upstream": "sglang", "version": importlib.metadata.version("sglang"),
                   "flags": {"launch_server": server_flags, "weight_cache.daemon": dict(sorted(daemon_flags.items()))},
                   # SGLang's parser checks --quantization against these choices itself.
                   "quantization_methods": server_flags["--quantization"]["choices"]},
                  sys.stdout, indent=1, sort_keys=True)
        return 0
    requests = json.load(sys.stdin)
    json.dump([check(server, daemon, r["kind"], r["argv"]) for r in requests], sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
