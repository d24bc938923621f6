"""The checkpoint swap's pure parts (issue 36): where a patch's `model` goes
in 90-reload.yaml, which values the manager refuses before the loader, which
keys ride a swap per backend, and the preflight's words; and the swap
itself on the fakes of reload_fakes.py (issue 53): its stages and jobs, the
main pair's digest check, and recovery loading the checkpoint on disk into
the main daemon again. Against real daemons under systemd:
tests/system/test_swap_units.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostd.config import schema
from hostd.manager import errors
from hostd.manager.dropins import merge_patch
from hostd.manager.patch import check_checkpoint_values
from hostd.manager.strategies import STRATEGIES, checkpoint_bytes


def test_a_patchs_model_goes_to_the_top_of_the_dropin_and_limits_under_engine(tmp_path: Path):
    dropin = tmp_path / "90-reload.yaml"
    dropin.write_text("engine:\n  max_num_seqs: 4\n")
    merged = merge_patch(dropin, {"model": "/srv/ckpt/v2", "max_model_len": 64}, ("model",))
    assert merged == {"model": "/srv/ckpt/v2", "engine": {"max_num_seqs": 4, "max_model_len": 64}}


@pytest.mark.parametrize("value", ["relative/dir", "", 7, None, "/srv/\0x"])
def test_a_model_that_is_not_an_absolute_path_is_refused_naming_the_key(value):
    with pytest.raises(errors.InvalidValue, match="^model: expected the absolute path"):
        check_checkpoint_values({"model": value}, ("model",))


def test_a_checkpoint_whose_config_json_is_no_regular_file_is_refused_before_anything_reads_it(tmp_path: Path):
    import os

    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")  # root reading it would hang the manager
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "config.json").symlink_to("/dev/zero")
    for name in ("fifo", "device"):
        with pytest.raises(errors.InvalidValue, match="config.json: not a regular file"):
            check_checkpoint_values({"model": str(tmp_path / name)}, ("model",))
    with pytest.raises(errors.InvalidValue, match="config.json: cannot be read .No such file"):
        check_checkpoint_values({"model": str(tmp_path / "absent")}, ("model",))
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "config.json").write_text("{}")
    check_checkpoint_values({"model": str(tmp_path / "good")}, ("model",))


def test_every_backend_swaps_its_model_and_nothing_else():
    assert {backend: schema.swappable_fields(backend) for backend in ("builtin", "vllm", "sglang")} == {
        "builtin": ("model",), "vllm": ("model",), "sglang": ("model",)}


def test_the_swap_strategy_publishes_its_stages_and_is_cancellable_until_its_engine_started():
    swap = STRATEGIES["swap"]
    assert [s.value for s in swap.stages] == [
        "validate", "preflight", "record", "load-next", "start-next", "switch", "settle", "restart", "verify",
        "resume", "retire", "commit", "finished"]
    assert {s.value for s in swap.cancellable} == {"validate", "preflight", "record", "load-next", "start-next"}


def test_the_preflight_counts_the_checkpoints_weight_files(tmp_path: Path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 1000)
    assert checkpoint_bytes(str(tmp_path)) == 500
    assert checkpoint_bytes(str(tmp_path / "absent")) == 0


def test_a_reload_is_a_swap_exactly_when_the_target_names_another_checkpoint_than_the_daemon_holds(tmp_path: Path):
    """change.change_of, validate's one answer: another directory than the
    one the main weight daemon reports (resolved: a symlink to it is the
    same) is a swap; the same is a change of limits; a daemon that does not
    answer refuses a patch that names `model` and is a limits change
    otherwise."""
    from types import SimpleNamespace

    from hostd.manager.change import change_of

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (tmp_path / "link").symlink_to(old)
    status = SimpleNamespace(fingerprint=SimpleNamespace(model_path=str(old.resolve())))
    target = lambda path: SimpleNamespace(model=str(path))  # noqa: E731
    swap = change_of("tiny", "model-weights@tiny.service", target(new), True, status)
    assert (swap.swaps, swap.checkpoint, swap.previous) == (True, str(new.resolve()), str(old.resolve()))
    assert not change_of("tiny", "model-weights@tiny.service", target(tmp_path / "link"), True, status).swaps
    assert not change_of("tiny", "model-weights@tiny.service", target(new), False, None).swaps
    with pytest.raises(errors.NotRunning, match="model-weights@tiny.service.*does not answer"):
        change_of("tiny", "model-weights@tiny.service", target(new), True, None)


# ---------------------------------------------------------------- the swap on the fakes (issue 53 Build 3)


def swap_world(tmp_path: Path):
    """World (reload_fakes.py) with a second checkpoint beside the first: a
    patch naming it is a checkpoint swap."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from reload_fakes import World

    world = World(tmp_path)
    new = tmp_path / "checkpoint-v2"
    new.mkdir()
    (new / "config.json").write_text("{}")
    (new / "model.safetensors").write_text("")
    return world, str(new.resolve()), str((tmp_path / "checkpoint").resolve())


