"""The backend seam: hostd/backends/ is the only code that knows the backends.

Each test pins what a caller outside hostd/backends/ gets from a Backend
instead of comparing the backend's name: the entry points of `hostd weights
NAME` / `hostd engine NAME`, whether the units need the GPU, the memory
fraction the preflight sizes by, and how the upstream supervisors talk to
their children.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

import msgspec
import pytest

import hostd
from hostd import backends, paths
from hostd.config import schema

HOSTD = Path(hostd.__file__).resolve().parent
# A comparison of a backend's name, as issue 16 item 3 defines it.
COMPARES_BACKEND = re.compile(r"""backend *(==|!=|in)|== *"(vllm|sglang|builtin)\"""")


def make(backend: str, **keys):
    return msgspec.convert({"backend": backend, "model": "/srv/ckpt", **keys}, schema.MODEL_TYPES[backend])


# A table keyed by backend names (GPU_FRACTION_KEYS was one): only the
# schema may have them (one config type per backend); the rest asks the backend.
BACKEND_TABLE = re.compile(r"""["'](vllm|sglang|builtin)["'] *:""")
SCHEMA = HOSTD / "config" / "schema.py"


def test_no_code_outside_the_backends_package_keeps_a_table_by_backend_name():
    found = [
        f"{path.relative_to(HOSTD.parent)}:{number}: {line.strip()}"
        for path in sorted(HOSTD.rglob("*.py"))
        if "backends" not in path.relative_to(HOSTD).parts and path != SCHEMA
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if BACKEND_TABLE.search(line)
    ]
    assert found == []


def test_no_code_outside_the_backends_package_compares_the_backend_name():
    found = [
        f"{path.relative_to(HOSTD.parent)}:{number}: {line.strip()}"
        for path in sorted(HOSTD.rglob("*.py"))
        if "backends" not in path.relative_to(HOSTD).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARES_BACKEND.search(line)
    ]
    assert found == []


@pytest.mark.parametrize("backend, weights_module, engine_module", [
    ("builtin", "hostd.weights.daemon:serve", "hostd.engine.main:serve"),
    ("vllm", "hostd.weights.upstream:run", "hostd.engine.upstream:run"),
    ("sglang", "hostd.weights.upstream:run", "hostd.engine.upstream:run"),
])
def test_each_backend_names_what_hostd_weights_and_hostd_engine_run(backend, weights_module, engine_module,
                                                                     monkeypatch):
    calls = []
    for target in (weights_module, engine_module):
        module_name, function = target.split(":")
        package_name, _, leaf = module_name.rpartition(".")
        # A stand-in module: the real ones import torch or start processes.
        fake = types.ModuleType(module_name)
        setattr(fake, function, lambda args, cfg, *given, target=target: calls.append((target, args, cfg, *given)) or 7)
        monkeypatch.setitem(sys.modules, module_name, fake)
        monkeypatch.setattr(importlib.import_module(package_name), leaf, fake, raising=False)
    cfg, args = make(backend), object()
    chosen = backends.for_config(cfg)
    assert chosen.run_weights(args, cfg) == 7 and chosen.run_engine(args, cfg) == 7
    # The upstream supervisors are handed their backend, and so is the builtin
    # engine (its standby's rebuild asks what the engine refuses); the builtin
    # weight daemon needs none.
    handed = () if backend == "builtin" else (chosen,)
    assert calls == [(weights_module, args, cfg, *handed), (engine_module, args, cfg, chosen)]


@pytest.mark.parametrize("backend, keys, gpu", [
    ("builtin", {"device": "cpu"}, False),
    ("builtin", {"device": "cuda"}, True),
    ("vllm", {}, True),
    ("sglang", {}, True),
])
def test_units_need_the_gpu_unless_the_builtin_backend_runs_on_cpu(backend, keys, gpu):
    cfg = make(backend, **keys)
    assert backends.for_config(cfg).uses_gpu(cfg) is gpu


@pytest.mark.parametrize("backend, engine, fraction", [
    ("builtin", {}, None),
    ("vllm", {}, 0.9),
    ("vllm", {"gpu_memory_utilization": 0.5}, 0.5),
    ("sglang", {}, None),
    ("sglang", {"mem_fraction_static": 0.7}, 0.7),
])
def test_memory_fraction_is_the_backends_own_field(backend, engine, fraction):
    cfg = make(backend, engine=engine)
    assert backends.for_config(cfg).memory_fraction(cfg) == fraction




def test_vllm_serves_on_a_unix_socket_and_sglang_on_a_loopback_port(monkeypatch, tmp_path):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    vllm, sglang = backends.for_config(make("vllm")), backends.for_config(make("sglang"))
    assert vllm.engine_socket("m") == paths.runtime_dir("m") / "vllm-engine.sock"
    assert sglang.engine_socket("m") is None
    assert vllm.socket_dir("m") == paths.runtime_dir("m") / paths.VLLM_SOCKET_DIR
    assert sglang.socket_dir("m") == paths.runtime_dir("m") / paths.SGLANG_SOCKET_DIR
    # SGLang's sockets appear before its ranks serve; its .ready files say when they do.
    assert sglang.writes_ready_files and not vllm.writes_ready_files
