"""What root writes and reads from a model's config: strings that reach unit
files carry no control characters, config files are regular files, and a GPU's
device node is the one NVML names (issue 12, rows 5, 8 and 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest

from hostd import config, generator
from hostd.config import schema


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
    assert not any("ExecStartPre" in p.read_text() for p in out.rglob("*.conf"))


def test_generator_escapes_specifiers_in_values():
    cfg = msgspec.convert({"backend": "builtin", "model": "/m", "listen": "/run/a%ib.sock"},
                          schema.BuiltinModel)
    socket_dropin = generator.dropins("m", cfg)["model@m.socket.d/50-hostd.conf"]
    assert "ListenStream=/run/a%%ib.sock\n" in socket_dropin
    with pytest.raises(ValueError, match="control character"):
        generator.unit_value("a\nb")


# ------------------------------------------------------------ row 8


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
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetMinorNumber=lambda handle: minors[handle[1]],
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