def swap_jobs(world) -> list[str]:
    return [f"{verb} {unit}" for verb, unit in world.bus.job_log]


def test_a_swap_on_the_fakes_loads_next_switches_restarts_the_pair_on_it_and_retires_the_next_pair(tmp_path):
    import asyncio

    from hostd import units
    from hostd.manager import reload as R

    world, new, old = swap_world(tmp_path)
    seen: list[str] = []
    real_enter = R.Operation.enter

    def enter(op, stage):
        seen.append(stage.value)
        return real_enter(op, stage)
    R.Operation.enter = enter
    try:
        op = asyncio.run(world.reload({"model": new}))
    finally:
        R.Operation.enter = real_enter
    assert (op.state, op.strategy_name, op.error, op.weights_reused) == (R.State.DONE, "swap", "", False)
    assert seen == ["preflight", "record", "load-next", "start-next", "switch", "settle", "restart", "verify",
                    "resume", "retire", "commit", "finished"]
    assert swap_jobs(world) == [f"start {units.weights('tiny', 'next')}", f"start {units.swap_engine('tiny')}",
                                f"restart {units.weights('tiny')}", f"start {units.engine('tiny')}",
                                f"stop {units.swap_engine('tiny')}", f"stop {units.weights('tiny', 'next')}"]
    assert world.probe.held == new and world.probe.next_weights is None and world.probe.slot == "main"
    assert world.probe.digests["main"] == world.probe.digest(new)
    assert any(note.startswith(f"new checkpoint: {new}") for note in op.notes)
    assert world.records.committed("tiny").fixed["model"] == new and world.records.intent("tiny") is None
    assert old != new


def test_a_swap_reads_each_checkpoints_config_json_once_from_its_check_to_its_end(tmp_path, monkeypatch):
    """Issue 52, S1: the check of `model=` and every later use (the backend's
    refusals, the budget, the strategy's steps) share one read of the new
    checkpoint's config.json, so a file changed or renamed in between cannot
    make the check and the swap see two different checkpoints."""
    import asyncio

    from hostd.checkpoints import config_file
    from hostd.manager import reload as R

    world, new, old = swap_world(tmp_path)
    reads: list[str] = []
    real = config_file._read
    monkeypatch.setattr(config_file, "_read", lambda checkpoint: (reads.append(str(checkpoint)), real(checkpoint))[1])
    op = asyncio.run(world.reload({"model": new}))
    assert op.state == R.State.DONE, op.error
    assert reads.count(new) == 1, reads
    reads.clear()
    asyncio.run(R.check_only(world.model(), {"model": old}))
    assert reads.count(old) <= 1, reads
    assert config_file._shared.get() is None  # nothing outlives the reload


def test_a_main_pair_that_serves_another_checkpoint_than_the_new_ones_digest_rolls_back(tmp_path):
    """Swap.verify_main: the main engine must serve the weights of the
    content digest the new checkpoint's daemon reported; a main daemon that
    restarted on something else (here the old checkpoint: a file changed
    under it) is refused and the swap rolls back to the previous pair."""
    import asyncio

    from hostd.manager import reload as R

    world, new, old = swap_world(tmp_path)
    real = world.probe.daemon_restarted

    def stale() -> None:  # the first restart loads the old checkpoint, whatever the file says
        real()
        if world.probe.held == new:
            world.probe.held = old
            world.probe.daemon_restarted = real
    world.probe.daemon_restarted = stale
    op = asyncio.run(world.reload({"model": new}))
    assert (op.state, op.strategy_name) == (R.State.ROLLED_BACK, "swap")
    assert "content digest" in op.error and world.probe.digest(new) in op.error
    assert world.probe.held == old and not world.dropin.exists()


