"""Which processes load torch. Only those that map weights need it (the
builtin engine and weight daemon); the root manager, the gateway and the
vLLM/SGLang supervisors only ask the weight daemon for its status, and torch
there costs a second of start and 200 MB (docs/benchmarks.md). Where torch
and transformers are not installed at all (hostd without its `builtin`
extra), all of those run and a builtin model is refused naming the fix."""

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


# Run first in a subprocess: torch and transformers cannot be imported (as on
# a host where hostd was installed without its `builtin` extra), whatever is
# installed here. find_spec raising is what importlib does for a blocked name.
WITHOUT_TORCH = textwrap.dedent("""
    import sys
    class WithoutTorch:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in ("torch", "transformers"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, WithoutTorch())
""")


def run_without_torch(code: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_SOCKET", "LISTEN_", "JOURNAL_STREAM"))}
    env.update(HOSTD_RUNTIME_DIR=str(tmp_path / "run"), HOSTD_STATE_DIR=str(tmp_path / "state"))
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH + textwrap.dedent(code), *argv], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def models_without_torch(tmp_path: Path) -> Path:
    """A config root with a builtin model `b` and a vllm model `v` on one checkpoint."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (checkpoint / "model.safetensors").write_bytes(b"")
    models = tmp_path / "etc" / "models"
    models.mkdir(parents=True)
    (models / "b.yaml").write_text(f"backend: builtin\nmodel: {checkpoint}\nlisten: 127.0.0.1:18001\n")
    (models / "v.yaml").write_text(f"backend: vllm\nmodel: {checkpoint}\nlisten: 127.0.0.1:18002\n")
    return tmp_path / "etc"


def test_without_the_builtin_extra_every_daemon_but_the_builtin_ones_imports_and_a_builtin_model_is_refused(
        tmp_path: Path):
    """pyproject.toml's `builtin` extra (issue 38): a vLLM/SGLang host
    installs hostd without torch and transformers. The manager, gateway,
    hostctl, generator, config checks and the upstream backends import
    there; a vllm model passes `hostctl config --check`; a builtin model is
    refused by it, by the manager's reload validation and by its engine's and
    weights' start, each in one sentence naming the command that fixes it."""
    root = models_without_torch(tmp_path)
    fix = "-m pip install 'hostd[builtin]'"
    imports = run_without_torch(f"""
        import json
        import hostd.manager.service, hostd.gateway.server, hostd.hostctl, hostd.generator, hostd.dispatch
        import hostd.backends.vllm, hostd.backends.sglang
        from hostd import backends, config, host_check
        from hostd.manager.reload import model_backend_refusals
        root = {str(root)!r}
        problems = {{name: [str(p) for p in host_check.check(root, [name], backends.for_config)] for name in ("b", "v")}}
        print(json.dumps({{"check": problems,
                           "reload": {{name: model_backend_refusals(config.load_model(name, root).config)
                                      for name in ("b", "v")}},
                           "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}}))
    """, tmp_path)
    assert imports.returncode == 0, imports.stderr
    found = json.loads(imports.stdout)
    assert found["loaded"] == []
    assert found["check"]["v"] == [] and found["reload"]["v"] == []
    for refused in (found["check"]["b"], found["reload"]["b"]):
        [sentence] = refused
        assert "torch and transformers" in sentence and fix in sentence and "lacks torch and transformers" in sentence

    hostctl = run_without_torch("from hostd.hostctl import main; sys.exit(main(sys.argv[1:]))", tmp_path,
                                "--config-dir", str(root), "config", "--check")
    assert hostctl.returncode != 0 and fix in hostctl.stdout + hostctl.stderr, hostctl.stdout + hostctl.stderr
    assert "v.yaml" not in hostctl.stdout + hostctl.stderr
    for role in ("engine", "weights"):
        start = run_without_torch("from hostd.main import main; sys.exit(main(sys.argv[1:]))", tmp_path,
                                  "--config-dir", str(root), role, "b")
        assert start.returncode == 1 and "cannot serve b: backend: builtin needs" in start.stderr, start.stderr
        assert fix in start.stderr and "Traceback" not in start.stderr, start.stderr
    checkpoint = run_without_torch("from hostd.main import main; sys.exit(main(sys.argv[1:]))", tmp_path,
                                   "make-checkpoint", str(tmp_path / "random"))
    assert checkpoint.returncode == 1 and "hostd make-checkpoint needs torch" in checkpoint.stderr, checkpoint.stderr
    assert fix in checkpoint.stderr and not (tmp_path / "random").exists()


