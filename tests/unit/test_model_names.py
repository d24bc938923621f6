"""Model names cannot reach accounts or directories that are not the model's
own (issue 22, items 6 and 16): the admin group, hostd's own user, another
model's user, the shared checkpoints directory. Each refusal names the file."""

from __future__ import annotations

import grp
import pwd
from pathlib import Path

import pytest

from hostd import config, host_check, units
from hostd import accounts


def configure(root: Path, name: str, checkpoint: Path) -> Path:
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_text("")
    (root / "models").mkdir(parents=True, exist_ok=True)
    path = root / "models" / f"{name}.yaml"
    path.write_text(f"backend: builtin\nmodel: {checkpoint}\ndevice: cpu\n")
    return path


def problems(root: Path) -> str:
    return "\n".join(str(p) for p in host_check.check(root))


def test_a_model_named_admin_is_refused_because_its_user_would_be_the_admin_group(tmp_path):
    path = configure(tmp_path / "etc", "admin", tmp_path / "ckpt")
    assert units.user("admin") == "hostd-admin"  # the collision the rule prevents
    found = problems(tmp_path / "etc")
    assert str(path) in found and "hostd-admin" in found and "reserved" in found
    with pytest.raises(config.ConfigError):
        config.load_model("admin", tmp_path / "etc")


def test_a_model_whose_user_is_the_configured_admin_group_is_refused(tmp_path):
    root = tmp_path / "etc"
    path = configure(root, "ops", tmp_path / "ckpt")
    (root / "hostd.yaml").write_text("admin_group: hostd-ops\n")
    with pytest.raises(config.ConfigError) as err:
        config.load_model("ops", root)
    assert str(path) in str(err.value) and "admin_group" in str(err.value)


def test_a_model_named_checkpoints_is_refused_as_the_shared_checkpoint_directory(tmp_path):
    path = configure(tmp_path / "etc", "checkpoints", tmp_path / "ckpt")
    found = problems(tmp_path / "etc")
    assert str(path) in found and "/var/lib/hostd/checkpoints" in found


def test_a_name_shaped_like_a_hashed_user_does_not_take_that_user():
    assert units.user("Tiny") == "hostd-tiny-37616f64"
    assert units.user("tiny-37616f64") != units.user("Tiny")
    assert units.user("tiny") == "hostd-tiny"  # plain names keep their plain user


def test_two_models_with_one_user_are_both_refused_naming_the_other_file(tmp_path, monkeypatch):
    root = tmp_path / "etc"
    one = configure(root, "one", tmp_path / "ckpt")
    two = configure(root, "two", tmp_path / "ckpt")
    monkeypatch.setattr(units, "user", lambda name: "hostd-same-00000000")  # a 32-bit hash collision
    with pytest.raises(config.ConfigError) as err:
        config.load_model("one", root)
    assert str(one) in str(err.value) and str(two) in str(err.value) and "hostd-same-00000000" in str(err.value)


def test_config_check_refuses_an_existing_account_hostd_did_not_create_for_the_model(tmp_path, monkeypatch):
    path = configure(tmp_path / "etc", "tiny", tmp_path / "ckpt")

    def getgrnam(name):
        if name == "hostd-tiny":
            return grp.struct_group(("hostd-tiny", "x", 4242, []))
        raise KeyError(name)

    def getpwnam(name):
        raise KeyError(name)

    monkeypatch.setattr(grp, "getgrnam", getgrnam)
    monkeypatch.setattr(pwd, "getpwnam", getpwnam)
    found = problems(tmp_path / "etc")
    assert str(path) in found and "the group hostd-tiny exists" in found
    ok = pwd.struct_passwd(("hostd-tiny", "x", 4242, 4242, "hostd model tiny", "/var/lib/hostd/tiny", "/bin/false"))
    monkeypatch.setattr(pwd, "getpwnam", lambda name: ok)
    assert accounts.account_problem("tiny") is None
