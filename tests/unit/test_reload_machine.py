"""The reload state machine's table and the pieces of a reload that need no
daemon: the loader's overlay that previews 90-reload.yaml (load_model, which
reload.target_config asks), hostctl's KEY=VALUE parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostd import config
from hostd.hostctl_bus import parse_assignments
from hostd.manager import errors
from hostd.manager import reload as R
from hostd.manager import strategies
from hostd.manager.operation import Operation, Stage, State


def test_every_stage_is_reachable_and_every_path_ends_finished():
    every = set()
    for strategy in strategies.STRATEGIES.values():
        table = strategy.transitions
        seen, todo = set(), [Stage.VALIDATE]
        while todo:
            stage = todo.pop()
            if stage in seen:
                continue
            seen.add(stage)
            todo.extend(table[stage])
        assert set(strategy.stages) <= seen, strategy
        assert table[Stage.FINISHED] == set()
        for stage in seen - {Stage.FINISHED}:
            assert table[stage], f"{strategy}: {stage} is a dead end"
        every |= seen
    assert every == set(Stage)


def test_a_transition_outside_the_table_is_a_bug():
    op = Operation(id=1, model="tiny", patch={})
    op.enter(Stage.PREFLIGHT)
    op.strategy = strategies.RESTART
    with pytest.raises(RuntimeError, match="preflight -> restart"):
        op.enter(Stage.RESTART)
    op.enter(Stage.RECORD)
    op.enter(Stage.DRAIN)
    op.enter(Stage.RESTORE)
    op.finish(State.CANCELLED, "cancelled")
    assert op.stage == Stage.FINISHED and op.state == State.CANCELLED and op.finished > 0


def test_overlay_previews_the_reload_dropin_in_its_lexical_place(tmp_path: Path):
    (tmp_path / "models/tiny.d").mkdir(parents=True)
    (tmp_path / "models/tiny.yaml").write_text("backend: builtin\nmodel: /m\n")
    (tmp_path / "models/tiny.d/95-override.yaml").write_text("engine: {max_model_len: 64}\n")
    loaded = config.load_model("tiny", tmp_path, overlay=("90-reload.yaml", "engine: {max_num_seqs: 3, max_model_len: 32}\n"))
    assert loaded.config.engine.max_num_seqs == 3
    assert loaded.config.engine.max_model_len == 64  # 95-override comes after 90-reload
    assert loaded.origin(("engine", "max_model_len")) == str(tmp_path / "models/tiny.d/95-override.yaml")
    assert loaded.origin(("engine", "max_num_seqs")) == str(tmp_path / "models/tiny.d/90-reload.yaml")
    assert not (tmp_path / "models/tiny.d/90-reload.yaml").exists()  # nothing written
    assert config.load_model("tiny", tmp_path).config.engine.max_num_seqs == 8


def test_an_overlay_meets_the_rules_of_a_file_on_disk_with_its_own_line(tmp_path: Path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models/tiny.yaml").write_text("backend: builtin\nmodel: /m\n")
    reload_file = f"{tmp_path}/models/tiny.d/90-reload.yaml"
    for content, problem in [
        ("# the patch\nengine:\n  max_num_seqs: 0\n", f"{reload_file}:3: engine.max_num_seqs: expected `int` >= 1"),
        ("engine: {max_num_seqs: 2, max_num_seqs: 3}\n", f"{reload_file}:1: engine.max_num_seqs: duplicate key"),
        (b"engine: {}\n# \xff\n", f"{reload_file}: not UTF-8 text"),
        ("#" * config.load.MAX_FILE_BYTES + "\n", f"{reload_file}: larger than {config.load.MAX_FILE_BYTES} bytes"),
    ]:
        with pytest.raises(config.ConfigError) as caught:
            config.load_model("tiny", tmp_path, overlay=("90-reload.yaml", content))
        assert str(caught.value).startswith(problem), (content[:40], str(caught.value))
    with pytest.raises(ValueError, match="not a drop-in file name"):
        config.load_model("tiny", tmp_path, overlay=("90-reload.yml", "{}"))


def test_config_with_reports_the_patchs_problem_beside_an_unreadable_dropin(tmp_path: Path):
    """reload.target_config is load_model with the overlay: the patch's value is
    checked even when another drop-in cannot be read (the manager's cached
    parse predates it), and both problems are named, as the loader names them."""
    (tmp_path / "models/tiny.d").mkdir(parents=True)
    (tmp_path / "models/tiny.yaml").write_text("backend: builtin\nmodel: /m\n")
    broken = tmp_path / "models/tiny.d/50-broken.yaml"
    broken.write_text("engine: [\n")
    run = R.Reload(R.ModelHandles("tiny", tmp_path, systemd=None, probe=None), Operation(id=1, model="tiny", patch={}))
    with pytest.raises(errors.InvalidValue) as caught:
        R.target_config(run.model, "engine:\n  max_num_seqs: 0\n", {"max_num_seqs": 0})
    assert f"{broken}:2: malformed YAML" in str(caught.value)
    assert "engine.max_num_seqs: expected `int` >= 1" in str(caught.value)
    assert not (tmp_path / "models/tiny.d/90-reload.yaml").exists()


def test_hostctl_assignments_are_yaml_scalars():
    assert parse_assignments(["max_num_seqs=16", "gpu_memory_utilization=0.5", "enforce_eager=true",
                              "max_model_len=null"]) == {
        "max_num_seqs": 16, "gpu_memory_utilization": 0.5, "enforce_eager": True, "max_model_len": None}
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        parse_assignments(["max_num_seqs"])
