"""hostd.yaml's log_level is read by the processes that log: each daemon's
root logger takes it once the config is loaded (it was documented, and no
process read it: issue 27)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from hostd import backends, dispatch, logs


class LevelSeen(backends.builtin.BuiltinBackend):
    """The builtin backend, except that running the engine answers the level
    the root logger had by then instead of starting one."""

    def check(self, cfg, model_config=None) -> None:
        pass

    def run_engine(self, args, cfg) -> int:
        return logging.getLogger().level

    run_weights = run_engine


@pytest.mark.parametrize("role", ["engine", "weights"])
@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_the_engine_and_weights_daemons_log_at_hostd_yamls_level(role, level, tmp_path: Path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "hostd.yaml").write_text(f"log_level: {level}\n")
    (tmp_path / "models/m.yaml").write_text(f"backend: builtin\nmodel: {tmp_path}\n")
    monkeypatch.setattr(backends, "for_config", lambda cfg: LevelSeen())
    args = argparse.Namespace(name="m", config_dir=str(tmp_path))
    try:
        assert dispatch.run(role, args) == getattr(logging, level.upper())
    finally:
        logging.getLogger().setLevel(logging.INFO)


def test_the_levels_hostd_yaml_accepts_are_the_levels_a_signal_sets():
    import typing

    from hostd.config import schema
    from hostd.logs import LEVEL_SIGNALS

    assert set(LEVEL_SIGNALS) == set(typing.get_args(schema.LogLevel))
    assert len({logs.level_signal(level) for level in LEVEL_SIGNALS}) == len(LEVEL_SIGNALS)


def test_a_running_process_takes_a_new_level_from_its_signal_and_says_so_while_info_shows(caplog):
    """hostctl log-level's mechanism (Model.SetLogLevel: systemd's KillUnit
    to the unit's main process): the process's own handler, installed by
    logs.setup, sets its root logger's level; the line that says so is
    written before a rise above info and after a drop to it or below, so it
    is in the journal either way."""
    import os

    logs.listen_for_levels()
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    try:
        os.kill(os.getpid(), logs.level_signal("debug"))
        assert root.level == logging.DEBUG
        os.kill(os.getpid(), logs.level_signal("error"))
        assert root.level == logging.ERROR
        os.kill(os.getpid(), logs.level_signal("info"))
        assert root.level == logging.INFO
        assert [r.getMessage() for r in caplog.records if r.name == "hostd.logs"] == [
            "log level debug (was info), set by a signal (hostctl log-level)",
            "log level error (was debug), set by a signal (hostctl log-level)",
            "log level info (was error), set by a signal (hostctl log-level)",
        ]
    finally:
        root.setLevel(logging.INFO)
