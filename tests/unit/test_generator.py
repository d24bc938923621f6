"""hostd-generator's output for a good, a broken and an autostart model, and
`hostd install --root` / `uninstall` putting files in place and taking them away."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import shutil
from pathlib import Path

import pytest

from hostd import generator


def model(root: Path, name: str, text: str) -> None:
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "models" / f"{name}.yaml").write_text(text)


def test_generator_writes_dropins_for_good_models_and_failing_ones_for_broken_ones(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(MinorIsIndex))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "good", "backend: builtin\nmodel: /m\nlisten: '[::1]:8001'\ntimeouts: {start: 60, stop: 30}\n"
                       "gateway: {api_keys: /etc/hostd/keys/good}\n")
    model(etc, "gpu", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [2, 3]\nautostart: true\n")
    model(etc, "broken", "backend: builtin\nmodel: [\n")

    names = generator.generate(out, Path("/etc/systemd/system"), etc)

    assert names == ["good", "gpu"]
    assert "skipping model 'broken'" in capsys.readouterr().err
    # The broken model's socket fails at start, saying which file and why.
    socket = (out / "model@broken.socket.d/50-hostd.conf").read_text()
    assert f"SourcePath={etc}/models/broken.yaml" in socket
    assert f'ExecStartPre=/bin/echo "hostd: model broken is not started: invalid configuration: {etc}/models/broken.yaml:3: malformed YAML' in socket
    assert "ExecStartPre=/bin/false" in socket
    assert f"Description=hostd model broken: INVALID CONFIG {etc}/models/broken.yaml" in (
        out / "model@broken.service.d/50-hostd.conf").read_text()
    assert not (out / "model-engine@broken.service.d").exists()
    good = (out / "model@good.socket.d/50-hostd.conf").read_text()
    assert "[Socket]\nListenStream=[::1]:8001\n" in good and f"SourcePath={etc}/models/good.yaml" in good
    gateway = (out / "model@good.service.d/50-hostd.conf").read_text()
    assert "LoadCredential=api-keys:/etc/hostd/keys/good\n" in gateway
    assert "LoadCredential" not in (out / "model@gpu.service.d/50-hostd.conf").read_text()
    engine = (out / "model-engine@good.service.d/50-hostd.conf").read_text()
    assert "TimeoutStartSec=60\nTimeoutStopSec=30" in engine and "DeviceAllow" not in engine
    gpu = (out / "model-weights@gpu.service.d/50-hostd.conf").read_text()
    assert "Environment=CUDA_VISIBLE_DEVICES=2,3" in gpu
    assert "DeviceAllow=/dev/nvidia2 rw" in gpu and "DeviceAllow=/dev/nvidia3 rw" in gpu
    assert "DeviceAllow=/dev/nvidiactl rw" in gpu
    link = out / "multi-user.target.wants/model@gpu.service"
    assert link.is_symlink() and os.readlink(link) == "/etc/systemd/system/model@.service"
    assert not (out / "multi-user.target.wants/model@good.service").exists()


class MinorIsIndex:
    """pynvml on a host with 8 GPUs, each GPU's /dev node its index's."""

    nvmlDeviceGetCount = staticmethod(lambda: 8)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda index: index)
    nvmlDeviceGetMinorNumber = staticmethod(lambda handle: handle)
    nvmlDeviceGetUUID = staticmethod(lambda handle: f"GPU-{handle}")


class OneGpu:
    """pynvml on a host with one GPU, whose /dev node is /dev/nvidia3."""

    @staticmethod
    def nvmlDeviceGetUUID(handle):
        return b"GPU-8f3e0000-0000-4000-8000-000000000000"

    @staticmethod
    def nvmlDeviceGetCount():
        return 1

    @staticmethod
    def nvmlDeviceGetHandleByIndex(index):
        if index != 0:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return "handle-0"

    @staticmethod
    def nvmlDeviceGetMinorNumber(handle):
        return 3


def test_a_model_on_a_gpu_the_host_lacks_gets_a_start_that_fails_naming_gpus(tmp_path: Path, capsys, monkeypatch):
    """Before, `gpus: [1]` on a one-GPU host got DeviceAllow= for every NVIDIA
    GPU (NVML's error was taken for "no driver") and a weights unit that
    imported torch for seconds before CUDA refused the ordinal. Now the GPU
    the config names by mistake is the start's error."""
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(OneGpu))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "there", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [0]\n")
    model(etc, "missing", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [0, 1]\nautostart: true\n")

    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["there"]

    assert "DeviceAllow=/dev/nvidia3 rw" in (out / "model-engine@there.service.d/50-hostd.conf").read_text()
    err = capsys.readouterr().err
    assert "skipping model 'missing'" in err and "this host has 1 GPU" in err
    socket = (out / "model@missing.socket.d/50-hostd.conf").read_text()
    assert ("hostd: model missing is not started: invalid configuration: "
            f"{etc}/models/missing.yaml: gpus: [0, 1]: this host has 1 GPU (NVML, indices 0 to 0") in socket
    assert "GPU 1 does not exist" in socket and "ExecStartPre=/bin/false" in socket
    assert not (out / "model-weights@missing.service.d").exists()
    assert not (out / "multi-user.target.wants/model@missing.service").exists()  # nor at boot


def test_invalid_config_message_is_quoted_for_the_unit_file_command_line():
    assert generator._unit_quote('a "b" 50% $HOME\\n\nnext') == '"a \\"b\\" 50%% $$HOME\\\\n next"'


def test_dry_run_prints_what_it_would_write_and_writes_nothing(tmp_path: Path):
    etc = tmp_path / "etc"
    model(etc, "good", "backend: builtin\nmodel: /m\nlisten: 127.0.0.1:8001\nautostart: true\n")
    for option in ("--dry-run", "--dryrun"):
        result = subprocess.run([sys.executable, "-m", "hostd.generator", option], cwd=tmp_path,
                                env={**os.environ, "HOSTD_CONFIG_DIR": str(etc), "HOSTD_UNIT_DIR": "/u"},
                                capture_output=True, text=True, check=True)
        assert "# model@good.socket.d/50-hostd.conf\n" in result.stdout
        assert "ListenStream=127.0.0.1:8001" in result.stdout
        assert "# multi-user.target.wants/model@good.service -> /u/model@.service" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etc"]  # nothing written, no "--dryrun" directory
    bad = subprocess.run([sys.executable, "-m", "hostd.generator", "--bogus"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["etc"]


def test_generator_never_fails_even_on_an_unreadable_tree(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "hostd.generator", str(tmp_path / "out")],
        env={**os.environ, "HOSTD_CONFIG_DIR": "/proc/definitely/not/here"},
        capture_output=True, text=True,
    )
    assert result.returncode == 0


def test_install_and_uninstall_under_a_root(tmp_path: Path):
    root = tmp_path / "root"
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostd.main", *a, "--root", str(root), "--no-reload"],  # noqa: E731
                                    capture_output=True, text=True, check=True)
    run("install")
    # Vendor files where systemd and dbus-daemon read them; /etc is the administrator's.
    unit = (root / "usr/local/lib/systemd/system/model-engine@.service").read_text()
    assert f"ExecStart={sys.executable} -m hostd.main engine %i" in unit
    assert "BindsTo=model-weights@%i.service" in unit and "@" + "USER@" not in unit
    assert os.access(root / "usr/local/lib/systemd/system-generators/hostd-generator", os.X_OK)
    for path in ("usr/local/lib/sysusers.d/hostd.conf", "usr/local/lib/tmpfiles.d/hostd.conf",
                 "usr/share/dbus-1/system.d/org.hostd1.conf", "etc/hostd/hostd.yaml"):
        assert (root / path).is_file(), path
    activation = (root / "usr/local/share/dbus-1/system-services/org.hostd1.service").read_text()
    assert "Name=org.hostd1" in activation and "SystemdService=hostd.service" in activation
    assert not (root / "etc/systemd").exists() and not (root / "etc/dbus-1").exists()
    page = (root / "usr/local/share/man/man1/hostctl.1").read_text()
    assert page.startswith('.TH HOSTCTL "1"') and "\\-\\-json" in page and "status" in page
    assert ".B engine.max_num_seqs" in (root / "usr/local/share/man/man5/hostd.yaml.5").read_text()
    assert (root / "usr/local/share/man/man8/hostd.8").read_text().startswith('.TH HOSTD "8"')
    completion = (root / "usr/local/share/bash-completion/completions/hostctl").read_text()
    assert "complete " in completion and "reload" in completion and "--no-legend" in completion
    manifest = json.loads((root / "usr/local/share/cockpit/hostd/manifest.json").read_text())
    assert manifest["menu"]["index"]["label"] == "Models"  # cockpit-bridge reads /usr/local/share/cockpit
    assert (root / "usr/local/share/cockpit/hostd/index.html").is_file()
    for command in ("hostd", "hostctl"):  # on root's PATH
        assert os.readlink(root / "usr/local/bin" / command) == str(Path(sys.executable).parent / command)

    run("uninstall")
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == ["etc/hostd/hostd.yaml"]  # configuration stays unless --purge
    assert not (root / "usr/local/share/cockpit/hostd").exists()
    run("uninstall", "--purge")
    assert not (root / "etc/hostd").exists()


def test_install_over_an_install_says_what_changed_and_keeps_etc_hostd(tmp_path: Path):
    """An upgrade (hostd install over an older install) names each file it
    installs, updates or leaves unchanged, counts them, and keeps the
    administrator's /etc/hostd as it is."""
    root = tmp_path / "root"

    def install() -> list[str]:
        done = subprocess.run([sys.executable, "-m", "hostd.main", "install", "--root", str(root), "--no-reload"],
                              capture_output=True, text=True, check=True)
        return done.stdout.splitlines()

    first = install()
    assert first[-1].startswith("hostd install: ") and " 0 updated, 0 unchanged, 0 removed" in first[-1]
    unit = root / "usr/local/lib/systemd/system/model-engine@.service"
    config = root / "etc/hostd/hostd.yaml"
    config.write_text("log_level: debug\n")  # the administrator's
    unit.write_text(unit.read_text() + "# an older version's line\n")  # what an older hostd wrote
    stale = root / "usr/local/lib/systemd/system/model-old@.service"
    stale.write_text("[Unit]\n")
    manifest = root / "var/lib/hostd/installed-files"
    manifest.write_text(manifest.read_text() + f"{stale}\n")

    second = install()
    assert f"updated {unit}" in second
    assert f"removed {stale} (no longer installed there)" in second and not stale.exists()
    assert f"kept {root / 'etc/hostd'} as it is (the administrator's configuration)" in second
    assert config.read_text() == "log_level: debug\n"
    assert "# an older version's line" not in unit.read_text()
    changed = [line for line in second[:-1] if line.startswith(("installed ", "updated "))]
    assert changed == [f"updated {unit}"], changed
    assert second[-1].startswith("hostd install: 0 installed, 1 updated, ") and second[-1].endswith(", 1 removed")
    third = install()
    assert third[-1].startswith("hostd install: 0 installed, 0 updated, ") and third[-1].endswith(" 0 removed")


def test_reinstall_replaces_a_planted_link_or_a_foreign_owned_file_even_with_the_same_content(tmp_path: Path):
    """A file install writes is "unchanged" only when it is a regular file of
    the installing user (root, for a real install) with the planned mode: a
    symlink to a file someone else controls, or their own file, both with the
    planned content, would let them change what root's units run later."""
    root = tmp_path / "root"

    def install() -> list[str]:
        done = subprocess.run([sys.executable, "-m", "hostd.main", "install", "--root", str(root), "--no-reload"],
                              capture_output=True, text=True, check=True)
        return done.stdout.splitlines()

    install()
    units_dir = root / "usr/local/lib/systemd/system"
    linked, foreign = units_dir / "model-engine@.service", units_dir / "model-weights@.service"
    planted = tmp_path / "attacker" / linked.name
    planted.parent.mkdir()
    planted.write_text(linked.read_text())
    planted.chmod(0o644)
    linked.unlink()
    linked.symlink_to(planted)
    other_uid = os.geteuid() + 4242 if os.geteuid() == 0 else None
    if other_uid is not None:  # only root can give a file away
        os.chown(foreign, other_uid, -1)

    second = install()
    assert f"updated {linked}" in second, second
    assert not linked.is_symlink() and linked.stat().st_uid == os.geteuid()
    assert planted.read_text() == linked.read_text()  # the attacker's copy is left alone, no longer used
    if other_uid is not None:
        assert f"updated {foreign}" in second, second
        assert foreign.stat().st_uid == os.geteuid()
    third = install()
    assert third[-1].startswith("hostd install: 0 installed, 0 updated, "), third[-1]


def _install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hostd.main", "install", "--root", str(root), "--no-reload", *args],
                          capture_output=True, text=True)


