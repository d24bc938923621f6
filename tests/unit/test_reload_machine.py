"""The reload state machine's table and the pieces of a reload that need no
daemon: the overlay that previews 90-reload.yaml, hostctl's KEY=VALUE parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostd import config
from hostd.config.load import merge_model, validate, model_type
from hostd.hostctl import parse_assignments
from hostd.manager.operation import TRANSITIONS, Operation, Stage, State


def test_every_stage_is_reachable_and_every_path_ends_finished():
    seen, todo = set(), [Stage.VALIDATE]
    while todo:
        stage = todo.pop()
        if stage in seen:
            continue
        seen.add(stage)
        todo.extend(TRANSITIONS[stage])
    assert seen == set(Stage)
    assert TRANSITIONS[Stage.FINISHED] == set()
    for stage in set(Stage) - {Stage.FINISHED}:
        assert TRANSITIONS[stage], f"{stage} is a dead end"


def test_a_transition_outside_the_table_is_a_bug():
    op = Operation(id=1, model="tiny", patch={})
    op.enter(Stage.PREFLIGHT)
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
    merged, problems = merge_model("tiny", tmp_path, overlay={"90-reload.yaml": {"engine": {"max_num_seqs": 3, "max_model_len": 32}}})
    cfg = validate(merged, model_type(merged))
    assert problems == []
    assert cfg.engine.max_num_seqs == 3
    assert cfg.engine.max_model_len == 64  # 95-override comes after 90-reload
    assert merged.origin(("engine", "max_model_len")) == str(tmp_path / "models/tiny.d/95-override.yaml")
    assert not (tmp_path / "models/tiny.d/90-reload.yaml").exists()  # nothing written
    assert config.load_model("tiny", tmp_path).config.engine.max_num_seqs == 8


def test_hostctl_assignments_are_yaml_scalars():
    assert parse_assignments(["max_num_seqs=16", "gpu_memory_utilization=0.5", "enforce_eager=true",
                              "max_model_len=null"]) == {
        "max_num_seqs": 16, "gpu_memory_utilization": 0.5, "enforce_eager": True, "max_model_len": None}
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        parse_assignments(["max_num_seqs"])
