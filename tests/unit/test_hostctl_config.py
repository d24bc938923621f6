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
    data = json.loads(result.stdout)["data"]
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


def test_config_of_a_missing_model_exits_4_as_systemctl_does_for_no_such_unit(tmp_path: Path):
    make_tree(tmp_path)
    result = hostctl("--config-dir", str(tmp_path), "config", "nosuch")
    assert result.returncode == 4
    assert result.stderr == f"hostctl: no such model 'nosuch': {tmp_path}/models/nosuch.yaml does not exist\n"
    result = hostctl("--config-dir", str(tmp_path), "config", "../models/tiny")
    assert result.returncode == 4 and "is not allowed: use letters" in result.stderr


def test_version_json_modes_and_one_line_errors_without_a_bus(tmp_path: Path, monkeypatch):
    make_tree(tmp_path)
    assert hostctl("--version").stdout.startswith("hostctl (hostd) ")
    short = hostctl("--config-dir", str(tmp_path), "--json=short", "config", "tiny").stdout
    pretty = hostctl("--config-dir", str(tmp_path), "config", "tiny", "--json=pretty").stdout
    assert short.count("\n") == 1 and json.loads(short) == json.loads(pretty) and pretty.count("\n") > 5
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    for command in (["list"], ["status"], ["status", "tiny", "--no-pager"], ["reload", "tiny", "max_num_seqs=2"]):
        result = hostctl(*command)
        assert result.returncode == 1, command
        assert result.stderr.startswith("hostctl: cannot reach the system bus") and result.stderr.count("\n") == 1


def test_a_closed_pipe_is_no_traceback(tmp_path: Path):
    make_tree(tmp_path)
    result = subprocess.run(f"{sys.executable} -m hostd.hostctl --config-dir {tmp_path} config tiny --json | head -1",
                            shell=True, capture_output=True, text=True)
    assert result.stdout == "{\n" and result.stderr == ""


def test_edit_saves_a_valid_dropin_and_refuses_an_invalid_one(tmp_path: Path, monkeypatch):
    make_tree(tmp_path)
    target = tmp_path / "models/tiny.d/95-override.yaml"

    def edit_with(text: str) -> subprocess.CompletedProcess:
        return edit_writing(tmp_path, text.encode())

    bad = edit_with("engine:\n  max_num_seqs: 0\n")
    assert bad.returncode == 1 and not target.exists()
    assert f"{target}:2: engine.max_num_seqs: expected `int` >= 1" in bad.stderr

    good = edit_with("engine:\n  max_num_seqs: 6\n")
    assert good.returncode == 0, good.stderr
    assert target.read_text() == "engine:\n  max_num_seqs: 6\n"
    assert "systemctl reload model@tiny" in good.stdout


def edit_writing(tmp_path: Path, content: bytes) -> subprocess.CompletedProcess:
    """`hostctl edit tiny` with an editor that leaves CONTENT in the file."""
    (tmp_path / "content").write_bytes(content)
    script = tmp_path / "editor.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'content'} > \"$1\"\n")
    script.chmod(0o755)
    return subprocess.run(
        [sys.executable, "-m", "hostd.hostctl", "--config-dir", str(tmp_path), "edit", "tiny"],
        capture_output=True, text=True, env={**os.environ, "EDITOR": str(script)},
    )


def test_edit_refuses_what_the_loader_would_refuse_on_disk_size_and_encoding(tmp_path: Path):
    """The edited drop-in meets the rules of a file on disk (load_model's
    overlay): a valid YAML text over the loader's size cap, or not UTF-8, would
    leave the model's config unloadable once saved, so it is not saved."""
    make_tree(tmp_path)
    target = tmp_path / "models/tiny.d/95-override.yaml"
    from hostd.config.load import MAX_FILE_BYTES

    big = edit_writing(tmp_path, b"engine: {max_num_seqs: 6}\n" + b"#" * MAX_FILE_BYTES + b"\n")
    assert big.returncode == 1 and not target.exists(), big.stderr
    assert f"{target}: larger than {MAX_FILE_BYTES} bytes" in big.stderr
    latin1 = edit_writing(tmp_path, "# café\nengine: {max_num_seqs: 6}\n".encode("latin-1"))
    assert latin1.returncode == 1 and not target.exists(), latin1.stderr
    assert f"{target}: not UTF-8 text" in latin1.stderr and "Traceback" not in latin1.stderr
    assert config_check_ok(tmp_path)


def test_edit_reports_its_own_problem_beside_an_unreadable_dropin(tmp_path: Path):
    make_tree(tmp_path)
    broken = tmp_path / "models/tiny.d/60-broken.yaml"
    broken.write_text("engine: [\n")
    result = edit_writing(tmp_path, b"engine:\n  max_num_seqs: 0\n")
    target = tmp_path / "models/tiny.d/95-override.yaml"
    assert result.returncode == 1 and not target.exists()
    assert f"{broken}:2: malformed YAML" in result.stderr
    assert f"{target}:2: engine.max_num_seqs: expected `int` >= 1" in result.stderr


def config_check_ok(root: Path) -> bool:
    return hostctl("--config-dir", str(root), "config", "--check").returncode == 0


def test_check_reports_a_bad_dropin_value_at_its_own_line_even_when_a_later_dropin_shadows_it(tmp_path: Path):
    make_tree(tmp_path)
    bad = tmp_path / "models/tiny.d/70-badtype.yaml"
    bad.write_text("# an administrator's drop-in\nengine:\n  max_num_seqs: lots\n")
    (tmp_path / "models/tiny.d/90-reload.yaml").write_text("engine:\n  max_num_seqs: 8\n")
    result = hostctl("--config-dir", str(tmp_path), "config", "--check")
    assert result.returncode == 1
    assert f"{bad}:3: engine.max_num_seqs: expected `int`, got `str`" in result.stderr.splitlines()


def test_a_problem_in_a_new_subtree_points_at_the_key_not_its_parent(tmp_path: Path):
    (tmp_path / "models").mkdir()
    model = tmp_path / "models/tiny.yaml"
    model.write_text("backend: builtin\nmodel: /m\nengine:\n  max_model_len: 8\n  max_num_seqs: lots\n")
    result = hostctl("--config-dir", str(tmp_path), "config", "--check")
    assert f"{model}:5: engine.max_num_seqs: expected `int`, got `str`" in result.stderr.splitlines()