def test_install_refuses_an_interpreter_others_can_write_and_writes_nothing(tmp_path: Path):
    """root's units run `PYTHON -m hostd.main`: an interpreter (or a directory
    above it) that a group or every user may write hands them root."""
    python = tmp_path / "venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o775)
    done = _install(tmp_path / "root", "--python", str(python))
    assert done.returncode == 1, done.stdout + done.stderr
    assert (f"hostd install: refused: {python} is writable by the members of group" in done.stderr
            and "(mode 0775)" in done.stderr and f"chmod go-w {python}" in done.stderr), done.stderr
    assert "nothing was written" in done.stderr and not (tmp_path / "root").exists()

    python.chmod(0o755)
    python.parent.chmod(0o777)  # a directory above it: anyone may swap the interpreter
    done = _install(tmp_path / "root", "--python", str(python))
    assert done.returncode == 1 and f"{python.parent} is writable by every user (mode 0777)" in done.stderr, \
        done.stderr
    python.parent.chmod(0o755)
    assert _install(tmp_path / "root", "--python", str(python)).returncode == 0


def test_install_refuses_a_hostd_package_with_a_file_others_can_write(tmp_path: Path, monkeypatch):
    """The package the units import (this one, an editable install's checkout
    included): one group-writable module is enough."""
    from hostd import install

    package = tmp_path / "checkout/hostd"
    (package / "config").mkdir(parents=True)
    for module in ("__init__.py", "install.py", "config/load.py"):
        (package / module).write_text("")
    (package / "config/load.py").chmod(0o664)
    monkeypatch.setattr(install, "__file__", str(package / "install.py"))
    refusals, _ = install.check_code_location(sys.executable)
    assert [r for r in refusals if str(package / "config/load.py") in r], refusals
    (package / "config/load.py").chmod(0o644)
    refusals, _ = install.check_code_location(sys.executable)
    assert not [r for r in refusals if str(package) in r], refusals


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_install_warns_loudly_when_a_user_owns_the_code_root_runs(tmp_path: Path):
    """An editable install from alice's checkout: alice may edit what root's
    units run. Installed (the tests' own checkouts are bound into containers
    so), with a warning that names the owner and what to do instead."""
    python = tmp_path / "alice/venv/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    os.chown(tmp_path / "alice", 4242, 4242)
    done = _install(tmp_path / "root", "--python", str(python))
    assert done.returncode == 0, done.stderr
    assert f"hostd install: WARNING: {tmp_path / 'alice'} owned by uid 4242, not root" in done.stderr, done.stderr
    assert "can run anything as root" in done.stderr and "root-owned virtual environment" in done.stderr


