"""Which processes load torch. Only those that map weights need it (the
builtin engine and weight daemon); the root manager, the gateway and the
vLLM/SGLang supervisors only ask the weight daemon for its status, and torch
there costs a second of start and 200 MB (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

@pytest.mark.parametrize("module", ["hostd.manager.service", "hostd.gateway.server"])
def test_processes_that_map_no_weights_do_not_import_torch(module: str):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"{module} imports {loaded.strip()}"


# Stands in for `vllm` (HOSTD_VLLM) and for SGLang's Python
# (HOSTD_SGLANG_PYTHON): answers the version probes of install_refusals(), so
# the dispatch lets the supervisor start, and exits 3 when run as upstream's
# daemon or server, so the supervisor fails at once and the process exits.
FAKE_UPSTREAM = """#!/bin/sh
case "$1" in
    --version) echo 0.32.0 ;;
    -c) echo 0.5.23 ;;
    *) exit 3 ;;
esac
"""

# `hostd ARGV...` exactly as the console script runs it (hostd.main:main), with
# one addition: at exit, the names of torch, transformers and hostd's modules
# that the process imported go to the file named by $IMPORTS_REPORT.
ENTRY = textwrap.dedent("""
    import atexit, json, os, sys
    def report():
        with open(os.environ["IMPORTS_REPORT"], "w") as out:
            json.dump(sorted(m for m in sys.modules if m in ("torch", "transformers") or m.startswith("hostd.")), out)
    atexit.register(report)
    from hostd.main import main
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("role, supervisor, failure", [
    ("engine", "hostd.engine.upstream", "cannot reach the weight cache"),
    ("weights", "hostd.weights.upstream", "exited with 3 before it was ready"),
])
def test_hostd_engine_and_weights_of_an_upstream_model_never_import_torch(backend, role, supervisor, failure,
                                                                         tmp_path: Path):
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    models = tmp_path / "etc" / "models"
    models.mkdir(parents=True)
    (models / "m.yaml").write_text(f"backend: {backend}\nmodel: {checkpoint}\n")
    fake = tmp_path / "fake-upstream"
    fake.write_text(FAKE_UPSTREAM)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    report = tmp_path / "imports.json"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "LISTEN_", "JOURNAL_STREAM"))},
        "HOSTD_VLLM": str(fake), "HOSTD_SGLANG_PYTHON": str(fake),
        "HOSTD_RUNTIME_DIR": str(tmp_path / "run"), "HOSTD_STATE_DIR": str(tmp_path / "state"),
        "IMPORTS_REPORT": str(report),
    }
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY, "--config-dir", str(tmp_path / "etc"), role, "m"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    # It got as far as its supervisor's first real step, and failed there.
    assert proc.returncode == 1 and failure in proc.stderr, proc.stderr
    loaded = json.loads(report.read_text())
    assert supervisor in loaded
    assert [m for m in loaded if m in ("torch", "transformers")] == [], f"hostd {role} ({backend}) imports them"
