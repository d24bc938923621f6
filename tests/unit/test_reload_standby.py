"""The standby strategy (standby: true), driven with the fake systemd and
probe of reload_fakes.py: the standby rebuilds in its own process (no unit
starts), the gateway serves from it while the main engine restarts, and it
ends on the committed config; a refused rebuild, a failed main restart, a
cancel, a manager crash; and a model without a standby reloads as before."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd import config, units  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.records import Intent  # noqa: E402

MAIN = units.engine("tiny")
NEXT = units.engine("tiny", "next")
STANDBY = units.engine("tiny", "standby")


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, standby=True)


def run(coro):
    return asyncio.run(coro)


def jobs(world: World) -> list[str]:
    return [f"{verb} {unit}" for verb, unit in world.bus.job_log]


def test_a_standby_reload_rebuilds_the_standby_serves_from_it_and_restarts_only_main(world):
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name, op.error) == (R.State.DONE, "standby", "")
    calls = world.probe.calls
    assert "drain" not in calls and "resume" not in calls  # never a 503
    # Rebuilt and verified before any traffic moves; main restarts only once
    # nothing runs on it; traffic returns once it is verified.
    assert (calls.index("rebuild standby") < calls.index("verify standby") < calls.index("switch standby")
            < calls.index("settle main") < calls.index("verify") < calls.index("switch main"))
    assert jobs(world) == [f"restart {MAIN}"]  # no unit starts or stops for the standby
    assert world.probe.slot == "main"
    assert world.probe.engine["max_num_seqs"] == 4 and world.probe.standby_engine["max_num_seqs"] == 4
    assert world.probe.outcomes == [None, "done"]
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4 and world.records.intent("tiny") is None
    assert any(note.startswith("standby rebuilt in") for note in op.notes)


def test_a_refused_rebuild_rolls_back_with_the_standbys_words_and_never_touches_main(world):
    world.probe.fail_rebuild = "engine.max_model_len: 99999 exceeds the model's max_position_embeddings (64)"
    main_before, standby_before = dict(world.probe.engine), dict(world.probe.standby_engine)
    op = run(world.reload({"max_model_len": 99999}))
    assert (op.state, op.strategy_name, op.restored) == (R.State.ROLLED_BACK, "standby", True)
    assert "max_position_embeddings" in op.error
    assert jobs(world) == []  # main never restarted, nothing started
    assert "switch standby" not in world.probe.calls and world.probe.slot == "main"
    assert world.probe.engine == main_before and world.probe.standby_engine == standby_before
    assert not world.dropin.exists() and world.records.intent("tiny") is None


def test_a_main_engine_that_fails_its_restart_rolls_back_and_the_standby_goes_back_too(world):
    before = dict(world.probe.engine)
    world.probe.fail_next_start = True  # main refuses the target after the standby took it
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.ROLLED_BACK, "standby")
    assert jobs(world) == [f"restart {MAIN}", f"restart {MAIN}"]  # the failed start, the rollback's
    assert world.probe.engine == before and world.probe.standby_engine == before
    assert world.probe.rebuilds == [{**before, "max_num_seqs": 4}, before]
    assert world.probe.slot == "main" and world.probe.outcomes[-1] == "rolled-back"


def test_a_standby_that_cannot_go_back_is_restarted_by_systemd_on_the_restored_config(world):
    before = dict(world.probe.engine)
    world.probe.fail_next_start = True

    real = world.probe.rebuild

    async def rebuild(engine, slot="standby"):
        if world.probe.rebuilds:  # the second one, back to the previous config
            world.probe.fail_rebuild = "out of memory"
        return await real(engine, slot)
    world.probe.rebuild = rebuild
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.ROLLED_BACK
    assert jobs(world)[-1] == f"restart {STANDBY}"
    assert world.probe.standby_engine == before  # it started on the config on disk, restored
    assert any("the standby was restarted" in note for note in op.notes)


def test_cancel_is_honoured_until_the_switch_to_the_standby(world):
    seen: dict[str, bool] = {}

    async def go():
        await world.connect()
        op = R.Operation(id=1, model="tiny", patch={"max_num_seqs": 4})
        op.on_change = lambda o: seen.setdefault(o.stage.value, o.cancellable())
        reload = R.Reload(world.model(), op)
        await reload.check()
        await asyncio.create_task(reload.run())
        return op
    op = run(go())
    assert op.state == R.State.DONE
    assert {stage for stage, ok in seen.items() if ok} == {"preflight", "record", "rebuild"}


def test_a_cancel_during_the_rebuild_puts_the_standby_back_and_the_file_too(world):
    before = dict(world.probe.engine)
    real = world.probe.rebuild

    async def slow(engine, slot="standby"):
        answer = await real(engine, slot)
        if len(world.probe.rebuilds) == 1:
            await asyncio.sleep(30)  # the cancel arrives meanwhile
        return answer
    world.probe.rebuild = slow

    async def go():
        await world.connect()
        loop = asyncio.get_running_loop()
        op = R.Operation(id=1, model="tiny", patch={"max_num_seqs": 4})
        op.on_change = lambda o: o.stage == R.Stage.REBUILD and loop.call_later(0.05, o.cancel)
        reload = R.Reload(world.model(), op)
        await reload.check()
        await asyncio.create_task(reload.run())
        return op
    op = run(go())
    assert (op.state, op.restored) == (R.State.CANCELLED, True)
    assert world.probe.standby_engine == before and world.probe.slot == "main"
    assert jobs(world) == [] and not world.dropin.exists()


@pytest.mark.parametrize("why", ["standby down", "failover"])
def test_without_a_usable_standby_the_reload_is_an_overlap_and_says_why(world, why):
    if why == "standby down":
        world.probe.standby_engine = None
    else:
        world.probe.slot = "standby"  # the gateway serves from the standby: main died
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "overlap")
    assert any(note.startswith("no standby reload: ") for note in op.notes)
    assert f"start {NEXT}" in jobs(world)


def test_a_model_without_standby_reloads_as_before_and_never_asks_for_one(tmp_path: Path):
    world = World(tmp_path)  # no standby: key
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name, op.notes) == (R.State.DONE, "overlap", [])
    assert not any("standby" in call for call in world.probe.calls)
    assert jobs(world) == [f"start {NEXT}", f"restart {MAIN}", f"stop {NEXT}"]


def test_reload_strategy_restart_is_a_restart_even_with_a_standby(tmp_path: Path):
    world = World(tmp_path, strategy="restart", standby=True)
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "restart")


# ---------------------------------------------------------------- a manager that died mid-way


def standby_intent(world: World, target: dict) -> Intent:
    return world.crashed_reload(target, strategy="standby")


def test_recovery_with_the_standby_serving_the_target_rolls_back_and_rebuilds_it(world):
    before = dict(world.probe.engine)
    intent = standby_intent(world, {"max_num_seqs": 4})
    world.probe.standby_engine = {**before, "max_num_seqs": 4}  # it rebuilt and serves
    world.probe.slot = "standby"
    assert run(world.recover(intent)) == "left"
    assert not world.dropin.exists()
    assert world.probe.slot == "main" and world.probe.standby_engine == before
    assert jobs(world) == []  # no unit stopped: the standby stays


def test_recovery_after_main_restarted_commits_and_leaves_the_standby_on_the_target(world):
    before = dict(world.probe.engine)
    intent = standby_intent(world, {"max_num_seqs": 4})
    world.probe.standby_engine = {**before, "max_num_seqs": 4}
    world.probe.engine_started("main")  # main runs the target already
    world.probe.slot = "standby"
    assert run(world.recover(intent)) == "committed"
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert world.probe.slot == "main" and world.probe.standby_engine["max_num_seqs"] == 4
    assert "rebuild standby" not in world.probe.calls and jobs(world) == []


def test_an_admins_dropin_the_standby_refuses_is_pinned_and_main_never_restarts(world):
    """`systemctl reload` (an empty patch) of an administrator's drop-in the
    standby's rebuild refuses: the previous values go to 99-rollback.yaml, as
    after a refused restart or next engine, so no later engine start (a
    crash of main, a restart of the standby) runs what was refused."""
    before = dict(world.probe.engine)
    (world.root / "models/tiny.d").mkdir(exist_ok=True)
    (world.root / "models/tiny.d/50-admin.yaml").write_text("engine:\n  max_num_seqs: 6\n")
    world.probe.fail_rebuild = "engine.max_num_seqs: 6 does not fit"
    op = run(world.reload({}))
    assert (op.state, op.strategy_name, op.restored) == (R.State.ROLLED_BACK, "standby", True)
    pin = yaml.safe_load((world.root / "models/tiny.d/99-rollback.yaml").read_text())
    assert pin["engine"]["max_num_seqs"] == before["max_num_seqs"]
    assert any("pinned" in note for note in op.notes)
    assert config.load_model("tiny", world.root).config.engine.max_num_seqs == before["max_num_seqs"]
    assert jobs(world) == [] and world.probe.engine == before and world.probe.standby_engine == before


def test_a_stop_during_the_standby_rebuild_interrupts_and_leaves_the_standby_alone(world):
    """systemctl stop model@tiny while the standby rebuilds: the rebuild
    fails (its engine is going away); the reload ends failed "interrupted",
    not rolled-back, puts the file back, moves no traffic and asks nothing
    more of the standby (it is being stopped with the model)."""
    real = world.probe.rebuild

    async def stopped_while_rebuilding(engine, slot="standby"):
        world.bus.set_state(units.umbrella("tiny"), "deactivating")
        world.probe.standby_engine = None  # stopped with the model: the rebuild gets no answer
        return await real(engine, slot)

    world.probe.rebuild = stopped_while_rebuilding
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.FAILED, "standby")
    assert op.error.startswith("interrupted: the model is being stopped"), op.error
    assert op.restored and not world.dropin.exists() and world.records.intent("tiny") is None
    assert world.probe.rebuilds == [{**world.probe.engine, "max_num_seqs": 4}]  # never asked to go back
    assert "switch main" not in world.probe.calls and jobs(world) == []


# ---------------------------------------------------------------- vllm, sglang

@pytest.fixture
def upstream_world(tmp_path: Path) -> World:
    return World(tmp_path, standby=True, backend="vllm")


def reload_and_settle(world: World, patch: dict) -> R.Operation:
    """One reload, then the jobs it left running in the background end."""
    async def go():
        op = await world.reload(patch)
        for _ in range(50):
            await asyncio.sleep(0.001)
        return op
    return run(go())


def test_an_upstream_standby_carries_a_reload_on_its_own_config_and_only_main_restarts(upstream_world):
    """vllm: the standby cannot rebuild; it is checked (health, smoke) and
    serves the config it started with while main restarts on the target:
    one engine start, no 503; a capacity key (max_num_seqs) leaves it as it
    is afterwards."""
    world = upstream_world
    before = dict(world.probe.standby_engine)
    op = reload_and_settle(world, {"max_num_seqs": 4})
    assert (op.state, op.strategy_name, op.error) == (R.State.DONE, "standby", "")
    calls = world.probe.calls
    assert "drain" not in calls and "resume" not in calls and not any(c.startswith("rebuild") for c in calls)
    assert (calls.index("health standby") < calls.index("smoke standby") < calls.index("switch standby")
            < calls.index("settle main") < calls.index("verify") < calls.index("switch main"))
    assert jobs(world) == [f"restart {MAIN}"]
    assert world.probe.engine["max_num_seqs"] == 4 and world.probe.standby_engine == before
    assert any("the standby keeps the config it started with" in note for note in op.notes), op.notes
    assert any(note.startswith("the standby serves while the main engine restarts") and "--kv-cache-memory-bytes"
               in note for note in op.notes), op.notes


def test_an_upstream_standby_restarts_in_the_background_when_the_context_length_changed(upstream_world):
    world = upstream_world
    op = reload_and_settle(world, {"max_model_len": 512})
    assert (op.state, op.strategy_name) == (R.State.DONE, "standby")
    assert jobs(world) == [f"restart {MAIN}", f"restart {STANDBY}"]
    assert world.probe.standby_engine["max_model_len"] == 512  # systemd started it on the file: the target
    assert any("restarts on the new config in the background (max_model_len" in note for note in op.notes), op.notes


def test_a_main_engine_that_fails_on_the_target_rolls_back_with_the_upstream_standby_serving(upstream_world):
    world = upstream_world
    before = dict(world.probe.standby_engine)
    world.bus.job_results[MAIN] = ["failed", "done"]
    op = reload_and_settle(world, {"max_model_len": 99999})
    assert (op.state, op.strategy_name) == (R.State.ROLLED_BACK, "standby")
    assert jobs(world) == [f"restart {MAIN}", f"restart {MAIN}"]  # the standby is never touched
    assert world.probe.standby_engine == before and world.probe.slot == "main"
    assert "drain" not in world.probe.calls
    assert world.probe.engine["max_model_len"] == before["max_model_len"]


def test_an_upstream_standby_that_does_not_answer_means_an_overlap_and_says_why(upstream_world):
    world = upstream_world
    world.probe.standby_engine = None
    op = reload_and_settle(world, {"max_num_seqs": 4})
    assert op.strategy_name == "overlap"
    assert any("no standby reload" in note and "does not answer" in note for note in op.notes), op.notes
