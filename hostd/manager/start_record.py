"""The config on disk when a model's units start, recorded for the manager.

One job: model-weights@NAME.service runs `python -m hostd.manager.start_record
NAME` as root (ExecStartPre=+) before the weight daemon starts. The model's
units read the disk at this start, so a fixed key changed on disk before it
runs from then on, and one changed after it does not: a reload is held to
the newer of this record and its own last commit (records.running,
reload.check_fixed_unchanged), and RunningConfig shows the same. A config
that does not load writes nothing (the units fail on it themselves), and
nothing here ever fails the start.

Trusts: the model's config files, read by the loader as root reads them;
writes only the manager's own records (records.py).
"""

from __future__ import annotations

import sys
from typing import Optional

from hostd import config as hostd_config
from hostd.manager.records import Records


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hostd.manager.start_record NAME", file=sys.stderr)
        return 2
    name = args[0]
    try:
        cfg = hostd_config.load_model(name).config
        Records().write_started(name, cfg)
    except (hostd_config.ConfigError, hostd_config.NoSuchModel, OSError) as exc:
        print(f"hostd: model {name}: no start record written: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