def test_install_under_tmp_keeps_the_services_able_to_see_it(tmp_path: Path):
    root = tmp_path / "root"
    subprocess.run([sys.executable, "-m", "hostd.main", "install", "--root", str(root), "--no-reload",
                    "--python", "/tmp/ci/.venv/bin/python"], capture_output=True, text=True, check=True)
    unit = (root / "usr/local/lib/systemd/system/model-weights@.service").read_text()
    assert "PrivateTmp=no" in unit and "Environment=TMPDIR=%C/hostd/%i" in unit
    assert "PrivateTmp=yes" not in unit


def test_installed_wheel_finds_its_data_files_under_the_prefix_not_in_site_packages(tmp_path: Path, monkeypatch):
    """The bug of a regular `pip install`: site-packages holds the PyPI library
    `packaging/`, which is not hostd's; the wheel's files are in <prefix>/share/hostd."""
    from hostd import install

    site = tmp_path / "lib/python3/site-packages"
    (site / "packaging").mkdir(parents=True)
    (site / "units").mkdir()
    share = tmp_path / "share/hostd/packaging"
    share.mkdir(parents=True)
    (share / "hardening.conf").write_text("UMask=0077\n")
    monkeypatch.setattr(install, "CHECKOUT", site)
    monkeypatch.setattr(install.sys, "prefix", str(tmp_path))
    assert install.data_dir("packaging") == share
    assert install.docs_dir() == str(tmp_path / "share/doc/hostd")
    monkeypatch.setattr(install.sys, "prefix", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="reinstall hostd"):
        install.data_dir("units")


