"""What configuration management calls before it writes a file (issue 27):
`hostctl config --check --file F --as TARGET` validates a candidate in place
of NAME.yaml or a drop-in without installing it, `--check --json` answers a
script, the checks across models (one listen address, one GPU's memory), and
global options after the verb. Real files in a temporary /etc/hostd."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hostd import hostctl as hostctl_module

from tests.unit.test_hostctl_config import hostctl, make_tree


def tree_state(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_good_candidate_dropin_passes_merged_with_the_files_it_lands_among(tmp_path: Path):
    root, candidate = tmp_path / "etc", tmp_path / "candidate.yaml"
    make_tree(root)
    candidate.write_text("engine:\n  max_model_len: 512\n")
    before = tree_state(root)
    result = hostctl("config", "--check", "--file", str(candidate), "--as", "tiny.d/60-len.yaml",
                     "--config-dir", str(root))  # global options after the verb, as systemctl's
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{candidate}: ok as tiny.d/60-len.yaml in {root}"
    assert tree_state(root) == before  # nothing installed, nothing left


def test_a_bad_candidate_is_refused_naming_the_candidate_its_line_and_key(tmp_path: Path):
    root, candidate = tmp_path / "etc", tmp_path / "candidate.yaml"
    make_tree(root)
    candidate.write_text("backend: builtin\nmodel: /srv/tiny\nengine:\n  max_model_len: lots\n")
    before = tree_state(root)
    result = hostctl("--config-dir", str(root), "config", "--check", "--file", str(candidate), "--as", "tiny")
    assert result.returncode == 1
    assert f"{candidate}:4: engine.max_model_len: expected `int | null`" in result.stderr, result.stderr
    assert tree_state(root) == before
    # as a drop-in: its own line, merged with the model's YAML on disk
    candidate.write_text("engine:\n  max_num_seqs: lots\n")
    dropin = hostctl("--config-dir", str(root), "config", "--check", "--json=short",
                     "--file", str(candidate), "--as", "tiny.d/70-x.yaml")
    document = json.loads(dropin.stdout)
    data = document["data"]
    assert dropin.returncode == 1 and document["ok"] is False and data["models"] == ["tiny"]
    assert [(p["file"], p["line"], p["key"]) for p in data["problems"]] == [
        (str(candidate), 2, "engine.max_num_seqs")]


@pytest.mark.parametrize("target, words", [
    ("ghost.d/50-x.yaml", "model 'ghost' has no"),
    ("tiny.d/x.txt", "--as:"),
    ("../etc", "--as:"),
])
def test_a_candidate_target_that_cannot_be_is_refused(tmp_path: Path, target, words):
    root, candidate = tmp_path / "etc", tmp_path / "candidate.yaml"
    make_tree(root)
    candidate.write_text("engine:\n  max_num_seqs: 2\n")
    result = hostctl("--config-dir", str(root), "config", "--check", "--file", str(candidate), "--as", target)
    assert result.returncode == 1 and words in result.stderr, result.stderr


def test_file_without_as_is_a_usage_error(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("--config-dir", str(tmp_path), "config", "--check", "--file", "x.yaml")
    assert result.returncode == 2 and "--file and --as go together" in result.stderr


def test_check_json_on_a_good_tree(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("config", "--check", "--json=short", "--config-dir", str(tmp_path))
    assert result.returncode == 0
    assert json.loads(result.stdout) == {"version": 1, "command": "config", "ok": True, "data": {
        "root": str(tmp_path), "models": ["tiny"], "warnings": [], "problems": []}}


def test_two_models_on_one_listen_address_are_refused_naming_both(tmp_path: Path):
    make_tree(tmp_path)
    (tmp_path / "models/other.yaml").write_text("backend: builtin\nmodel: /srv/other\n")  # the default listen too
    result = hostctl("--config-dir", str(tmp_path), "config", "--check")
    assert result.returncode == 1
    assert "models/tiny.yaml: listen: '127.0.0.1:8000' is also model 'other'" in result.stderr, result.stderr
    (tmp_path / "models/other.yaml").write_text("backend: builtin\nmodel: /srv/other\nlisten: 127.0.0.1:8001\n")
    assert hostctl("--config-dir", str(tmp_path), "config", "--check").returncode == 0


def test_a_gpu_promised_more_than_it_holds_is_refused(tmp_path: Path):
    (tmp_path / "models").mkdir()
    for name, port, fraction in (("a", 8001, 0.6), ("b", 8002, 0.5)):
        (tmp_path / f"models/{name}.yaml").write_text(
            f"backend: vllm\nmodel: /srv/{name}\nlisten: 127.0.0.1:{port}\ngpus: [0]\n"
            f"engine:\n  gpu_memory_utilization: {fraction}\n")
    result = hostctl("--config-dir", str(tmp_path), "config", "--check", "--json")
    problems = json.loads(result.stdout)["data"]["problems"]
    assert result.returncode == 1
    assert [p["key"] for p in problems] == ["gpus"], problems
    assert "GPU 0 is promised 1.10 of its memory (a gpu_memory_utilization=0.6, b gpu_memory_utilization=0.5)" \
        in problems[0]["message"]


def test_logs_shows_only_lines_the_models_units_or_the_manager_wrote(monkeypatch):
    """HOSTD_MODEL= is a field any local user can write (`logger --journald`):
    hostctl logs also matches _SYSTEMD_UNIT=, which journald sets, to the
    model's units and the manager's, and nothing of another model's."""
    ran = []

    def execvp(file, argv):  # journalctl replaces hostctl
        ran.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(hostctl_module.os, "execvp", execvp)
    monkeypatch.setattr(hostctl_module.subprocess, "call", lambda argv: ran.append(argv) or 0)
    with pytest.raises(SystemExit):
        hostctl_module.main(["logs", "tiny", "-f", "-n", "50"])
    assert ran == [["journalctl", "HOSTD_MODEL=tiny",
                    "_SYSTEMD_UNIT=model@tiny.service", "_SYSTEMD_UNIT=model@tiny.socket",
                    "_SYSTEMD_UNIT=model-engine@tiny.service", "_SYSTEMD_UNIT=model-engine-next@tiny.service",
                    "_SYSTEMD_UNIT=model-engine-standby@tiny.service", "_SYSTEMD_UNIT=model-engine-swap@tiny.service",
                    "_SYSTEMD_UNIT=model-engine-spare@tiny.service",
                    "_SYSTEMD_UNIT=model-weights@tiny.service", "_SYSTEMD_UNIT=model-weights@tiny.socket",
                    "_SYSTEMD_UNIT=model-weights-next@tiny.service", "_SYSTEMD_UNIT=model-weights-next@tiny.socket",
                    "_SYSTEMD_UNIT=hostd.service",
                    "--follow", "--lines", "50", "--no-pager"]]


