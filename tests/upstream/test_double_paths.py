"""The paths the test doubles (tests/doubles/) create are the ones upstream's
own code derives: vLLM 0.32's get_socket_path/get_socket_dir and SGLang
0.5.23's get_socket_path/get_ready_path, called in the upstream
environments (they need no GPU: the UUID is given). What the doubles do that
upstream's code cannot show here is listed in tests/doubles/README.md."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"
UUIDS = ["GPU-12345678-1234-1234-1234-123456789abc", "MIG-87654321-4321-4321-4321-cba987654321"]


def upstream(python: Path, code: str, env: dict | None = None) -> dict:
    result = subprocess.run([str(python), "-c", code, json.dumps(UUIDS)], capture_output=True, text=True,
                            timeout=600, cwd="/", env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR", **(env or {})})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_vllm_double_names_its_sockets_and_directory_as_vllm_does(vllm_env, tmp_path):
    code = (
        "import json, sys\n"
        "from vllm.model_executor.model_loader.weight_cache import protocol as p\n"
        "uuids = json.loads(sys.argv[1])\n"
        f"print(json.dumps({{'paths': [p.get_socket_path(u, {str(tmp_path)!r}) for u in uuids],"
        " 'default_dir': p.get_socket_dir(None)}))\n"
    )
    real = upstream(vllm_env / "bin" / "python", code)
    loader = importlib.machinery.SourceFileLoader("vllm_double", str(DOUBLES / "vllm"))
    spec = importlib.util.spec_from_loader("vllm_double", loader)
    double = importlib.util.module_from_spec(spec)
    loader.exec_module(double)
    assert real["paths"] == [str(tmp_path / double.socket_name(u)) for u in UUIDS]
    assert real["default_dir"] == f"/tmp/vllm_weight_cache_{os.getuid()}"  # the double's default


def test_the_sglang_double_derives_socket_and_ready_paths_as_sglang_does(sglang_env, tmp_path):
    templates = {"SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE": f"{tmp_path}/{{device_uuid}}.sock",
                 "SGLANG_WEIGHT_CACHE_READY_TEMPLATE": f"{tmp_path}/{{device_uuid}}.ready"}
    code = (
        "import json, sys\n"
        "from sglang.srt.weight_cache import protocol as p\n"
        "uuids = json.loads(sys.argv[1])\n"
        "print(json.dumps([[p.get_socket_path(u), p.get_ready_path(u)] for u in uuids]))\n"
    )
    for env in ({}, templates):
        real = upstream(sglang_env / "bin" / "python", code, env)
        saved = {k: os.environ.get(k) for k in templates}
        os.environ.update(env)
        sys.path.insert(0, str(DOUBLES / "sglang_double"))
        try:
            from sglang import _common
            mine = [[str(p) for p in _common.paths_for(u)] for u in UUIDS]
        finally:
            sys.path.remove(str(DOUBLES / "sglang_double"))
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        assert real == mine, env
