"""What root writes, reads and connects to: strings that reach unit files
carry no control characters, config files are regular files, a GPU's device
node is the one NVML names, the drop-ins a reload writes hold only values
root computed within the loader's limits, env: values stay off the bus, and
root connects only to the model user's own sockets, never through a symlink,
each model runs as its own user, and polkit decides who may change models
(issue 12, rows 1 to 8 and 11; tests/system/test_polkit.py and
test_model_users.py prove rows 8 and 4 under a real systemd)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest

from hostd import config, generator, sockets
from hostd.gateway import control
from hostd.engine.health import EngineHealth
from hostd.manager.probe import Probe
from hostd.weights import client as weights_client
from hostd.config import schema
from hostd.manager import authority, errors, service
from hostd.manager import dropins
from hostd.manager import reload as R

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402


def write_model(root: Path, name: str, text: str) -> None:
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "models" / f"{name}.yaml").write_text(text)


# ------------------------------------------------------------ row 5


@pytest.mark.parametrize("data, key", [
    ({"listen": "x\nExecStartPre=/bin/touch /tmp/pwned\nListenStream=8000"}, "listen"),
    ({"model": "/m\n[Service]"}, "model"),
    ({"served_model_name": "a\rb"}, "served_model_name"),
    ({"env": {"HF_TOKEN": "abc\x1b[2J"}}, "env.HF_TOKEN"),
])
def test_strings_that_reach_unit_files_refuse_control_characters(data, key):
    with pytest.raises(msgspec.ValidationError, match=f"{key}.*control character"):
        msgspec.convert({"backend": "builtin", "model": "/m", **data}, schema.BuiltinModel)


def test_a_control_character_in_a_secret_is_named_by_key_character_and_position_never_the_value():
    # Issue 33, N3: the value (the trailing newline of a YAML | block) was printed whole.
    with pytest.raises(msgspec.ValidationError) as refused:
        msgspec.convert({"backend": "builtin", "model": "/m", "env": {"HF_TOKEN": "hf_s3cret\n"}},
                        schema.BuiltinModel)
    message = str(refused.value)
    assert "env.HF_TOKEN" in message and "U+000A" in message and "position 9 of 10" in message
    assert "s3cret" not in message and "hf_" not in message


def test_upstream_extra_args_refuse_control_characters():
    with pytest.raises(msgspec.ValidationError, match=r"extra_args\[1\].*control character"):
        msgspec.convert({"backend": "vllm", "model": "/m", "extra_args": ["--x", "a\nb"]},
                        schema.VllmModel)


def test_the_listen_injection_never_reaches_the_generated_socket(tmp_path: Path, capsys):
    etc, out = tmp_path / "etc", tmp_path / "out"
    write_model(etc, "evil", 'backend: builtin\nmodel: /m\n'
                'listen: "x\\nExecStartPre=/bin/touch /tmp/pwned\\nListenStream=8000"\n')
    assert generator.generate(out, Path("/etc/systemd/system"), etc) == []
    assert "skipping model 'evil'" in capsys.readouterr().err
    # The model's units fail with the problem quoted in one echo argument; no
    # line of the value becomes a setting of its own.
    lines = [line for p in out.rglob("*.conf") for line in p.read_text().splitlines()]
    assert not any(line.startswith(("ExecStartPre=/bin/touch", "ListenStream=8000")) for line in lines)
    assert [line for line in lines if line.startswith("ExecStartPre=")][1:] == ["ExecStartPre=/bin/false"]


def test_generator_escapes_specifiers_in_values():
    cfg = msgspec.convert({"backend": "builtin", "model": "/m", "listen": "/run/a%ib.sock"},
                          schema.BuiltinModel)
    socket_dropin = generator.dropins("m", cfg)["model@m.socket.d/50-hostd.conf"]
    assert "ListenStream=/run/a%%ib.sock\n" in socket_dropin
    with pytest.raises(ValueError, match="control character"):
        generator.unit_value("a\nb")


# ------------------------------------------------------------ row 1


def test_a_reload_never_runs_the_models_upstream_program_as_root(tmp_path: Path):
    world = World(tmp_path)
    marker = tmp_path / "ran-as-root"
    script = tmp_path / "vllm"
    script.write_text(f"#!/bin/sh\nid -u > {marker}\necho 0.32.0\n")
    script.chmod(0o755)
    checkpoint = tmp_path / "checkpoint"
    (world.root / "models/tiny.yaml").write_text(
        f"backend: vllm\nmodel: {checkpoint}\nreload: {{drain_timeout: 5}}\n"
        f"env: {{HOSTD_VLLM: {script}}}\n")
    world.probe.engine_started()  # the engine runs the vllm config
    op = asyncio.run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.DONE, op.error
    assert op.strategy_name == "overlap"  # the bridge: sized from the config, no upstream program run
    assert not marker.exists()
    # The model's own units still check the install, as the model's user.
    from hostd import backends

    cfg = config.load_model("tiny", world.root).config
    assert backends.for_config(cfg).install_refusals(cfg) == [] and marker.exists()


# ------------------------------------------------------------ row 4 (one user per model)


@pytest.mark.parametrize("name, user", [
    ("tiny", "hostd-tiny"),
    ("a-b_c", "hostd-a-b_c"),
    ("x" * 25, "hostd-" + "x" * 25),  # 31 characters: systemd's limit
])
def test_each_model_has_its_own_user_named_after_it(name, user):
    from hostd import units

    assert units.user(name) == user


@pytest.mark.parametrize("name", ["Llama-3.1-8B", "x" * 26, "a.b", "A.b"])
def test_a_name_no_user_name_can_hold_gets_a_readable_prefix_and_a_hash(name):
    from hostd import units

    user = units.user(name)
    assert len(user) <= 31 and re.fullmatch(r"hostd-[a-z0-9_-]+-[0-9a-f]{8}", user), user
    assert len({units.user(n) for n in ("a.b", "A.b", "a_b")}) == 3  # distinct models, distinct users


def test_every_unit_of_a_model_runs_as_the_models_user():
    cfg = msgspec.convert({"backend": "builtin", "model": "/m"}, schema.BuiltinModel)
    files = generator.dropins("m", cfg)
    for unit in (
        "model@m.service", "model-engine@m.service", "model-engine-next@m.service", "model-engine-standby@m.service",
        "model-weights@m.service"
    ):
        assert "User=hostd-m\nGroup=hostd-m" in files[f"{unit}.d/50-hostd.conf"]
    assert "SocketUser=hostd-m\nSocketGroup=hostd-m" in files["model-weights@m.socket.d/50-hostd.conf"]
    socket_dropin = files["model@m.socket.d/50-hostd.conf"]
    pre = [line for line in socket_dropin.splitlines() if line.startswith("ExecStartPre=")]
    assert pre[0] == "ExecStartPre=" and pre[1].endswith(" -m hostd.accounts %i")  # the account's check first
    assert pre[2].startswith("ExecStartPre=+/usr/bin/systemd-sysusers --inline \"u hostd-m ")
    assert "ExecStartPre=+/usr/bin/install -d -m 0700 -o hostd-m -g hostd-m /run/hostd/%i" in socket_dropin


# ------------------------------------------------------------ rows 2 and 7


def test_a_rollback_pin_holds_the_committed_values_never_what_the_engine_reported(tmp_path: Path):
    world = World(tmp_path)
    world.records.write_committed("tiny", config.load_model("tiny", world.root).config)
    (world.root / "models/tiny.d").mkdir()
    (world.root / "models/tiny.d/50-admin.yaml").write_text("engine: {max_num_seqs: 2}\n")
    # The engine (the service user's process) reports 2 MiB of junk and logs an ESC.
    world.probe.engine = {"junk": "x" * (2 << 20), "max_num_seqs": 8}
    world.probe.fail_next_start = True

    async def engine_error(default, slot="main"):  # either engine: the pin is the same under both strategies
        return default + ": boom\x1b[2J\n\u2028ExecStartPre=/bin/sh " + "word " * 400

    world.probe.engine_error = engine_error
    op = asyncio.run(world.reload({}))
    assert op.state == R.State.ROLLED_BACK
    pin = world.root / "models/tiny.d" / R.ROLLBACK_DROPIN
    text = pin.read_text()
    assert len(text) < 2000 and "junk" not in text and "\x1b" not in text
    comments = [line for line in text.splitlines() if line.startswith("#")]
    comment = " ".join(line[2:] for line in comments)
    assert comment.startswith("Written by hostd's manager") and "ExecStartPre" in comment
    assert len(comment) < dropins.COMMENT_LIMIT + 150 and " ... " in comment  # bounded, cut at a word
    assert all(len(line) <= 80 for line in comments)
    assert not any(line.startswith("ExecStartPre") for line in text.splitlines())
    assert config.load_model("tiny", world.root).config.engine.max_num_seqs == 8  # the file loads


def test_without_a_commit_an_invalid_engine_report_is_never_pinned(tmp_path: Path):
    world = World(tmp_path)
    world.probe.engine = {"junk": "x" * 1000}
    with pytest.raises(errors.NotRunning, match="no valid engine section"):
        asyncio.run(world.reload({}))
    assert not (world.root / "models/tiny.d").exists()


def test_a_patch_over_the_loaders_node_limit_is_refused_naming_the_key(tmp_path: Path):
    # The patch's own weight limit (manager/patch.py, MAX_PATCH_BYTES) refuses it first, before the loader's.
    world = World(tmp_path)
    with pytest.raises(errors.InvalidValue, match=r"engine\.max_num_seqs: the value takes more than 8192 bytes"):
        asyncio.run(world.reload({"max_num_seqs": list(range(1, 150_001))}))
    assert not world.dropin.exists() and world.restarts() == 0


def test_a_patch_over_the_loaders_size_limit_is_refused_naming_the_key(tmp_path: Path):
    world = World(tmp_path)
    with pytest.raises(errors.InvalidValue, match=r"engine\.max_num_seqs: the value takes more than 8192 bytes"):
        asyncio.run(world.reload({"max_num_seqs": "x" * (config.load.MAX_FILE_BYTES + 1)}))
    assert not world.dropin.exists() and world.restarts() == 0


def test_a_drop_in_over_the_loaders_size_limit_is_refused_naming_the_key():
    big = {"engine": {"max_num_seqs": "x" * (config.load.MAX_FILE_BYTES + 1)}}
    with pytest.raises(config.ConfigError, match="engine.max_num_seqs: the file would be larger"):
        config.load.render_yaml(big, R.RELOAD_DROPIN)


def test_a_vllm_patch_of_150000_graph_sizes_is_refused_before_anything_is_written(tmp_path: Path):
    big = {"engine": {"cuda_graph_sizes": list(range(1, 150_001))}}
    with pytest.raises(config.ConfigError, match="engine.cuda_graph_sizes: more than"):
        config.load.render_yaml(big, R.RELOAD_DROPIN)


def test_comment_text_is_one_bounded_line_cut_at_a_word():
    text = dropins.comment_text("a\x1bb\nc\rd\u2028e " + "word " * 200)
    assert text.startswith("a b c d e word") and text.endswith(" ...")
    assert len(text) <= dropins.COMMENT_LIMIT and text.isprintable() and "wor ..." not in text


# ------------------------------------------------------------ row 6


def test_config_and_running_config_on_the_bus_redact_env_values(tmp_path: Path):
    world = World(tmp_path)
    model_yaml = world.root / "models/tiny.yaml"
    model_yaml.write_text(model_yaml.read_text() + "env: {HF_TOKEN: hf_secret123, OTHER: x}\n")
    model_yaml.chmod(0o600)
    world.records.write_committed("tiny", config.load_model("tiny", world.root).config)

    async def go():
        await world.connect()
        manager = service.Manager(world.bus, world.systemd, world.root, world.records)
        manager.discover()
        model = manager.models["tiny"]
        return json.loads(model.Config), json.loads(model.RunningConfig)

    cfg, running = asyncio.run(go())
    assert cfg["env"] == {"HF_TOKEN": "<redacted>", "OTHER": "<redacted>"}
    assert running["fixed"]["env"] == {"HF_TOKEN": "<redacted>", "OTHER": "<redacted>"}
    assert cfg["engine"]["max_num_seqs"] == running["engine"]["max_num_seqs"] == 8
    assert "hf_secret123" in world.records.committed_text("tiny")  # root's own record keeps it


# ------------------------------------------------------------ row 3

NOBODY, DAEMON = 65534, 1


def run_server(path: Path, uid: int) -> int:
    """Fork a server on PATH (owned by UID) listening as UID: it answers an HTTP /health or a
    control-socket status, one connection at a time. Returns its pid."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"r"
        os.close(ready_r)
        return pid
    try:  # the child: never returns into pytest
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))  # as root (pytest's tmp is root's 0700); the peer is who listens
        os.chown(path, uid, uid)
        os.setgid(uid)
        os.setuid(uid)
        sock.listen()
        os.write(ready_w, b"r")
        while True:
            conn, _ = sock.accept()
            data = conn.recv(65536)
            if data.startswith(b"GET"):
                body = b'{"engine_config": {}}'
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n%s" % (len(body), body))
            else:
                conn.sendall(b'{"ok": true, "state": "serving", "in_flight": 0}\n')
            conn.close()
    finally:
        os._exit(0)