def _listen_streams(out: Path, name: str) -> list[str]:
    text = (out / f"model@{name}.socket.d/50-hostd.conf").read_text()
    return [line for line in text.splitlines() if line.startswith("ListenStream=")]


def test_a_running_models_socket_address_survives_a_broken_dropin_and_a_changed_listen(tmp_path: Path, capsys,
                                                                                       monkeypatch):
    """systemd closes a running socket unit's descriptors when a daemon-reload
    changes its ListenStream=: the generator must write the same address while
    the socket runs, whatever the config says meanwhile."""
    etc, state, run = tmp_path / "etc", tmp_path / "state", tmp_path / "run"
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(run))
    model(etc, "m", "backend: builtin\nmodel: /m\nlisten: 127.0.0.1:8001\n")

    def reload() -> str:
        out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
        generator.generate(out, Path("/etc/systemd/system"), etc, state=state)
        return (out / "model@m.socket.d/50-hostd.conf").read_text(), _listen_streams(out, "m")

    first, listen = reload()
    assert listen == ["ListenStream=127.0.0.1:8001"]
    (run / "m").mkdir(parents=True)  # model@m.socket started: its RuntimeDirectory= exists

    (etc / "models/m.d").mkdir()
    (etc / "models/m.d/70-broken.yaml").write_text("engine: {max_num_seqs: [\n")
    broken, listen = reload()
    assert listen == ["ListenStream=127.0.0.1:8001"]  # not invalid-config.sock
    assert "ExecStartPre=/bin/false" in broken and "70-broken.yaml" in broken  # its next start still fails

    (etc / "models/m.d/70-broken.yaml").unlink()
    again, _ = reload()
    assert again == first

    model(etc, "m", "backend: builtin\nmodel: /m\nlisten: 127.0.0.1:8002\n")
    capsys.readouterr()
    _, listen = reload()
    assert listen == ["ListenStream=127.0.0.1:8001"]
    assert "listen: changed from '127.0.0.1:8001' to '127.0.0.1:8002'" in capsys.readouterr().err

    (run / "m").rmdir()  # the model was stopped: the next start takes the new address
    _, listen = reload()
    assert listen == ["ListenStream=127.0.0.1:8002"]


