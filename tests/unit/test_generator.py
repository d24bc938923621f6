"""hostd-generator's output for a good, a broken and an autostart model, and
`hostd install --root` / `uninstall` putting files in place and taking them away."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hostd import generator


def model(root: Path, name: str, text: str) -> None:
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "models" / f"{name}.yaml").write_text(text)


def test_generator_writes_dropins_for_good_models_and_skips_broken_ones(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.setattr(generator, "nvml_minor_numbers", lambda indices: list(indices))
    etc, out = tmp_path / "etc", tmp_path / "out"
    model(etc, "good", "backend: builtin\nmodel: /m\nlisten: '[::1]:8001'\ntimeouts: {start: 60, stop: 30}\n")
    model(etc, "gpu", "backend: builtin\nmodel: /m\ndevice: cuda\ngpus: [2, 3]\nautostart: true\n")
    model(etc, "broken", "backend: builtin\nmodel: [\n")

    names = generator.generate(out, Path("/etc/systemd/system"), etc)

    assert names == ["good", "gpu"]
    assert "skipping model 'broken'" in capsys.readouterr().err
    assert not any("broken" in p.name for p in out.rglob("*"))
    assert (out / "model@good.socket.d/50-hostd.conf").read_text().endswith("[Socket]\nListenStream=[::1]:8001\n")
    engine = (out / "model-engine@good.service.d/50-hostd.conf").read_text()
    assert "TimeoutStartSec=60\nTimeoutStopSec=30" in engine and "DeviceAllow" not in engine
    gpu = (out / "model-weights@gpu.service.d/50-hostd.conf").read_text()
    assert "Environment=CUDA_VISIBLE_DEVICES=2,3" in gpu
    assert "DeviceAllow=/dev/nvidia2 rw" in gpu and "DeviceAllow=/dev/nvidia3 rw" in gpu
    assert "DeviceAllow=/dev/nvidiactl rw" in gpu
    link = out / "multi-user.target.wants/model@gpu.service"
    assert link.is_symlink() and os.readlink(link) == "/etc/systemd/system/model@.service"
    assert not (out / "multi-user.target.wants/model@good.service").exists()


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
    unit = (root / "etc/systemd/system/model-engine@.service").read_text()
    assert f"ExecStart={sys.executable} -m hostd.main engine %i" in unit
    assert "BindsTo=model-weights@%i.service" in unit and "@" + "USER@" not in unit
    assert os.access(root / "etc/systemd/system-generators/hostd-generator", os.X_OK)
    for path in ("etc/sysusers.d/hostd.conf", "etc/tmpfiles.d/hostd.conf",
                 "etc/dbus-1/system.d/org.hostd1.conf", "etc/hostd/hostd.yaml"):
        assert (root / path).is_file(), path

    run("uninstall")
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == ["etc/hostd/hostd.yaml"]  # configuration stays unless --purge
    run("uninstall", "--purge")
    assert not (root / "etc/hostd").exists()


def test_install_under_tmp_keeps_the_services_able_to_see_it(tmp_path: Path):
    root = tmp_path / "root"
    subprocess.run([sys.executable, "-m", "hostd.main", "install", "--root", str(root), "--no-reload",
                    "--python", "/tmp/ci/.venv/bin/python"], capture_output=True, text=True, check=True)
    unit = (root / "etc/systemd/system/model-weights@.service").read_text()
    assert "PrivateTmp=no" in unit and "Environment=TMPDIR=%C/hostd/%i" in unit
    assert "PrivateTmp=yes" not in unit