@pytest.fixture
def model_run(tmp_path: Path, monkeypatch):
    """/run/hostd/tiny as root makes it: 0700, owned by the model's user (nobody
    here), inside root's 0755 runtime root; SERVE(name, uid) starts a server."""
    if os.getuid() != 0:
        pytest.skip("needs root: the manager's side of the sockets")
    root = tmp_path / "run"
    directory = root / "tiny"
    directory.mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chown(directory, NOBODY, NOBODY)
    os.chmod(directory, 0o700)
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(root))
    children = []

    def serve(name: str, uid: int = NOBODY) -> Path:
        children.append(run_server(directory / name, uid))
        return directory / name

    yield directory, serve
    for pid in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_root_talks_to_the_model_users_own_sockets(model_run):
    directory, serve = model_run
    serve("control.sock")
    serve("engine.sock")
    assert control.call(directory / "control.sock", control.Status()).state == "serving"
    assert asyncio.run(control.call_async(directory / "control.sock", control.Status())).ok
    assert asyncio.run(Probe("tiny").engine_health()) == EngineHealth(engine_config={})


@pytest.mark.parametrize("name", ["control.sock", "engine.sock", "weights.sock"])
def test_root_refuses_a_socket_replaced_by_a_symlink(model_run, name, caplog):
    directory, serve = model_run
    other = serve("other.sock")  # another socket of the same user: a symlink may not lead there
    (directory / name).symlink_to(other)
    with pytest.raises(sockets.UnsafeSocket, match="symbolic link"):
        sockets.connect(directory / name)
    if name == "control.sock":
        with pytest.raises(control.ControlError, match="symbolic link"):
            control.call(directory / name, control.Status())
        with pytest.raises(OSError, match="symbolic link"):
            asyncio.run(control.call_async(directory / name, control.Status()))
    elif name == "engine.sock":
        assert asyncio.run(Probe("tiny").engine_health()) is None
    else:
        with pytest.raises(OSError, match="symbolic link"):
            weights_client.status(directory / name)
    assert "refusing to connect" in caplog.text