def test_standby_true_makes_the_umbrella_want_the_standby_engine_with_the_models_user_and_gpus(tmp_path: Path,
                                                                                               monkeypatch):
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(MinorIsIndex))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "warm", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [1]\nstandby: true\n")
    model(etc, "cold", "backend: builtin\nmodel: /m\n")

    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["cold", "warm"]

    assert (out / "model@warm.service.d/50-hostd-standby.conf").read_text().endswith(
        "[Unit]\nWants=model-engine-standby@warm.service\n")
    standby = (out / "model-engine-standby@warm.service.d/50-hostd.conf").read_text()
    assert "User=hostd-warm\nGroup=hostd-warm" in standby
    assert "Environment=CUDA_VISIBLE_DEVICES=1" in standby and "DeviceAllow=/dev/nvidia1 rw" in standby
    # Without standby: the unit's drop-in exists (it runs as the model's
    # user), nothing wants it, and its start is skipped.
    assert not (out / "model@cold.service.d/50-hostd-standby.conf").exists()
    assert (out / "model-engine-standby@cold.service.d/50-hostd.conf").exists()
    assert (out / "model-engine-standby@cold.service.d/50-hostd-standby.conf").read_text().endswith(
        "[Service]\nExecCondition=/bin/false\n")
    assert not (out / "model-engine-standby@warm.service.d/50-hostd-standby.conf").exists()


def test_spare_true_wants_the_spare_with_the_engines_user_environment_and_a_delegated_engine(tmp_path: Path,
                                                                                              monkeypatch):
    """The forked engine keeps the spare's environment: both units get the
    same generated lines; the engine alone is delegated (AttachProcessesToUnit
    needs it), and only with spare: true."""
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(MinorIsIndex))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "quick", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [1]\nspare: true\n")
    model(etc, "plain", "backend: builtin\nmodel: /m\n")
    generator.generate(out, Path("/etc/systemd/system"), etc)
    assert (out / "model@quick.service.d/50-hostd-spare.conf").read_text().endswith(
        "[Unit]\nWants=model-engine-spare@quick.service\n")
    spare = (out / "model-engine-spare@quick.service.d/50-hostd.conf").read_text()
    engine = (out / "model-engine@quick.service.d/50-hostd.conf").read_text()
    assert engine.replace("Delegate=yes\n", "") == spare
    assert "Delegate=yes" in engine and "Environment=CUDA_VISIBLE_DEVICES=1" in spare
    assert not (out / "model-engine-spare@quick.service.d/50-hostd-spare.conf").exists()
    assert not (out / "model@plain.service.d/50-hostd-spare.conf").exists()
    assert "Delegate" not in (out / "model-engine@plain.service.d/50-hostd.conf").read_text()
    assert (out / "model-engine-spare@plain.service.d/50-hostd-spare.conf").read_text().endswith(
        "[Service]\nExecCondition=/bin/false\n")