def test_an_upstream_models_weights_unit_fingerprints_its_checkpoint_without_torch(tmp_path: Path):
    """The vllm/sglang weights unit hashes the checkpoint for its status
    before it is ready (both with and without the weight cache) where hostd
    has no torch: the fingerprint's torch and transformers versions are not
    hostd's to know (upstream's torch is in upstream's environment), so they
    are empty. Without the extra, it once raised ModuleNotFoundError there and
    no vLLM model could start (tests/system/test_real_vllm.py found it)."""
    root = models_without_torch(tmp_path)
    (tmp_path / "state").mkdir()
    found = run_without_torch(f"""
        import json, msgspec
        from pathlib import Path
        from hostd import backends, config
        from hostd.weights.upstream import Supervisor
        cfg = config.load_model("v", {str(root)!r}).config
        fp = Supervisor("v", cfg, backends.for_config(cfg), Path({str(tmp_path / "state")!r})).compute_fingerprint()
        print(json.dumps({{"fingerprint": msgspec.to_builtins(fp),
                           "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}}))
    """, tmp_path)
    assert found.returncode == 0, found.stderr
    result = json.loads(found.stdout)
    assert result["loaded"] == []
    fp = result["fingerprint"]
    assert len(fp["content_digest"]) == 64 and fp["architecture"] == "Qwen2ForCausalLM", fp
    assert (fp["backend"], fp["torch_version"], fp["transformers_version"]) == ("vllm", "", ""), fp


# What an engine does before it serves, in the order it does it
# (hostd/engine/main.py): its imports, the skeleton (which imports the model's
# transformers module), the tokenizer, the server. Prints the BLOCKED names
# that ended up imported, and whether the policy marked every one absent.
ENGINE_START = textwrap.dedent("""
    import sys
    from pathlib import Path
    import hostd.engine.main
    from hostd.weights import checkpoint, lean
    checkpoint.build_skeleton(Path(sys.argv[1]), "bfloat16", meta_buffers=True)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(sys.argv[1])
    import hostd.engine.server
    print(sorted(n for n in lean.BLOCKED if sys.modules.get(n) is not None),
          sorted(n for n in lean.BLOCKED if n in sys.modules and sys.modules[n] is None) == sorted(lean.BLOCKED))
""")


def test_the_builtin_engines_start_imports_none_of_the_blocked_packages_even_where_installed(tmp_path: Path):
    """hostd/weights/lean.py: on a host where every BLOCKED package is
    installed (a stand-in of each, with its dist-info, that raises if it is
    ever imported), the engine's start builds the model and loads the
    tokenizer without importing any of them; with HOSTD_LEAN_IMPORTS=0
    transformers imports the stand-in Pillow (chat_template_utils), which
    shows the stand-ins are where transformers looks."""
    from hostd.checkpoints.random_model import write_checkpoint
    from hostd.weights import lean

    site = tmp_path / "site"
    for name in lean.BLOCKED:
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"raise RuntimeError('the engine imported {name}')\n")
        info = site / f"{name}-99.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 99.0\n")
    (site / "pillow-99.0.dist-info").mkdir()
    (site / "pillow-99.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: pillow\nVersion: 99.0\n")
    model = write_checkpoint(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}

    lean_start = subprocess.run([sys.executable, "-c", ENGINE_START, str(model)], env=env,
                                capture_output=True, text=True)
    assert lean_start.returncode == 0, lean_start.stderr[-3000:]
    assert lean_start.stdout.strip() == "[] True"  # none imported, every one marked absent

    full_start = subprocess.run([sys.executable, "-c", ENGINE_START, str(model)],
                                env={**env, "HOSTD_LEAN_IMPORTS": "0"}, capture_output=True, text=True)
    assert full_start.returncode != 0 and "the engine imported PIL" in full_start.stderr, full_start.stderr[-3000:]