def test_root_refuses_a_socket_not_owned_by_the_models_user(model_run):
    directory, serve = model_run
    serve("control.sock", uid=0)  # root's socket in the model's directory: not the model's
    with pytest.raises(control.ControlError, match="owned by uid 0, not 65534"):
        control.call(directory / "control.sock", control.Status())


def test_root_refuses_a_peer_that_is_not_the_models_user(model_run):
    directory, serve = model_run
    path = serve("control.sock", uid=DAEMON)
    os.chown(path, NOBODY, NOBODY)  # the file looks right; the process behind it is not
    with pytest.raises(control.ControlError, match="the peer is pid .* of uid 1, not 65534"):
        control.call(path, control.Status())


def test_a_directory_others_may_write_is_refused(model_run):
    directory, serve = model_run
    serve("control.sock")
    os.chmod(directory, 0o777)
    with pytest.raises(control.ControlError, match="another user could replace the socket"):
        control.call(directory / "control.sock", control.Status())


# ------------------------------------------------------------ row 8 (polkit)


class PolkitBus:
    """The bus daemon and polkit as the manager sees them: the caller's uid,
    and polkit's answer (AUTHORIZED) or its absence (ERROR)."""

    def __init__(self, uid: int, authorized: bool = False, error: str = ""):
        self.uid, self.authorized, self.error, self.asked = uid, authorized, error, []

    async def call(self, msg):
        from dbus_fast import Message

        msg.serial = 1  # the real bus numbers the messages it sends
        if msg.member == "GetConnectionUnixUser":
            return Message.new_method_return(msg, "u", [self.uid])
        self.asked.append((msg.member, msg.body[0][0], msg.body[0][1]["name"].value, msg.body[1]))
        if self.error:
            return Message.new_error(msg, self.error, "no polkit")
        return Message.new_method_return(msg, "(bba{ss})", [[self.authorized, not self.authorized, {}]])


