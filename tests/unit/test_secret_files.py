"""A model whose secrets (env: values) sit in a file others can read is
refused at its start (hostd/secretfiles.py, model@NAME.socket's command after
systemd-sysusers), naming the file and the chown/chmod that fixes it, and the
manager's Model.StartProblem says the same (hostctl status shows it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hostd import generator, secretfiles

SECRET_YAML = "backend: builtin\nmodel: /m\ndevice: cpu\nenv:\n  HF_TOKEN: hf_not_a_real_token\n"


@pytest.fixture
def root(tmp_path: Path, monkeypatch) -> Path:
    etc = tmp_path / "etc"
    (etc / "models").mkdir(parents=True)
    monkeypatch.setenv("HOSTD_CONFIG_DIR", str(etc))
    return etc


def write(path: Path, text: str, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_a_world_readable_yaml_with_a_token_is_refused_at_start_naming_file_and_fix(root, capsys):
    yaml_file = write(root / "models/m.yaml", SECRET_YAML, 0o644)  # what an editor or `cat >` gives
    assert secretfiles.problems("m", root)
    assert secretfiles.main(["m"]) == 1
    err = capsys.readouterr().err
    assert f"hostd: model m is not started: {yaml_file} holds env: values" in err
    assert "readable by every user (mode 0644)" in err
    assert f"chown root:hostd-m {yaml_file} && chmod 0640 {yaml_file}" in err
    assert "hf_not_a_real_token" not in err  # the value is never printed


def test_a_dropin_holding_the_token_is_refused_too_and_a_private_file_starts(root, capsys):
    write(root / "models/m.yaml", "backend: builtin\nmodel: /m\ndevice: cpu\n", 0o644)  # no secret: fine
    dropin = write(root / "models/m.d/50-token.yaml", "env:\n  HF_TOKEN: x\n", 0o604)
    assert secretfiles.main(["m"]) == 1 and str(dropin) in capsys.readouterr().err
    os.chmod(dropin, 0o600)
    assert secretfiles.main(["m"]) == 0 and capsys.readouterr().err == ""


def test_the_socket_runs_the_check_after_sysusers_before_anything_starts():
    lines = [line for line in generator.socket_text("tiny", "127.0.0.1:8000").splitlines()
             if line.startswith("ExecStartPre=")]
    sysusers = next(i for i, line in enumerate(lines) if "systemd-sysusers" in line)
    assert lines[sysusers + 1].startswith("ExecStartPre=+") and lines[sysusers + 1].endswith(
        " -m hostd.secretfiles %i")


def test_the_manager_shows_it_as_the_models_start_problem(root, monkeypatch):
    from hostd.manager import model_bus

    write(root / "models/m.yaml", SECRET_YAML, 0o644)

    class Manager:
        pass

    manager = Manager()
    manager.root = root
    obj = model_bus.ModelInterface.__new__(model_bus.ModelInterface)
    obj.model_name, obj.manager = "m", manager
    problem = model_bus.ModelInterface.StartProblem.prop_getter(obj)
    assert "m.yaml holds env: values" in problem and "chmod 0640" in problem
    os.chmod(root / "models/m.yaml", 0o600)
    assert model_bus.ModelInterface.StartProblem.prop_getter(obj) == ""


def test_a_readable_yaml_whose_env_names_no_secret_starts(root):
    """docs/vllm.md's quickstart, typed with `cat >` (0644): env: HOSTD_VLLM (a
    path) and VLLM_NO_USAGE_STATS (a switch) are no secrets, so the model
    starts; an HF_TOKEN or an OPENAI_API_KEY beside them is refused."""
    plain = "backend: vllm\nmodel: /srv/m\nenv:\n  HOSTD_VLLM: /opt/vllm/bin/vllm\n  VLLM_NO_USAGE_STATS: '1'\n"
    write(root / "models/m.yaml", plain, 0o644)
    assert secretfiles.problems("m", root) == []
    for secret in ("HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY"):
        write(root / "models/m.yaml", plain + f"  {secret}: s3cr3t\n", 0o644)
        [problem] = secretfiles.problems("m", root)
        assert "s3cr3t" not in problem and "chmod 0640" in problem
