"""`hostctl config` works with no daemon: origins, and --check's exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def hostctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hostd.hostctl", *args], capture_output=True, text=True
    )


def make_tree(root: Path) -> None:
    (root / "models/tiny.d").mkdir(parents=True)
    (root / "models/tiny.yaml").write_text("backend: builtin\nmodel: /srv/tiny\n")
    (root / "models/tiny.d/50-limits.yaml").write_text("engine:\n  max_num_seqs: 3\n")


def test_config_prints_each_value_with_the_file_it_came_from(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("--config-dir", str(tmp_path), "config", "tiny")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    [seqs] = [l for l in lines if l.strip().startswith("max_num_seqs:")]
    [model] = [l for l in lines if l.startswith("model:")]
    [retry] = [l for l in lines if l.strip().startswith("retry_after:")]
    assert seqs.split("#")[1].strip() == str(tmp_path / "models/tiny.d/50-limits.yaml")
    assert model.split("#")[1].strip() == str(tmp_path / "models/tiny.yaml")
    assert retry.split("#")[1].strip() == "(default)"


def test_config_json_and_environment_override(tmp_path: Path, monkeypatch):
    make_tree(tmp_path)
    monkeypatch.setenv("HOSTD_CONFIG_DIR", str(tmp_path))
    result = hostctl("config", "tiny", "--json")
    data = json.loads(result.stdout)
    assert data["engine.max_num_seqs"] == {
        "value": 3, "origin": str(tmp_path / "models/tiny.d/50-limits.yaml")}


def test_check_passes_on_a_good_tree(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("--config-dir", str(tmp_path), "config", "--check")
    assert result.returncode == 0, result.stderr
    assert "ok (1 model(s): tiny)" in result.stdout


def test_check_lists_every_problem_and_fails(tmp_path: Path):
    make_tree(tmp_path)
    (tmp_path / "models/tiny.d/60-bad.yaml").write_text("engine: {max_num_seqs: 0}\nbogus: 1\n")
    (tmp_path / "models/other.yaml").write_text("backend: builtin\nmodel: [\n")
    (tmp_path / "hostd.yaml").write_text("log_level: loud\n")
    result = hostctl("--config-dir", str(tmp_path), "config", "--check")
    assert result.returncode == 1
    err = result.stderr
    assert f"{tmp_path}/models/tiny.d/60-bad.yaml:1: engine.max_num_seqs: expected `int` >= 1" in err
    assert f"{tmp_path}/models/tiny.d/60-bad.yaml:2: bogus: unknown key" in err
    assert f"{tmp_path}/models/other.yaml:" in err and "malformed YAML" in err
    assert f"{tmp_path}/hostd.yaml:1: log_level:" in err
    assert "4 problem(s)" in err
    # --check NAME looks at that model (and hostd.yaml) only
    only = hostctl("--config-dir", str(tmp_path), "config", "--check", "other")
    assert "60-bad.yaml" not in only.stderr and "other.yaml" in only.stderr


def test_config_of_a_broken_model_exits_non_zero_with_the_problem(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("--config-dir", str(tmp_path), "config", "nosuch")
    assert result.returncode == 1
    assert "no such model" in result.stderr


def test_edit_saves_a_valid_dropin_and_refuses_an_invalid_one(tmp_path: Path, monkeypatch):
    make_tree(tmp_path)
    target = tmp_path / "models/tiny.d/95-override.yaml"

    def edit_with(text: str) -> subprocess.CompletedProcess:
        script = tmp_path / "editor.sh"
        script.write_text(f"#!/bin/sh\ncat > \"$1\" <<'YAML'\n{text}YAML\n")
        script.chmod(0o755)
        return subprocess.run(
            [sys.executable, "-m", "hostd.hostctl", "--config-dir", str(tmp_path), "edit", "tiny"],
            capture_output=True, text=True, env={**os.environ, "EDITOR": str(script)},
        )

    bad = edit_with("engine:\n  max_num_seqs: 0\n")
    assert bad.returncode == 1 and not target.exists()
    assert f"{target}:2: engine.max_num_seqs: expected `int` >= 1" in bad.stderr

    good = edit_with("engine:\n  max_num_seqs: 6\n")
    assert good.returncode == 0, good.stderr
    assert target.read_text() == "engine:\n  max_num_seqs: 6\n"
    assert "systemctl reload model@tiny" in good.stdout