def require(bus: PolkitBus, action: str) -> None:
    token = authority.CALLER.set(":1.42")
    try:
        asyncio.run(authority.Authority(bus, "hostd-admin").require(action))
    finally:
        authority.CALLER.reset(token)


def test_root_is_allowed_without_asking_polkit():
    bus = PolkitBus(uid=0, error="org.freedesktop.DBus.Error.ServiceUnknown")
    require(bus, "org.hostd1.reload")
    assert bus.asked == []


def test_polkit_decides_for_everyone_else_by_the_callers_bus_name():
    bus = PolkitBus(uid=1000, authorized=True)
    require(bus, "org.hostd1.manage")
    assert bus.asked == [("CheckAuthorization", "system-bus-name", ":1.42", "org.hostd1.manage")]
    with pytest.raises(errors.AccessDenied, match="uid 1000 is not authorized to reload a model .*org.hostd1.reload"):
        require(PolkitBus(uid=1000, authorized=False), "org.hostd1.reload")


def test_without_polkit_only_root_is_allowed_and_the_journal_says_why(caplog):
    with pytest.raises(errors.AccessDenied, match="polkit is not running on this host, so only root may"):
        require(PolkitBus(uid=1000, error="org.freedesktop.DBus.Error.ServiceUnknown"), "org.hostd1.reload")
    assert "polkit is not available (org.freedesktop.DBus.Error.ServiceUnknown)" in caplog.text


