"""A model starts only on an account and directories that are its own (issue
22 item 6): model@NAME.socket's first command (as root, before
systemd-sysusers would keep an existing account and systemd would chown the
model's directories to its user) refuses a user or group hostd did not make
for the model and a state or cache directory of another account, naming the
account or the path and its owner. hostctl config --check says the same."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path

import pytest

from hostd import accounts, config, generator, host_check

NOBODY = 65534  # an account that exists on every Debian host: another account


@pytest.fixture
def roots(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("HOSTD_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HOSTD_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def start(name: str, capsys) -> tuple[int, str]:
    """What model@NAME.socket's check does: its exit status and what it says."""
    code = accounts.main([name])
    return code, capsys.readouterr().err


def squatted(monkeypatch, comment: str = "someone else's service") -> None:
    """hostd-tiny exists, made by someone else."""
    account = pwd.struct_passwd(("hostd-tiny", "x", 4242, 4242, comment, "/home/else", "/bin/sh"))
    real_getpwnam = pwd.getpwnam
    monkeypatch.setattr(pwd, "getpwnam", lambda name: account if name == "hostd-tiny" else real_getpwnam(name))


def test_a_user_hostd_did_not_make_for_the_model_stops_its_socket(roots, monkeypatch, capsys):
    squatted(monkeypatch)
    code, said = start("tiny", capsys)
    assert code == 1
    assert "model tiny is not started" in said and "hostd-tiny" in said and "someone else's service" in said


def test_a_group_of_the_models_user_name_alone_stops_its_socket(roots, monkeypatch, capsys):
    group = grp.struct_group(("hostd-tiny", "x", 4343, ["alice"]))
    real_getgrnam = grp.getgrnam
    monkeypatch.setattr(grp, "getgrnam", lambda name: group if name == "hostd-tiny" else real_getgrnam(name))
    code, said = start("tiny", capsys)
    assert code == 1 and "the group hostd-tiny exists" in said


@pytest.mark.parametrize("kind", ["state", "cache"])
def test_a_model_directory_of_another_account_stops_the_socket_naming_path_and_owner(roots, capsys, kind):
    directory = roots / kind / "tiny"
    directory.mkdir(parents=True)
    os.chown(directory, NOBODY, NOBODY)
    code, said = start("tiny", capsys)
    assert code == 1
    assert f"{directory} is owned by nobody (uid {NOBODY})" in said and "hostd-tiny" in said
    assert os.stat(directory).st_uid == NOBODY  # left as it was


def test_directories_of_root_the_model_or_no_account_are_the_models(roots, monkeypatch, capsys):
    ours = pwd.struct_passwd(("hostd-tiny", "x", 4242, 4242, "hostd model tiny", "/var/lib/hostd/tiny", "/bin/false"))
    real_getpwnam = pwd.getpwnam
    monkeypatch.setattr(pwd, "getpwnam", lambda name: ours if name == "hostd-tiny" else real_getpwnam(name))
    for kind, uid in (("state", 4242), ("cache", 0)):
        (roots / kind / "tiny").mkdir(parents=True)
        os.chown(roots / kind / "tiny", uid, uid)
    assert start("tiny", capsys) == (0, "")
    os.chown(roots / "state" / "tiny", 4999999, 4999999)  # a removed account's leftovers: no one else's
    assert start("tiny", capsys) == (0, "")


def test_the_socket_checks_before_systemd_sysusers_runs(monkeypatch):
    lines = [line for line in generator.socket_text("tiny", "127.0.0.1:8000").splitlines()
             if line.startswith("ExecStartPre=")]
    assert lines[0] == "ExecStartPre="  # the template's placeholder goes
    assert lines[1].startswith("ExecStartPre=+") and lines[1].endswith(" -m hostd.accounts %i")
    assert "systemd-sysusers" in lines[2]


def test_config_check_names_a_foreign_owned_state_directory_too(roots, tmp_path):
    root = tmp_path / "etc"
    (root / "models").mkdir(parents=True)
    (tmp_path / "ckpt").mkdir()
    (root / "models" / "tiny.yaml").write_text(f"backend: builtin\nmodel: {tmp_path / 'ckpt'}\ndevice: cpu\n")
    (roots / "state" / "tiny").mkdir(parents=True)
    os.chown(roots / "state" / "tiny", NOBODY, NOBODY)
    found = "\n".join(str(p) for p in host_check.check(root))
    assert str(root / "models" / "tiny.yaml") in found and f"is owned by nobody (uid {NOBODY})" in found
