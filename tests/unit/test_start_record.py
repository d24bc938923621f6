"""hostd.manager.start_record, as model-weights@NAME's ExecStartPre= runs it
(as root, before the weight daemon starts): it records the config on disk
the start reads, in the manager's records, and never fails the start."""

from __future__ import annotations

from pathlib import Path

from hostd.manager import start_record
from hostd.manager.records import Records


def setup(tmp_path: Path, monkeypatch, yaml: str) -> Records:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (tmp_path / "etc/models").mkdir(parents=True)
    (tmp_path / "etc/models/tiny.yaml").write_text(yaml.format(checkpoint=checkpoint))
    monkeypatch.setenv("HOSTD_CONFIG_DIR", str(tmp_path / "etc"))
    monkeypatch.setenv("HOSTD_STATE_DIR", str(tmp_path / "state"))
    return Records(tmp_path / "state/.manager")


def test_a_start_records_the_config_on_disk_and_it_is_newer_than_the_last_commit(tmp_path, monkeypatch):
    records = setup(tmp_path, monkeypatch, "backend: builtin\nmodel: {checkpoint}\ndevice: cpu\n"
                                           "gateway: {{retry_after: 7}}\n")
    records.write_committed("tiny", _config_with(tmp_path, retry_after=5), weights=(7, 8))
    assert start_record.main(["tiny"]) == 0
    started = records.started("tiny")
    assert started.fixed["gateway"]["retry_after"] == 7 and started.fixed["model"] == str(tmp_path / "checkpoint")
    assert records.running("tiny", weights=(1007, 1008)) == started  # the newer record says what runs


def test_a_config_that_does_not_load_writes_nothing_and_never_fails_the_start(tmp_path, monkeypatch, capsys):
    records = setup(tmp_path, monkeypatch, "backend: builtin\nmodel: {checkpoint}\ndevice: cpu\nnot_a_key: 1\n")
    assert start_record.main(["tiny"]) == 0
    assert records.started("tiny") is None
    err = capsys.readouterr().err
    assert "model tiny: no start record written" in err and "not_a_key" in err, err
    assert start_record.main([]) == 2  # usage


def test_without_a_start_record_a_commit_older_than_the_daemon_says_nothing(tmp_path, monkeypatch):
    """Units of an older hostd wrote no start record: a committed record from
    before another weight daemon started is not what runs (None: not held to it)."""
    records = setup(tmp_path, monkeypatch, "backend: builtin\nmodel: {checkpoint}\ndevice: cpu\n")
    records.write_committed("tiny", _config_with(tmp_path, retry_after=5), weights=(7, 8))
    assert records.running("tiny", weights=(7, 8)).fixed["gateway"]["retry_after"] == 5
    assert records.running("tiny", weights=(1007, 1008)) is None


def _config_with(tmp_path: Path, retry_after: int):
    from hostd import config

    text = (tmp_path / "etc/models/tiny.yaml").read_text()
    (tmp_path / "etc/models/tiny.d").mkdir(exist_ok=True)
    (tmp_path / "etc/models/tiny.d/10-t.yaml").write_text(f"gateway: {{retry_after: {retry_after}}}\n")
    try:
        return config.load_model("tiny", tmp_path / "etc").config
    finally:
        (tmp_path / "etc/models/tiny.d/10-t.yaml").unlink()
        assert (tmp_path / "etc/models/tiny.yaml").read_text() == text