def test_recovery_after_a_crash_mid_swap_loads_the_checkpoint_on_disk_into_the_main_daemon_again(tmp_path):
    """recovery.py: a manager killed after the main daemon restarted on the
    new checkpoint but before the engine was verified: the files go back to
    the old checkpoint, and the main daemon, which holds the new one, loads
    the old one again (the weights and the engine restart), then the swap's
    pair stops."""
    import asyncio

    import yaml

    from hostd import units

    world, new, old = swap_world(tmp_path)
    intent = world.crashed_reload({}, strategy="swap", write_dropin=False, checkpoint=new, previous_checkpoint=old)
    world.dropin.parent.mkdir(parents=True, exist_ok=True)
    world.dropin.write_text(yaml.safe_dump({"model": new}))
    world.probe.held = new  # the main daemon restarted on it
    world.probe.engine = None  # the engine had not come up when the manager died
    assert asyncio.run(world.recover(intent)) == "restarted"
    assert not world.dropin.exists() and world.probe.held == old
    assert f"restart {units.weights('tiny')}" in swap_jobs(world)
    assert world.probe.engine is not None and world.records.intent("tiny") is None


def test_under_reload_strategy_restart_a_swap_drains_and_restarts_the_main_pair_on_the_new_checkpoint(tmp_path):
    """choose_swap: reload.strategy restart swaps with a 503 window (drain,
    the weights and the engine restarted on the new checkpoint, resume), no
    second pair."""
    import asyncio
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from reload_fakes import World

    from hostd import units
    from hostd.manager import reload as R

    world = World(tmp_path, strategy="restart")
    new = tmp_path / "checkpoint-v2"
    new.mkdir()
    (new / "config.json").write_text("{}")
    (new / "model.safetensors").write_text("")
    op = asyncio.run(world.reload({"model": str(new)}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "restart")
    assert swap_jobs(world) == [f"restart {units.weights('tiny')}", f"start {units.engine('tiny')}"]
    assert "drain" in world.probe.calls and world.probe.held == str(new.resolve())


def test_a_swap_engine_that_fails_to_stop_still_has_the_next_weight_daemon_stopped(tmp_path):
    """Issue 52, S4: the retire stopped the swap's engine, then the next
    weight daemon; a failed first stop skipped the second, leaving a full
    second copy of the weights. Both are asked; the reload says it failed."""
    import asyncio

    from hostd import units
    from hostd.manager import reload as R

    world, new, _ = swap_world(tmp_path)
    world.bus.job_results[units.swap_engine("tiny")] = ["done", "failed"]  # its start, then its stop
    op = asyncio.run(world.reload({"model": new}))
    assert f"stop {units.weights('tiny', 'next')}" in swap_jobs(world)
    assert world.probe.next_weights is None  # the second copy is gone
    assert op.state == R.State.FAILED and "stop model-engine-swap@tiny.service" in op.error, op.error
    assert world.records.committed("tiny").fixed["model"] == new  # the main pair serves it: committed


def test_a_second_pair_no_reload_accounts_for_is_stopped_at_the_managers_start_and_before_load_next(tmp_path):
    """Issue 52, S4: a swap's second pair left running (its stop failed
    after the swap ended) held a second copy of the weights for ever, and the
    next swap started on that daemon. The manager's start stops it for a
    model with no intent record, and so does a swap before its load-next."""
    import asyncio

    from hostd import units
    from hostd import config
    from hostd.manager import recovery

    world, new, _ = swap_world(tmp_path)

    def leave_a_pair() -> None:
        world.probe.next_daemon_started()
        world.bus.set_state(units.weights("tiny", "next"), "active")

    class Manager:  # what recovery reads of service.Manager
        models = {"tiny": type("Model", (), {"handles": world.model(),
                                             "loaded": lambda self: config.load_model("tiny", world.root)})()}

    leave_a_pair()

    async def manager_start():
        await world.connect()
        await recovery.recover_claimed(Manager(), [])

    asyncio.run(manager_start())
    assert swap_jobs(world) == [f"stop {units.swap_engine('tiny')}", f"stop {units.weights('tiny', 'next')}"]
    assert world.probe.next_weights is None
    world.bus.job_log.clear()
    leave_a_pair()
    asyncio.run(world.reload({"model": new}))
    assert swap_jobs(world)[:3] == [f"stop {units.swap_engine('tiny')}", f"stop {units.weights('tiny', 'next')}",
                                    f"start {units.weights('tiny', 'next')}"]