def test_a_standby_removed_from_the_yaml_is_stopped_by_the_next_restart_of_the_model(tmp_path: Path):
    """standby: true, then removed, then daemon-reload (the generator runs
    again): the umbrella no longer wants the standby, and the standby's own
    drop-in skips its start, so `systemctl restart model@NAME`, which
    restarts it as PartOf= the model, leaves it stopped."""
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "warm", "backend: builtin\nmodel: /m\nstandby: true\n")
    generator.generate(out, Path("/etc/systemd/system"), etc)
    assert (out / "model@warm.service.d/50-hostd-standby.conf").exists()
    assert not (out / "model-engine-standby@warm.service.d/50-hostd-standby.conf").exists()
    model(etc, "warm", "backend: builtin\nmodel: /m\n")
    shutil.rmtree(out)  # systemd empties the output directory before each run
    generator.generate(out, Path("/etc/systemd/system"), etc)
    assert not (out / "model@warm.service.d/50-hostd-standby.conf").exists()
    off = (out / "model-engine-standby@warm.service.d/50-hostd-standby.conf").read_text()
    assert "ExecCondition=/bin/false" in off and "SourcePath=" in off


def test_a_unix_metrics_listener_gets_its_directory_writable_in_the_gateways_sandbox(tmp_path: Path):
    """gateway.metrics_listen is bound by the gateway, inside ProtectSystem=strict:
    a Unix socket's directory is opened with ReadWritePaths= ('-': a missing one
    fails the bind, naming the key); a loopback port needs no setting."""
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "unix", "backend: builtin\nmodel: /m\ngateway: {metrics_listen: /run/hostd-metrics/unix.sock}\n")
    model(etc, "tcp", "backend: builtin\nmodel: /m\ngateway: {metrics_listen: '127.0.0.1:9101'}\n")
    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["tcp", "unix"]
    assert "ReadWritePaths=-/run/hostd-metrics\n" in (out / "model@unix.service.d/50-hostd.conf").read_text()
    assert "ReadWritePaths" not in (out / "model@tcp.service.d/50-hostd.conf").read_text()
    assert not any("9101" in p.read_text() or "hostd-metrics" in p.read_text()
                   for p in out.rglob("*.socket.d/*.conf"))  # systemd does not listen there


def test_a_metrics_token_reaches_the_gateway_as_its_own_credential(tmp_path: Path):
    """gateway.metrics_token (issue 55, item 5) is a credential beside the API
    keys, so the model's user reads it without access to root's file."""
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "fleet", "backend: builtin\nmodel: /m\ngateway: {api_keys: /etc/hostd/keys/fleet, "
                        "metrics_listen: '0.0.0.0:9101', metrics_token: /etc/hostd/keys/fleet-metrics}\n")
    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["fleet"]
    gateway = (out / "model@fleet.service.d/50-hostd.conf").read_text()
    assert "LoadCredential=api-keys:/etc/hostd/keys/fleet\n" in gateway
    assert "LoadCredential=metrics-token:/etc/hostd/keys/fleet-metrics\n" in gateway