def test_a_kv_budget_that_cannot_hold_one_request_is_refused_naming_the_key_line_and_numbers(tmp_path: Path):
    """The engine's start-time KV rule, at config time (issue 31): kv_cache_mib
    128 and no max_model_len on a checkpoint of 32768 positions (tests/gpu's
    shape of 58e553e), on cuda, where the H200 refused it only at start."""
    from hostd.checkpoints import random_model
    from tests.gpu.cuda_configs import GPU_SHAPE
    from tests.unit.test_gpu_configs import config_json

    checkpoint = config_json(tmp_path / "ckpt", GPU_SHAPE)
    assert GPU_SHAPE["max_position_embeddings"] == random_model.SIZES["0.5b"]["max_position_embeddings"] == 32768
    root = tmp_path / "etc"
    (root / "models").mkdir(parents=True)
    model = root / "models" / "gpu.yaml"
    model.write_text(f"backend: builtin\nmodel: {checkpoint}\ndevice: cuda\nengine:\n  kv_cache_mib: 128\n")
    result = hostctl("config", "--check", "--config-dir", str(root))
    assert result.returncode == 1
    assert (f"{model}:5: engine.kv_cache_mib: the KV budget of 134217728 bytes holds 5376 tokens (24576 bytes "
            "each), fewer than one request of max_model_len=32768; raise engine.kv_cache_mib to at least 768 "
            "or lower engine.max_model_len") in result.stderr, result.stderr
    model.write_text(model.read_text() + "  max_model_len: 4096\n")
    assert hostctl("config", "--check", "--config-dir", str(root)).returncode == 0
