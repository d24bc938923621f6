"""Crashes during an overlap reload (issue 21 item 6), for every backend (the
vllm and sglang next slot is the bridge engine), driven with the fake systemd
and probe of reload_fakes.py.

The manager killed at each stage of the overlap (at the stage's start, and
inside it, once its first call is under way), then a new manager's recovery
(hostd/manager/recovery.py, what the manager runs on start for a record it
finds): exactly one engine is left, the main one, the gateway sends new
requests to it, it runs the committed config or the rolled-back one, the
files on disk say the same, and no intent record is left.

An engine killed -9 mid-reload: the bridge before the switch rolls the
reload back with the main engine untouched; the main engine killed after the
switch (its requests fail, nothing new goes to it) or while it restarts
(rolled back) ends with one engine serving. What the gateway tells the
clients of a killed engine is tests/integration's (test_overlap.py,
test_gateway_front_door.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402
from test_reload_overlap import EDITABLE, TINY_LLAMA, upstream_model  # noqa: E402

from hostd import config, units  # noqa: E402
from hostd.manager import reload as R  # noqa: E402

NEXT = units.engine("tiny", "next")
MAIN = units.engine("tiny")
BACKENDS = ["builtin", "vllm", "sglang"]
# Every stage an overlap reload passes through once it has chosen overlap.
OVERLAP_STAGES = [R.Stage.RECORD, R.Stage.START_NEXT, R.Stage.SWITCH, R.Stage.SETTLE, R.Stage.RESTART,
                  R.Stage.VERIFY, R.Stage.RESUME, R.Stage.RETIRE, R.Stage.COMMIT]


class ManagerKilled(BaseException):
    """The manager's process ends here: no except clause of the reload runs
    (they catch Exception), as none would in a process killed with -9."""


def world_for(tmp_path: Path, backend: str) -> World:
    world = World(tmp_path, strategy="overlap")
    if backend != "builtin":
        upstream_model(world, backend, TINY_LLAMA)
    return world


def field(backend: str) -> str:
    return EDITABLE.get(backend, "max_num_seqs")


async def kill_manager(world: World, patch: dict, stage: R.Stage, inside: bool) -> R.Operation:
    """Run one overlap reload and end its manager at STAGE: as the stage
    begins, or INSIDE it (the task cancelled as it begins, so it ends at the
    stage's first wait: a systemd job or a gateway call under way). The jobs
    systemd was running go on without it."""
    await world.connect()
    op = R.Operation(id=1, model=world.name, patch=patch)
    reload = R.Reload(world.model(), op)
    await reload.check()
    assert op.strategy_name == "overlap"
    task = None

    def changed(o: R.Operation) -> None:
        if o.stage == stage and o.state == R.State.RUNNING:
            if not inside:
                raise ManagerKilled(stage.value)
            task.cancel()

    op.on_change = changed
    task = asyncio.create_task(reload.run())
    with contextlib.suppress(ManagerKilled, asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # systemd finishes the jobs it had
    return op


def assert_one_engine_serving_what_the_files_say(world: World, target: dict, previous: dict) -> str:
    """Exactly one engine, the main one, the gateway on it, running the
    target (committed) or the previous config (rolled back), as on disk;
    returns which."""
    probe = world.probe
    assert probe.next_engine is None, "the second engine still runs"
    next_jobs = [verb for verb, unit in world.bus.job_log if unit == NEXT]
    assert not next_jobs or next_jobs[-1] == "stop" or world.bus.unit(NEXT)["ActiveState"] == "failed", next_jobs
    assert probe.slot == "main" and probe.engine is not None
    assert world.records.intent("tiny") is None
    on_disk = msgspec.to_builtins(config.load_model("tiny", world.root).config.engine)
    assert probe.engine == on_disk
    if probe.engine == target:
        assert world.records.committed("tiny").engine == target
        return "target"
    assert probe.engine == previous
    return "previous"


# (stage, inside): commit writes its records without a wait, so nothing can
# be under way inside it (the manager ends before or after it).
CRASHES = [(stage, inside) for stage in OVERLAP_STAGES for inside in (False, True)
           if not (inside and stage == R.Stage.COMMIT)]


@pytest.mark.parametrize("stage, inside", CRASHES,
                         ids=[f"{s.value}-{'inside' if i else 'at-start'}" for s, i in CRASHES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_manager_killed_in_any_overlap_stage_leaves_one_engine_on_the_committed_or_previous_config(
        tmp_path, backend, stage, inside):
    world = world_for(tmp_path, backend)
    previous = dict(world.probe.engine)
    patch = {field(backend): 3}
    target = {**previous, **patch}

    async def scenario() -> tuple[R.Operation, str]:
        op = await kill_manager(world, patch, stage, inside)
        intent = world.records.intent("tiny")
        # The manager's start recovers a record it finds; without one (killed
        # before writing it) there is nothing to end.
        outcome = await world.recover(intent) if intent is not None else "none"
        return op, outcome

    op, outcome = asyncio.run(scenario())
    assert op.state == R.State.RUNNING  # it never finished: it was killed
    ended = assert_one_engine_serving_what_the_files_say(world, target, previous)
    # The main engine runs the target only once the reload restarted it;
    # before that recovery leaves it alone and stops the second engine.
    before_restart = OVERLAP_STAGES.index(stage) < OVERLAP_STAGES.index(R.Stage.RESTART)
    if before_restart:
        assert ended == "previous" and outcome in ("left", "none"), outcome
        assert ("restart", MAIN) not in world.bus.job_log
    elif stage in (R.Stage.VERIFY, R.Stage.RESUME, R.Stage.RETIRE, R.Stage.COMMIT):
        assert ended == "target" and outcome == "committed", outcome


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bridge_killed_before_the_switch_rolls_back_and_the_main_engine_never_moves(tmp_path, backend):
    """The next engine (the bridge) dies with -9 as it starts: its unit
    fails, the reload is rolled back, and the main engine, which kept
    serving, was never stopped."""
    world = world_for(tmp_path, backend)
    previous = dict(world.probe.engine)
    world.bus.job_results[NEXT] = ["failed"]  # systemd's result for a unit whose process was killed
    op = asyncio.run(world.reload({field(backend): 3}))
    assert op.state in (R.State.ROLLED_BACK, R.State.FAILED) and op.restored, (op.state, op.error)
    assert ("restart", MAIN) not in world.bus.job_log and ("stop", MAIN) not in world.bus.job_log
    assert "switch next" not in world.probe.calls
    assert assert_one_engine_serving_what_the_files_say(world, {}, previous) == "previous"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_main_engine_killed_after_the_switch_ends_with_the_reload_done_on_one_engine(tmp_path, backend):
    """The main engine dies with -9 once the gateway sends new requests to
    the bridge (its own requests fail; none new reach it): the reload goes
    on, restarts it on the target config and hands the gateway back."""
    world = world_for(tmp_path, backend)
    previous = dict(world.probe.engine)
    settle = world.probe.settle

    async def main_dies(slot: str, timeout: float):
        if slot == "main":
            world.probe.engine = None  # killed: what it ran fails, it answers nothing
            world.bus.set_state(MAIN, "failed")
        return await settle(slot, timeout)

    world.probe.settle = main_dies
    patch = {field(backend): 3}
    op = asyncio.run(world.reload(patch))
    assert (op.state, op.error) == (R.State.DONE, "")
    assert assert_one_engine_serving_what_the_files_say(world, {**previous, **patch}, previous) == "target"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_main_engine_killed_while_it_restarts_rolls_back_while_the_bridge_serves(tmp_path, backend):
    """The main engine's new process dies with -9 as it starts: the restart
    job fails, the reload rolls back (the main engine on the previous config)
    while the bridge still carries new requests, then hands the gateway back
    and retires the bridge."""
    world = world_for(tmp_path, backend)
    previous = dict(world.probe.engine)
    world.bus.job_results[MAIN] = ["failed"]  # the restart; the rollback's restart is "done"
    op = asyncio.run(world.reload({field(backend): 3}))
    assert op.state == R.State.ROLLED_BACK and op.restored, (op.state, op.error)
    calls = world.probe.calls
    assert calls.index("switch next") < calls.index("switch main")  # the bridge served throughout
    assert "drain" not in calls
    assert assert_one_engine_serving_what_the_files_say(world, {}, previous) == "previous"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bridge_killed_after_the_switch_still_ends_with_the_reload_done_on_the_main_engine(tmp_path, backend):
    """The bridge dies with -9 while the main engine restarts: the reload
    goes on (the restart does not need it), hands the gateway back to the
    main engine and stops the dead bridge's unit. Until the main engine
    answers, no engine serves: the gateway answers new requests 503
    (docs/operations.md says so)."""
    world = world_for(tmp_path, backend)
    previous = dict(world.probe.engine)
    settle = world.probe.settle

    async def bridge_dies(slot: str, timeout: float):
        if slot == "main":
            world.probe.next_engine = None
            world.bus.set_state(NEXT, "failed")
        return await settle(slot, timeout)

    world.probe.settle = bridge_dies
    patch = {field(backend): 3}
    op = asyncio.run(world.reload(patch))
    assert (op.state, op.error) == (R.State.DONE, "")
    assert ("stop", NEXT) in world.bus.job_log
    assert assert_one_engine_serving_what_the_files_say(world, {**previous, **patch}, previous) == "target"