def test_models_pinned_to_different_gpus_each_allow_only_their_own_gpus_minor(tmp_path: Path, monkeypatch):
    """Two models on one host, `gpus: [0]` and `gpus: [1]`: every unit of one
    (weights, engine, next, standby) may open its own GPU's /dev node and
    not the other's. NVML's minors are not the indices here (GPU 0 is
    /dev/nvidia1, GPU 1 is /dev/nvidia0), as on hosts whose driver probed
    the cards in another order."""
    minors = {0: 1, 1: 0}

    class TwoGpus:
        nvmlDeviceGetCount = staticmethod(lambda: 2)
        nvmlDeviceGetHandleByIndex = staticmethod(lambda index: ("handle", index))
        nvmlDeviceGetMinorNumber = staticmethod(lambda handle: minors[handle[1]])
        nvmlDeviceGetUUID = staticmethod(lambda handle: f"GPU-{handle[1]}")

    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(TwoGpus))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "left", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [0]\nlisten: 127.0.0.1:8001\n")
    model(etc, "right", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [1]\nlisten: 127.0.0.1:8002\n")

    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["left", "right"]

    for name, index, own, other in (("left", 0, 1, 0), ("right", 1, 0, 1)):
        for unit in (f"model-weights@{name}", f"model-engine@{name}", f"model-engine-next@{name}",
                     f"model-engine-standby@{name}"):
            text = (out / f"{unit}.service.d/50-hostd.conf").read_text()
            nodes = [line for line in text.splitlines() if line.startswith("DeviceAllow=/dev/nvidia")
                     and line.split()[0].removeprefix("DeviceAllow=/dev/nvidia").isdigit()]
            assert nodes == [f"DeviceAllow=/dev/nvidia{own} rw"], (unit, text)
            assert f"DeviceAllow=/dev/nvidia{other} rw" not in text, (unit, text)
            assert "char-nvidia-frontend" not in text, (unit, text)  # never every GPU
            assert f"Environment=CUDA_VISIBLE_DEVICES={index}\n" in text, (unit, text)
        # The gateway opens no GPU at all.
        assert "DeviceAllow" not in (out / f"model@{name}.service.d/50-hostd.conf").read_text()


WHOLE = "GPU-8f3e1a2b-0000-4000-8000-000000000001"  # GPU 1, /dev/nvidia5
SLICE = "MIG-5a1b2c3d-0000-4000-8000-00000000abcd"  # a slice of GPU 1: GPU instance 3, compute instance 0


class MigHost:
    """pynvml on a host with GPUs 0 and 1 (/dev/nvidia4 and /dev/nvidia5),
    GPU 1 in MIG mode with one slice, SLICE."""

    class NVMLError_NotFound(Exception):  # pynvml's name for NVML_ERROR_NOT_FOUND
        pass

    nvmlDeviceGetCount = staticmethod(lambda: 2)
    nvmlDeviceGetHandleByIndex = staticmethod(lambda index: f"gpu{index}")
    nvmlDeviceGetMinorNumber = staticmethod(lambda handle: {"gpu0": 4, "gpu1": 5}[handle])
    nvmlDeviceGetIndex = staticmethod(lambda handle: int(handle[-1]))
    nvmlDeviceGetUUID = staticmethod(lambda handle: {"gpu0": "GPU-0", "gpu1": WHOLE, "slice": SLICE}[handle].encode())
    nvmlDeviceGetDeviceHandleFromMigDeviceHandle = staticmethod(lambda handle: "gpu1")
    nvmlDeviceGetGpuInstanceId = staticmethod(lambda handle: 3)
    nvmlDeviceGetComputeInstanceId = staticmethod(lambda handle: 0)

    @classmethod
    def nvmlDeviceGetHandleByUUID(cls, uuid: bytes):
        known = {WHOLE: "gpu1", SLICE: "slice"}
        if uuid.decode() not in known:
            raise cls.NVMLError_NotFound("Not Found")
        return known[uuid.decode()]


def mig_capabilities(root: Path) -> Path:
    """The driver's /proc/driver/nvidia/capabilities for SLICE: its GPU
    instance's device is nvidia-cap39, its compute instance's nvidia-cap40."""
    for path, minor in (("gpu5/mig/gi3/access", 39), ("gpu5/mig/gi3/ci0/access", 40)):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    return root


def test_gpus_by_uuid_and_mig_slice_get_their_gpus_node_and_the_slices_capabilities(tmp_path: Path, monkeypatch):
    """Issue 55, item 3: a whole GPU by its UUID allows its /dev node as its
    index would; a MIG slice allows its parent's node and its own two
    capability devices and no other (no char-nvidia-caps); CUDA gets the
    names as written. Without the driver's capability files the slice's
    model keeps every capability device readable, and the log says so."""
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(MigHost))
    monkeypatch.setattr(generator.nvml, "MIG_CAPABILITIES", mig_capabilities(tmp_path / "caps"))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "whole", f"backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [{WHOLE}]\nlisten: 127.0.0.1:8001\n")
    model(etc, "slice", f"backend: builtin\nmodel: /m\ndevice: cuda\ngpus: ['{SLICE}']\nlisten: 127.0.0.1:8002\n")
    model(etc, "vllm", f"backend: vllm\nmodel: /m\ngpus: [{WHOLE}]\nlisten: 127.0.0.1:8003\n")

    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["slice", "vllm", "whole"]

    def lines(unit: str) -> list[str]:
        return (out / f"{unit}.service.d/50-hostd.conf").read_text().splitlines()

    for unit in ("model-weights@whole", "model-engine@whole", "model-engine-standby@whole", "model-engine@vllm"):
        assert "DeviceAllow=/dev/nvidia5 rw" in lines(unit) and "DeviceAllow=/dev/nvidia4 rw" not in lines(unit)
        assert f"Environment=CUDA_VISIBLE_DEVICES={WHOLE}" in lines(unit)
        assert "DeviceAllow=char-nvidia-caps r" in lines(unit)
    for unit in ("model-weights@slice", "model-engine@slice", "model-engine-next@slice"):
        allowed = [line for line in lines(unit) if line.startswith("DeviceAllow=")]
        assert "DeviceAllow=/dev/nvidia5 rw" in allowed and "DeviceAllow=/dev/nvidia4 rw" not in allowed
        assert [line for line in allowed if "caps" in line] == [
            "DeviceAllow=/dev/nvidia-caps/nvidia-cap39 r", "DeviceAllow=/dev/nvidia-caps/nvidia-cap40 r"]
        assert f"Environment=CUDA_VISIBLE_DEVICES={SLICE}" in lines(unit)
        assert "DeviceAllow=char-nvidia-frontend rw" not in allowed

    # The gateway opens no GPU; its metrics name them (hostd_gpu_info).
    gateway = lines("model@whole")
    assert f"Environment=HOSTD_GPUS=1/{WHOLE}//" in gateway and not [x for x in gateway if "DeviceAllow" in x]
    assert f"Environment=HOSTD_GPUS=1/{WHOLE}/{SLICE}/3" in lines("model@slice")

    monkeypatch.setattr(generator.nvml, "MIG_CAPABILITIES", tmp_path / "absent")
    generator.generate(out, Path("/etc/systemd/system"), etc)
    assert "DeviceAllow=char-nvidia-caps r" in lines("model-engine@slice")


