"""Write tests/upstream/flags/{vllm,sglang}-VERSION.json from the real parsers.

    .venv/bin/python tests/upstream/generate_flags.py

Runs vllm_parser.py --dump and sglang_parser.py --dump in the environments
packaging/setup-upstream.sh installs. The test doubles (tests/doubles/) build
their parsers from these files, so a double accepts exactly the flags the
upstream version it imitates accepts; test_contract.py checks that the files
still equal what the installed parsers say.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from upstream_envs import SGLANG_ENV, VLLM_ENV  # noqa: E402


def dump(python: Path, script: str) -> dict:
    out = subprocess.run([str(python), str(HERE / script), "--dump"], capture_output=True, text=True,
                         check=True, cwd="/").stdout
    return json.loads(out)


def main() -> int:
    for env, script, name in ((VLLM_ENV, "vllm_parser.py", "vllm"), (SGLANG_ENV, "sglang_parser.py", "sglang")):
        flags = dump(env / "bin" / "python", script)
        version = flags["version"].split("+")[0]
        path = HERE / "flags" / f"{name}-{version}.json"
        path.write_text(json.dumps(flags, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