def test_the_policy_ships_the_actions_the_manager_asks_for_and_no_other():
    import re

    from hostd.manager import api

    root = Path(__file__).resolve().parents[2]
    policy = (root / "packaging/org.hostd1.policy").read_text()
    assert set(re.findall(r'<action id="([^"]+)">', policy)) == set(api.ACTIONS) == {
        "org.hostd1.reload", "org.hostd1.manage", "org.hostd1.log-level"}
    asked = "".join(p.read_text() for p in (root / "hostd/manager").glob("*.py"))
    assert asked.count("@admin(api.RELOAD_ACTION)") == 4 and "@admin(api.MANAGE_ACTION)" in asked  # Revert too
    assert asked.count("@admin(api.LOG_LEVEL_ACTION)") == 1


def test_the_log_level_action_is_allowed_to_whoever_may_reload():
    """org.hostd1.log-level has reload's defaults, and the shipped rule's
    grant to the admin group covers it (every org.hostd1. action)."""
    import xml.etree.ElementTree as ET

    root = Path(__file__).resolve().parents[2]
    policy = ET.parse(root / "packaging/org.hostd1.policy").getroot()
    defaults = {a.get("id"): {d.tag: d.text for d in a.find("defaults")} for a in policy.iter("action")}
    assert defaults["org.hostd1.log-level"] == defaults["org.hostd1.reload"]
    rule = (root / "packaging/org.hostd1.rules").read_text()
    assert 'action.id.indexOf("org.hostd1.") === 0 && subject.isInGroup(@ADMIN_GROUP@)' in rule


def test_install_puts_polkit_files_where_debians_polkitd_reads_them(tmp_path: Path):
    import argparse

    from hostd import install

    (tmp_path / "etc/hostd").mkdir(parents=True)
    (tmp_path / "etc/hostd/hostd.yaml").write_text("admin_group: model-ops\n")
    args = argparse.Namespace(root=str(tmp_path), config_dir="/etc/hostd", unit_dir="/etc/systemd/system",
                              generator_dir="/etc/systemd/system-generators", python=None)
    files = install.planned_files(args)
    assert tmp_path / "usr/share/polkit-1/actions/org.hostd1.policy" in files
    rules = files[tmp_path / "usr/share/polkit-1/rules.d/org.hostd1.rules"][0]
    assert 'subject.isInGroup("model-ops")' in rules