def test_a_uuid_the_host_lacks_fails_the_start_naming_it(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(MigHost))
    etc, out = tmp_path / "etc", tmp_path / "out"
    gone = "GPU-00000000-0000-4000-8000-000000000000"
    model(etc, "gone", f"backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [1, {gone}]\n")

    assert generator.generate(out, Path("/etc/systemd/system"), etc) == []

    socket = (out / "model@gone.socket.d/50-hostd.conf").read_text()
    assert f"gpus: [1, '{gone}']: NVML knows no GPU or MIG device {gone} on this host" in socket, socket
    assert "ExecStartPre=/bin/false" in socket
    assert not (out / "model-weights@gone.service.d").exists()
    assert "skipping model 'gone'" in capsys.readouterr().err


def test_gpus_refuses_what_is_neither_an_index_nor_a_uuid(tmp_path: Path):
    from hostd import config

    for bad, said in (("[GPU-1234]", "gpus.0: 'GPU-1234' is neither a GPU index nor a UUID"),
                      ("[-1]", "gpus.0: expected `int` >= 0"),
                      ("[0, 'MIG-xyz']", "gpus.1: 'MIG-xyz' is neither")):
        model(tmp_path, "bad", f"backend: builtin\nmodel: /m\ngpus: {bad}\n")
        with pytest.raises(Exception) as err:
            config.load_model("bad", tmp_path)
        assert said in str(err.value) and "bad.yaml" in str(err.value), str(err.value)


def test_uuids_are_kept_in_nvmls_lower_case_and_a_mig_slice_stands_alone(tmp_path: Path):
    """NVML and CUDA know a UUID by its lower-case hex (nvidia-smi prints it
    so); a CUDA process uses one MIG slice and nothing besides."""
    from hostd import config

    model(tmp_path, "upper", f"backend: builtin\nmodel: /m\ngpus: [{WHOLE.upper().replace('GPU-', 'GPU-')}]\n")
    assert config.load_model("upper", tmp_path).config.gpus == [WHOLE]
    for mixed in (f"[0, '{SLICE}']", f"['{SLICE}', '{SLICE[:-1]}e']"):
        model(tmp_path, "mixed", f"backend: builtin\nmodel: /m\ngpus: {mixed}\n")
        with pytest.raises(Exception) as err:
            config.load_model("mixed", tmp_path)
        assert "a CUDA process uses one MIG slice and nothing besides" in str(err.value), str(err.value)


def test_an_nvml_error_other_than_not_found_is_no_missing_gpu_the_generator_allows_every_gpu(
        tmp_path: Path, monkeypatch, capsys):
    """Only NVML_ERROR_NOT_FOUND means the host lacks the UUID; any other
    NVML error (a driver that lost the GPU, no permission) is NVML's own:
    the model keeps working on every NVIDIA device, and the log says why."""
    class Broken(MigHost):
        @classmethod
        def nvmlDeviceGetHandleByUUID(cls, uuid: bytes):
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    monkeypatch.setattr(generator.nvml, "session", lambda: contextlib.nullcontext(Broken))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "lost", f"backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [{WHOLE}]\n")
    assert generator.generate(out, Path("/etc/systemd/system"), etc) == ["lost"]
    assert "DeviceAllow=char-nvidia-frontend rw" in (out / "model-engine@lost.service.d/50-hostd.conf").read_text()
    assert "NVML_ERROR_GPU_IS_LOST" in capsys.readouterr().err
