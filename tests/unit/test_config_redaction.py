"""Secrets of a model's config stay in its files (issue 22, item 19): the
values of env: and of secret flags in extra_args (--hf-token, ...) are
redacted on D-Bus, in `hostctl config` for an ordinary user and in the argv
the supervisors log; `hostctl config --check` warns about a file holding them
that every user may read; polkit learns the model and verb of each call;
`hostctl edit` checks NAME before it makes a path of it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from hostd import hostctl
from hostd.config import redact
from hostd.manager import api, authority, model_bus

SECRET = "hf_s3cr3tvalue"


def make_model(root: Path, mode: int = 0o640) -> Path:
    (root / "models").mkdir(parents=True)
    path = root / "models/vq.yaml"
    path.write_text(
        "backend: vllm\nmodel: /srv/vq\ngpus: [0]\n"
        f"extra_args: [--hf-token, {SECRET}, --trust-remote-code]\n"
        f"engine_extra_args: ['--api-key={SECRET}']\n"
        f"env: {{HF_TOKEN: {SECRET}}}\n")
    path.chmod(mode)
    return path


def test_bus_config_redacts_secret_flag_values_as_it_redacts_env():
    shown = json.dumps(model_bus.redacted({
        "env": {"HF_TOKEN": SECRET},
        "extra_args": ["--hf-token", SECRET, "--tokenizer", "/srv/tok", "--seed_token=" + SECRET],
        "engine_extra_args": ["--api-key", SECRET],
    }))
    assert SECRET not in shown
    assert "--hf-token" in shown and "/srv/tok" in shown  # flags and non-secret values stay


def test_logged_argv_keeps_flags_and_drops_secret_values():
    argv = ["vllm", "serve", "--hf-token", SECRET, "--max-num-batched-tokens", "64", f"--api-key={SECRET}"]
    assert redact.argv(argv) == ["vllm", "serve", "--hf-token", "<redacted>", "--max-num-batched-tokens", "64",
                                 "--api-key=<redacted>"]


def test_hostctl_config_as_an_ordinary_user_redacts_what_dbus_redacts(tmp_path, monkeypatch, capsys):
    make_model(tmp_path)
    monkeypatch.setattr(hostctl.os, "geteuid", lambda: 1000)
    for extra in ([], ["--json"]):
        assert hostctl.main(["--config-dir", str(tmp_path), "config", "vq", *extra]) == 0
        out = capsys.readouterr().out
        assert SECRET not in out and "HF_TOKEN" in out and "--hf-token" in out
    monkeypatch.setattr(hostctl.os, "geteuid", lambda: 0)
    assert hostctl.main(["--config-dir", str(tmp_path), "config", "vq"]) == 0
    assert SECRET in capsys.readouterr().out  # root reads the files anyway


def test_config_check_warns_about_a_file_with_secrets_every_user_may_read(tmp_path, capsys):
    path = make_model(tmp_path, 0o644)
    hostctl.main(["--config-dir", str(tmp_path), "config", "--check", "vq"])
    err = capsys.readouterr().err
    assert f"warning: {path} holds env: values" in err and f"chmod 0640 {path}" in err
    path.chmod(0o640)
    hostctl.main(["--config-dir", str(tmp_path), "config", "--check", "vq"])
    assert "warning" not in capsys.readouterr().err


def test_config_check_warns_about_a_file_with_secrets_another_group_or_owner_may_read(tmp_path, capsys):
    """0640 is private only with a private group: a file of the group users,
    or owned by another account, is readable by others too."""
    path = make_model(tmp_path, 0o640)
    os.chown(path, 0, 100)  # root:users
    hostctl.main(["--config-dir", str(tmp_path), "config", "--check", "vq"])
    err = capsys.readouterr().err
    assert f"warning: {path} holds env: values" in err and "the group users" in err
    assert f"chown root:hostd-vq {path} && chmod 0640 {path}" in err
    os.chown(path, 65534, 0)  # nobody:root
    hostctl.main(["--config-dir", str(tmp_path), "config", "--check", "vq"])
    err = capsys.readouterr().err
    assert f"warning: {path} holds env: values" in err and "readable by its owner nobody" in err
    os.chown(path, 0, 100)
    path.chmod(0o600)  # the group cannot read it: fine
    hostctl.main(["--config-dir", str(tmp_path), "config", "--check", "vq"])
    assert "warning" not in capsys.readouterr().err


def test_polkit_is_asked_with_the_model_and_the_verb():
    asked = []

    class Bus:
        async def call(self, msg):
            from dbus_fast import Message

            msg.serial = 1
            if msg.member == "GetConnectionUnixUser":
                return Message.new_method_return(msg, "u", [1000])
            asked.append((msg.body[1], msg.body[2]))
            return Message.new_method_return(msg, "(bba{ss})", [[True, False, {}]])

    admin = authority.admin

    class Manager:
        authority = authority.Authority(Bus())

        @admin(api.MANAGE_ACTION)
        async def Stop(self, name):
            return name

        @admin(api.RELOAD_ACTION)
        async def ReloadJSON(self, name, patch):
            return name

    async def go():
        token = authority.CALLER.set(":1.42")
        try:
            await Manager().Stop("qwen")
            await Manager().ReloadJSON("qwen", "{}")
        finally:
            authority.CALLER.reset(token)

    asyncio.run(go())
    assert asked == [(api.MANAGE_ACTION, {"model": "qwen", "verb": "stop"}),
                     (api.RELOAD_ACTION, {"model": "qwen", "verb": "reload"})]


def test_hostctl_edit_refuses_a_name_that_is_a_path_before_opening_anything(tmp_path):
    (tmp_path / "etc/models").mkdir(parents=True)
    (tmp_path / "etc/evil.yaml").write_text("backend: builtin\nmodel: /srv/tiny\n")
    (tmp_path / "etc/evil.d").mkdir()
    (tmp_path / "etc/evil.d/95-override.yaml").write_text("# a file outside models/\n")
    editor = tmp_path / "editor.sh"
    editor.write_text(f'#!/bin/sh\ncp "$1" {tmp_path}/seen\n')
    editor.chmod(0o755)
    result = subprocess.run([sys.executable, "-m", "hostd.hostctl", "--config-dir", str(tmp_path / "etc"),
                             "edit", "../evil"], capture_output=True, text=True,
                            env={**os.environ, "EDITOR": str(editor)})
    assert result.returncode == 1 and "is not allowed" in result.stderr
    assert not (tmp_path / "seen").exists()  # no editor was opened on a file outside models/
