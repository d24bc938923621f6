"""Which processes load torch. Only those that map weights need it (the
builtin engine and weight daemon); the root manager and the vLLM/SGLang
engine supervisors only ask the weight daemon for its status, and torch
there costs a second of start and 200 MB (docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["hostd.manager.service", "hostd.engine.upstream", "hostd.gateway.server"])
def test_processes_that_map_no_weights_do_not_import_torch(module: str):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"{module} imports {loaded.strip()}"