# ------------------------------------------------------------ row 8 (config files)


def test_hostd_yaml_as_a_fifo_is_refused_without_hanging(tmp_path: Path):
    os.mkfifo(tmp_path / "hostd.yaml")
    # In a child with a deadline: before the fix this read blocked forever.
    code = ("import sys; from hostd import config\n"
            "try:\n config.load_daemon(sys.argv[1])\n"
            "except config.ConfigError as e: print(e)\n")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert "hostd.yaml" in result.stdout and "not a regular file" in result.stdout


def test_hostd_yaml_linked_to_dev_zero_is_refused(tmp_path: Path):
    (tmp_path / "hostd.yaml").symlink_to("/dev/zero")
    with pytest.raises(config.ConfigError, match="not a regular file"):
        config.load_daemon(tmp_path)


def test_a_model_yaml_that_is_a_fifo_is_a_broken_model_not_a_hang(tmp_path: Path):
    (tmp_path / "models").mkdir()
    os.mkfifo(tmp_path / "models" / "fifo.yaml")
    assert config.list_models(tmp_path) == ["fifo"]
    with pytest.raises(config.ConfigError, match="fifo.yaml.*not a regular file"):
        config.load_model("fifo", tmp_path)


def test_a_symlink_to_a_regular_file_still_loads(tmp_path: Path):
    real = tmp_path / "real.yaml"
    real.write_text("backend: builtin\nmodel: /m\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "linked.yaml").symlink_to(real)
    assert config.load_model("linked", tmp_path).config.model == "/m"


# ------------------------------------------------------------ row 11


@pytest.fixture
def fake_nvml(monkeypatch):
    """An NVML whose minor numbers differ from the GPU indices, as they do on
    hosts whose driver probed the cards in another order."""
    minors = {0: 3, 1: 0, 2: 1, 3: 2}
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: len(minors),
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetMinorNumber=lambda handle: minors[handle[1]],
        nvmlDeviceGetUUID=lambda handle: f"GPU-{handle[1]}",  # the gateway's HOSTD_GPUS
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return calls


def test_device_allow_names_each_gpu_by_its_nvml_minor_number(fake_nvml):
    cfg = msgspec.convert({"backend": "builtin", "model": "/m", "device": "cuda", "gpus": [0, 1]},
                          schema.BuiltinModel)
    text = generator.dropins("g", cfg)["model-engine@g.service.d/50-hostd.conf"]
    assert "DeviceAllow=/dev/nvidia3 rw" in text and "DeviceAllow=/dev/nvidia0 rw" in text
    assert "DeviceAllow=/dev/nvidia1 rw" not in text
    assert "Environment=CUDA_DEVICE_ORDER=PCI_BUS_ID" in text
    assert "Environment=CUDA_VISIBLE_DEVICES=0,1" in text
    assert fake_nvml[0] == "init" and fake_nvml[-1] == "shutdown"


def test_without_nvml_every_nvidia_gpu_is_allowed_and_the_log_says_why(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    cfg = msgspec.convert({"backend": "builtin", "model": "/m", "device": "cuda", "gpus": [1]},
                          schema.BuiltinModel)
    text = generator.dropins("g", cfg)["model-weights@g.service.d/50-hostd.conf"]
    assert "DeviceAllow=char-nvidia-frontend rw" in text
    assert "/dev/nvidia1 rw" not in text
    assert "cannot read GPU minor numbers" in capsys.readouterr().err


def test_a_patch_of_a_million_entries_is_refused_by_its_count_before_it_is_built():
    """Issue 52, N1: a{sv} patches were weighed only after every entry was
    unpacked; the count alone refuses what no patch can be."""
    from dbus_fast import Variant

    from hostd.manager.patch import MAX_PATCH_ENTRIES, patch_from_variants

    huge = {f"k{i}": Variant("u", 1) for i in range(1_000_000)}
    with pytest.raises(errors.InvalidValue, match=f"1000000 entries; a reload patch holds at most {MAX_PATCH_ENTRIES}"):
        patch_from_variants(huge)
    assert patch_from_variants({"max_num_seqs": Variant("u", 4)}) == {"max_num_seqs": 4}
