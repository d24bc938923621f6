#!/usr/bin/env python3
"""Does this interpreter satisfy hostd's own requirement specifiers?

    python3 packaging/check-requirements.py [--extra builtin] [--extra test]

Reads pyproject.toml beside this file (the dependencies, and with --extra
the packages of that extra that EXTRA_NEEDED names) and walks what they
require in turn, as installed here. Prints one line per problem (name,
version found, version needed, who needs it) and exits 1; prints one line
and exits 0 when all hold. packaging/run-gpu-tier.sh runs it on the GPU
machine before it boots anything: the image's own packages (transformers
5.17 there) must not reach the engine as a TypeError nine tests later.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# Of the test extra, what the GPU tiers run (the rest serve the CPU tiers).
# The builtin extra (torch, transformers) runs the builtin engine the GPU tiers test.
EXTRA_NEEDED = {"builtin": {"torch", "transformers"}, "test": {"pytest", "openai", "httpx"}}


def problems(requirements: list[tuple[Requirement, str]]) -> list[str]:
    found: list[str] = []
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        req, needed_by = todo.pop(0)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = f"{req.name.lower()}{req.specifier}"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(req.name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{req.name}: not installed, {needed_by} needs {req.name}{req.specifier or ''}")
            continue
        try:
            ok = req.specifier.contains(Version(dist.version), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            found.append(f"{req.name}: {dist.version} installed, {needed_by} needs {req.name}{req.specifier}")
            continue
        for line in dist.requires or []:
            todo.append((Requirement(line), f"{dist.metadata['Name']} {dist.version}"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extra", action="append", default=[], choices=sorted(EXTRA_NEEDED))
    args = parser.parse_args()
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    wanted = [(Requirement(r), "hostd") for r in project["dependencies"]]
    for extra in args.extra:
        for line in project["optional-dependencies"][extra]:
            req = Requirement(line)
            if req.name in EXTRA_NEEDED[extra]:
                wanted.append((req, f"hostd's {extra} extra"))
    found = problems(wanted)
    for line in found:
        print(f"check-requirements: {line}", file=sys.stderr)
    if found:
        print(f"check-requirements: {len(found)} requirement(s) of {PYPROJECT} not met by {sys.executable}; "
              "packaging/fetch-gpu-tier.sh carries the missing wheels", file=sys.stderr)
        return 1
    print(f"check-requirements: {sys.executable} satisfies {len(wanted)} requirements of hostd and theirs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
