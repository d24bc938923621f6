"""hostd.yaml's log_level is read by the processes that log: each daemon's
root logger takes it once the config is loaded (it was documented, and no
process read it: issue 27)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from hostd import backends, dispatch


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
