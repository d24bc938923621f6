"""The in-place strategy (reload.strategy: in-place), driven with the fake
systemd and probe of reload_fakes.py: a limit change rebuilds the main engine
in its own process (no unit starts or stops, no drain, no switch), a warm
standby follows the same way; a refused rebuild rolls back with the engine's
words and the old runner serving; what cannot be applied in place (another
backend, no room for the new KV cache beside the old) runs as under overlap
and the Operation says why; recovery after a manager crash rebuilds in
place rather than restarting."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd import units  # noqa: E402
from hostd.config import schema  # noqa: E402
from hostd.engine.health import EngineHealth  # noqa: E402
from hostd.manager import errors, preflight  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.operation import Stage  # noqa: E402
from hostd.manager.strategies import IN_PLACE  # noqa: E402

MAIN = units.engine("tiny")
STANDBY = units.engine("tiny", "standby")


def run(coro):
    return asyncio.run(coro)


def jobs(world: World) -> list[str]:
    return [f"{verb} {unit}" for verb, unit in world.bus.job_log]


def stages_seen(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = R.Operation.enter

    def enter(op, stage):
        seen.append(stage.value)
        return real(op, stage)
    monkeypatch.setattr(R.Operation, "enter", enter)
    return seen


def test_a_limit_change_rebuilds_the_main_engine_in_place_and_starts_no_process(tmp_path, monkeypatch):
    world = World(tmp_path, strategy="in-place")
    seen = stages_seen(monkeypatch)
    op = run(world.reload({"max_num_seqs": 4, "kv_cache_mib": 8}))
    assert (op.state, op.strategy_name, op.error, op.weights_reused) == (R.State.DONE, "in-place", "", True)
    assert seen == ["preflight", "record", "rebuild", "verify", "commit", "finished"]
    assert jobs(world) == []  # no unit started, stopped or restarted
    calls = world.probe.calls
    assert "drain" not in calls and not any(c.startswith(("switch", "resume")) for c in calls)  # never a 503
    assert calls.index("rebuild main") < calls.index("verify")
    # the gateway's reload clock runs from before the rebuild to after the verify (its histograms)
    assert calls.index("mark") < calls.index("rebuild main") and calls.index("verify") < calls.index("mark done")
    assert world.probe.engine["max_num_seqs"] == 4 and world.probe.engine["kv_cache_mib"] == 8
    assert yaml.safe_load(world.dropin.read_text()) == {"engine": {"max_num_seqs": 4, "kv_cache_mib": 8}}
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4 and world.records.intent("tiny") is None
    assert any(note.startswith("the main engine rebuilt in place on the target config") for note in op.notes)
    assert IN_PLACE.cancellable == {Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD}


def test_the_warm_standby_follows_in_its_own_process(tmp_path):
    world = World(tmp_path, strategy="in-place", standby=True)
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "in-place")
    assert jobs(world) == []  # no reload of a builtin model starts a process
    assert world.probe.calls.count("rebuild main") == 1 and world.probe.calls.count("rebuild standby") == 1
    assert world.probe.calls.index("rebuild main") < world.probe.calls.index("rebuild standby")
    assert world.probe.standby_engine == world.probe.engine and world.probe.engine["max_num_seqs"] == 4
    assert "the standby rebuilt in place on the target config" in op.notes


def test_a_refused_rebuild_rolls_back_with_the_engines_words_and_the_old_runner_serving(tmp_path):
    world = World(tmp_path, strategy="in-place", standby=True)
    before = dict(world.probe.engine)
    world.probe.fail_rebuild = "engine.max_model_len: 99999 exceeds the model's max_position_embeddings (64)"
    op = run(world.reload({"max_model_len": 99999}))
    assert (op.state, op.strategy_name, op.restored) == (R.State.ROLLED_BACK, "in-place", True)
    assert "max_position_embeddings" in op.error and "refused the rebuild" in op.error
    assert jobs(world) == [] and world.probe.rebuilds == [{**before, "max_model_len": 99999}]  # not again
    assert world.probe.engine == before and world.probe.standby_engine == before
    assert not world.dropin.exists() and world.records.intent("tiny") is None
    assert world.probe.calls[-1] == "mark rolled-back"  # the gateway counts it by its outcome


def test_a_refused_change_from_the_admins_own_dropin_is_pinned(tmp_path):
    world = World(tmp_path, strategy="in-place")
    before = dict(world.probe.engine)
    admin = world.root / "models/tiny.d/50-admin.yaml"
    admin.parent.mkdir(parents=True, exist_ok=True)
    admin.write_text("engine:\n  max_model_len: 99999\n")
    world.probe.fail_rebuild = "engine.max_model_len: 99999 exceeds the model's max_position_embeddings (64)"
    op = run(world.reload({}))
    assert (op.state, op.strategy_name) == (R.State.ROLLED_BACK, "in-place")
    pin = yaml.safe_load((world.root / "models/tiny.d" / R.ROLLBACK_DROPIN).read_text())
    assert pin == {"engine": before} and world.config().engine.max_model_len == before["max_model_len"]
    assert jobs(world) == []


def test_no_room_for_the_new_kv_cache_beside_the_old_runs_as_overlap_and_says_why(tmp_path):
    world = World(tmp_path, strategy="in-place")
    world.probe.no_room_in_place = "the new runner's KV cache of 60000 MiB ... but 512 MiB are free"
    op = run(world.reload({"kv_cache_mib": 60000}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "overlap")
    assert "no in-place reload: the new runner's KV cache of 60000 MiB ... but 512 MiB are free" in op.notes
    assert "rebuild main" not in world.probe.calls


def test_a_kv_cache_that_never_fits_is_refused_touching_nothing(tmp_path):
    world = World(tmp_path, strategy="in-place")
    world.probe.never_fits = "the new runner's KV cache of 9999999 MiB ... even once the serving runner's is freed"
    try:
        run(world.reload({"kv_cache_mib": 9999999}))
    except errors.InsufficientMemory as exc:
        assert "9999999 MiB" in str(exc)
    else:
        raise AssertionError("not refused")
    assert jobs(world) == [] and not world.dropin.exists() and world.records.intent("tiny") is None
    assert not any(c.startswith(("rebuild", "drain", "switch")) for c in world.probe.calls)


def test_the_preflight_counts_the_new_kv_cache_beside_the_old_and_alone(tmp_path):
    """Preflight.in_place_problem's arithmetic on a GPU reading: the new
    cache and the reserve against free memory; alone, with the serving
    runner's cache (its /health's kv_cache_bytes) given back."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
         "max_position_embeddings": 32768, "dtype": "bfloat16"}))  # Qwen2.5-7B's shape
    cfg = msgspec.convert({"backend": "builtin", "model": str(tmp_path), "device": "cuda", "gpus": [0],
                           "engine": {"kv_cache_mib": 4096}, "reload": {"overlap_reserve_mib": 256}},
                          schema.BuiltinModel)
    health = EngineHealth(kv_cache_bytes=2048 << 20)
    pre = preflight.Preflight("tiny")

    def reading(free_mib: int) -> preflight.Memory:
        return preflight.Memory([preflight.GpuMemory(0, 80 << 30, free_mib << 20, 10 << 30, 15 << 30)], "")
    assert pre.in_place_problem(cfg, health, reading(4352)) is None  # 4096 + 256
    beside = pre.in_place_problem(cfg, health, reading(4351))
    assert beside.startswith("GPU 0: the new runner's KV cache of 4096 MiB") and "4351 MiB would be free" in beside
    assert pre.in_place_problem(cfg, health, reading(2304), alone=True) is None  # 2304 + the old 2048
    assert "even once the serving runner's is freed" in pre.in_place_problem(cfg, health, reading(2303), alone=True)


def test_a_backend_that_cannot_rebuild_in_place_runs_as_overlap_and_says_why(tmp_path):
    world = World(tmp_path, strategy="in-place", backend="vllm")
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.strategy_name in ("overlap", "restart") and op.state == R.State.DONE, (op.state, op.error)
    assert "no in-place reload: the vllm engine cannot change its limits in its own process" in op.notes


def test_a_manager_killed_mid_rebuild_is_recovered_in_place(tmp_path):
    world = World(tmp_path, strategy="in-place")
    before = world.dropin.read_text() if world.dropin.exists() else None
    intent = world.crashed_reload({"max_num_seqs": 2}, strategy="in-place", previous_reload=before)
    world.probe.engine = {**world.probe.engine, "max_num_seqs": 3}  # neither config (a hand-made rebuild)
    assert run(world.recover(intent)) == "rebuilt"
    assert jobs(world) == [] and world.probe.calls[-1] == "rebuild main"
    assert world.probe.engine["max_num_seqs"] == world.config().engine.max_num_seqs
    assert world.records.intent("tiny") is None and not world.dropin.exists()
