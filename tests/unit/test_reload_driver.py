"""Every way a reload ends, and every way its recovery ends, driven with a fake
systemd (on a fake bus, behind hostd's real systemd client) and a fake probe:
what the Operation says, which files are left, whether the engine was
restarted and the gateway resumed, and how many D-Bus round trips it took."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd import config, units  # noqa: E402
from hostd.gateway import control  # noqa: E402
from hostd.manager import errors  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.probe import VerifyFailed  # noqa: E402
from hostd.manager.records import Degraded, Intent  # noqa: E402


@pytest.fixture
def world(tmp_path: Path) -> World:
    # Pinned: this module walks the restart strategy's exits (drain, resume,
    # rollback of a restarted engine); the overlap strategy's are in
    # test_reload_overlap.py, and what both must do is parametrized below and
    # in test_reload_dbus_api.py.
    return World(tmp_path, strategy="restart")


@pytest.fixture(params=["overlap", "restart"])
def any_world(request, tmp_path: Path) -> World:
    """A world under each strategy: the behaviour does not depend on it."""
    return World(tmp_path, strategy=request.param)


def run(coro):
    return asyncio.run(coro)


def dropin(world: World) -> dict:
    return yaml.safe_load(world.dropin.read_text()) if world.dropin.exists() else None


# ---------------------------------------------------------------- the exits of a reload


def test_done_writes_the_dropin_restarts_once_verifies_resumes_and_commits(world):
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.stage, op.error) == (R.State.DONE, R.Stage.FINISHED, "")
    assert op.weights_reused and not op.restored
    assert dropin(world) == {"engine": {"max_num_seqs": 4}}
    assert world.probe.engine["max_num_seqs"] == 4
    calls = world.probe.calls
    assert calls.index("drain") < calls.index("verify") < calls.index("resume") == len(calls) - 1
    assert world.probe.outcomes == ["done"]  # the gateway's reload histogram is labelled with it
    assert world.restarts() == 1
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert world.records.intent("tiny") is None


def test_a_patch_merges_into_what_90_reload_holds(any_world):
    world = any_world
    world.dropin.parent.mkdir(parents=True)
    world.dropin.write_text("engine: {max_model_len: 64}\n")
    run(world.reload({"max_num_seqs": 4}))
    assert dropin(world) == {"engine": {"max_model_len": 64, "max_num_seqs": 4}}


def test_a_malformed_90_reload_refuses_the_patch_and_changes_nothing(any_world):
    world = any_world
    world.dropin.parent.mkdir(parents=True)
    world.dropin.write_text("engine: [\n")
    with pytest.raises(errors.InvalidValue, match="90-reload.yaml"):
        run(world.reload({"max_num_seqs": 4}))
    assert world.dropin.read_text() == "engine: [\n" and world.restarts() == 0


def test_refusals_touch_nothing(any_world):
    world = any_world
    with pytest.raises(errors.NotEditable, match="'dtype' is fixed"):
        run(world.reload({"dtype": "float32"}))
    with pytest.raises(errors.InvalidValue):
        run(world.reload({"max_num_seqs": 0}))
    world.bus.unit(units.umbrella("tiny"))["ActiveState"] = "inactive"
    world.systemd._units.clear()
    with pytest.raises(errors.NotRunning):
        run(world.reload({"max_num_seqs": 4}))
    assert not world.dropin.exists() and world.restarts() == 0 and "drain" not in world.probe.calls
    assert not world.records.root.exists()  # no record, not even its directory


def test_an_engine_that_cannot_start_rolls_back_to_the_previous_config(world):
    world.probe.fail_next_start = True
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.ROLLED_BACK and op.restored
    assert not world.dropin.exists()  # as before the reload
    assert world.restarts() == 2 and world.probe.engine["max_num_seqs"] == 8
    assert world.probe.calls[-1] == "resume" and world.probe.outcomes == ["rolled-back"]
    assert world.records.intent("tiny") is None and world.records.committed("tiny") is None


def test_a_failed_reload_of_the_config_on_disk_pins_the_previous_values(world):
    (world.root / "models/tiny.d").mkdir()
    (world.root / "models/tiny.d/50-admin.yaml").write_text("engine: {max_num_seqs: 2}\n")
    world.probe.fail_next_start = True
    op = run(world.reload({}))
    assert op.state == R.State.ROLLED_BACK
    pinned = yaml.safe_load((world.root / "models/tiny.d" / R.ROLLBACK_DROPIN).read_text())
    assert pinned["engine"]["max_num_seqs"] == 8 and "pinned" in op.notes[0]


def test_a_rollback_that_fails_too_leaves_the_model_degraded_and_paused(world):
    world.bus.job_results[units.engine("tiny")] = ["failed", "failed"]
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.FAILED and "rollback failed" in op.error
    degraded = world.records.degraded("tiny")  # on disk: it outlives the operation and the manager
    assert (degraded.operation, degraded.cause) == (1, op.error)
    assert "resume" not in world.probe.calls  # nothing safe to serve
    assert world.restarts() == 2
    # A reload that ends done cures it.
    op = run(world.reload({"max_num_seqs": 5}))
    assert op.state == R.State.DONE and world.records.degraded("tiny") is None


def test_a_reload_that_rolls_back_cures_degraded_too_and_a_record_that_does_not_decode_still_says_degraded(world):
    """docs/dbus-api.md: degraded until a reload ends done or rolled back
    (the previous config serves again); only the manager writes the record,
    so one that does not decode is still a degraded model (issue 53)."""
    world.records.write_degraded("tiny", Degraded(operation=1, cause="an earlier rollback failed"))
    world.probe.fail_next_start = True
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.ROLLED_BACK and world.records.degraded("tiny") is None
    path = world.records._dir("tiny") / "degraded.json"
    path.write_text("{not json")
    assert "does not decode" in world.records.degraded("tiny").cause


def test_a_verified_engine_whose_gateway_does_not_resume_is_committed_and_failed(world):
    world.probe.resume_fails = True
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.FAILED and "did not resume" in op.error
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert world.records.intent("tiny") is None


def test_a_drain_timeout_restores_the_dropin_resumes_and_restarts_nothing(world):
    world.probe.drain_result = control.Drained(drained=False, remaining=3, state="draining")
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.FAILED and "3 request(s) still running" in op.error
    assert op.restored and not world.dropin.exists()
    assert world.probe.calls[-1] == "resume" and world.restarts() == 0
    assert world.probe.outcomes == ["failed"]
    assert world.records.intent("tiny") is None


def test_a_restore_that_fails_still_ends_the_operation(world):
    world.probe.drain_result = control.Drained(drained=False, remaining=1, state="draining")
    world.probe.resume_fails = True
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.FAILED and op.stage == R.Stage.FINISHED
    assert op.finished > 0 and world.restarts() == 0


def test_cancel_during_the_drain_restores_and_resumes(world):
    world.probe.drain_hangs = True

    async def cancel(op):
        op.cancel()

    op = run(world.reload({"max_num_seqs": 4}, during=cancel))
    assert op.state == R.State.CANCELLED and op.restored
    assert not world.dropin.exists() and world.restarts() == 0
    assert world.probe.calls[-1] == "resume" and world.probe.outcomes == ["cancelled"]


def test_a_stop_during_the_drain_interrupts_restores_and_does_not_resume(world):
    world.probe.drain_hangs = True

    async def stop(op):
        op.interrupt()

    op = run(world.reload({"max_num_seqs": 4}, during=stop))
    assert op.state == R.State.FAILED and op.error.startswith("interrupted")
    assert op.restored and not world.dropin.exists()
    assert "resume" not in world.probe.calls and world.restarts() == 0


def test_a_stop_that_replaces_the_engine_restart_starts_nothing_again(world):
    world.bus.job_results[units.engine("tiny")] = ["canceled"]

    async def stop_during_restart():
        await world.connect()
        op = R.Operation(id=1, model="tiny", patch={"max_num_seqs": 4})
        run_ = R.Reload(world.model(), op)
        await run_.check()
        task = asyncio.create_task(run_.run())
        while op.stage != R.Stage.RESTART:
            await asyncio.sleep(0)
        world.bus.set_state(units.umbrella("tiny"), "deactivating")
        await task
        return op

    op = run(stop_during_restart())
    assert op.state == R.State.FAILED and "interrupted" in op.error
    assert op.restored and not world.dropin.exists() and world.restarts() == 1


# ---------------------------------------------------------------- round trips


def test_one_reload_costs_one_round_trip_to_systemd_once_its_units_are_tracked(world):
    async def go():
        await world.connect()
        for unit in (units.umbrella("tiny"), units.engine("tiny")):  # what the manager does on discovery
            await world.systemd.properties(unit)
        world.bus.sent.clear()
        op = await world.reload({"max_num_seqs": 4})
        return op

    op = run(go())
    assert op.state == R.State.DONE
    assert world.bus.sent == ["org.freedesktop.systemd1.Manager.RestartUnit"]


def test_a_cold_reload_costs_one_loadunit_and_one_getall_per_unit(world):
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.DONE
    sent = world.bus.sent[world.bus.sent.index("org.freedesktop.systemd1.Manager.Subscribe") + 1:]
    assert sorted(sent) == sorted([
        "org.freedesktop.systemd1.Manager.LoadUnit", "org.freedesktop.DBus.Properties.GetAll",  # umbrella
        "org.freedesktop.systemd1.Manager.LoadUnit", "org.freedesktop.DBus.Properties.GetAll",  # engine
        "org.freedesktop.systemd1.Manager.RestartUnit",
    ])


# ---------------------------------------------------------------- recovery


def intent_of(world: World, target: dict, **fields) -> Intent:
    return world.crashed_reload(target, **fields)


def test_recovery_commits_when_the_engine_runs_the_target(world):
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine_started()  # the crash came after the restart
    assert run(world.recover(intent)) == "committed"
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert dropin(world) == {"engine": {"max_num_seqs": 4}}
    assert world.restarts() == 0 and world.probe.calls[-1] == "resume"
    assert world.records.intent("tiny") is None


def test_recovery_leaves_an_engine_that_runs_the_previous_config_alone(world):
    intent = intent_of(world, {"max_num_seqs": 4}, previous_reload="engine: {max_num_seqs: 6}\n")
    assert run(world.recover(intent)) == "left"
    assert world.dropin.read_text() == "engine: {max_num_seqs: 6}\n"  # restored
    assert world.restarts() == 0 and "drain" not in world.probe.calls
    assert world.probe.calls[-1] == "resume" and world.records.intent("tiny") is None


def test_recovery_drains_then_restarts_an_engine_that_runs_neither(world):
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine = None  # the new engine failed to start before the crash
    assert run(world.recover(intent)) == "restarted"
    assert not world.dropin.exists() and world.restarts() == 1
    assert world.probe.calls.index("drain") < len(world.probe.calls) - 1
    assert world.probe.engine["max_num_seqs"] == 8 and world.probe.calls[-1] == "resume"
    assert world.probe.outcomes[-1] == "recovered"


def test_recovery_does_not_restart_an_engine_that_will_not_drain(world):
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine = {"max_num_seqs": 99}  # something else entirely
    world.probe.drain_result = control.Drained(drained=False, remaining=2, state="draining")
    assert run(world.recover(intent)) == "left"
    assert world.restarts() == 0 and not world.dropin.exists()


def test_recovery_of_a_stopped_model_restores_files_and_starts_nothing(world):
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine = None
    world.bus.unit(units.umbrella("tiny"))["ActiveState"] = "inactive"
    assert run(world.recover(intent)) == "restored"
    assert not world.dropin.exists() and world.restarts() == 0 and "resume" not in world.probe.calls


def test_recovery_does_not_commit_a_target_that_fails_verification(world):
    """Health alone is not a verify: the smoke request and the weights check
    must pass too, or recovery undoes the reload."""
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine_started()  # the engine reports the target on /health ...
    verified = []

    async def smoke_fails(cfg, weights_before, slot="main"):
        verified.append((cfg.engine.max_num_seqs, weights_before))
        if world.probe.engine["max_num_seqs"] == 4:
            raise VerifyFailed("smoke request answered 500")  # ... but cannot serve

    world.probe.verify_engine = smoke_fails
    assert run(world.recover(intent)) == "restarted"
    assert verified[0] == (4, (7, 8))  # against the intent's target and its weights
    assert world.probe.engine["max_num_seqs"] == 8 and not world.dropin.exists()
    assert world.records.committed("tiny") is None  # nothing verified, nothing committed


def test_recovery_after_a_crash_inside_the_rollback_finishes_the_rollback_not_a_false_commit(world):
    """The rollback had restored the files when the manager died; the engine
    still ran the failed target. The record must never say the restored config
    while the engine runs the target."""
    intent = intent_of(world, {"max_num_seqs": 4})
    world.probe.engine_started()  # runs the target
    world.dropin.unlink()  # the rollback's restore came first
    run(world.recover(intent))
    committed = world.records.committed("tiny")
    assert world.probe.engine["max_num_seqs"] == 8 and world.restarts() == 1
    assert committed is None  # not the restored config beside an engine that ran the target


def pin_file(world: World) -> Path:
    return world.root / "models/tiny.d" / R.ROLLBACK_DROPIN


@pytest.mark.parametrize("strategy", ["restart", "overlap", "standby"])
def test_a_manager_killed_in_the_rollback_of_a_refused_admin_dropin_leaves_the_pin_it_wrote(tmp_path, strategy):
    """An engine refuses the administrator's own drop-in (an empty patch);
    the rollback pins the values it ran before in 99-rollback.yaml and the
    manager dies as the rollback's engine restart begins. Recovery keeps the
    pin (it is in the intent): the files say the previous values, the engine
    runs them, and no later engine start runs the refused ones."""
    world = World(tmp_path, strategy="restart" if strategy == "restart" else "overlap",
                  standby=strategy == "standby")
    (world.root / "models/tiny.d").mkdir()
    (world.root / "models/tiny.d/50-admin.yaml").write_text("engine: {max_num_seqs: 6}\n")
    world.bus.job_results[units.engine("tiny")] = ["failed"]  # the main engine refuses 6 at start

    async def scenario() -> str:
        await world.connect()
        op = R.Operation(id=1, model="tiny", patch={})
        reload = R.Reload(world.model(), op)
        await reload.check()
        assert op.strategy_name == strategy
        task = None

        def killed_in_rollback(o: R.Operation) -> None:
            if o.stage == R.Stage.ROLLBACK:
                task.cancel()  # the manager ends at the rollback's first wait: its engine restart

        op.on_change = killed_in_rollback
        task = asyncio.create_task(reload.run())
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # systemd finishes the jobs it had
        assert op.state == R.State.RUNNING and pin_file(world).exists()
        intent = world.records.intent("tiny")
        assert intent is not None and intent.rollback_pin == pin_file(world).read_text()
        return await world.recover(intent)

    assert run(scenario()) == "restarted"
    assert yaml.safe_load(pin_file(world).read_text())["engine"]["max_num_seqs"] == 8
    assert config.load_model("tiny", world.root).config.engine.max_num_seqs == 8
    assert world.probe.engine["max_num_seqs"] == 8 and world.probe.slot == "main"
    if strategy == "standby":
        assert world.probe.standby_engine["max_num_seqs"] == 8
    assert world.records.intent("tiny") is None


@pytest.mark.parametrize("case", ["earlier pin", "pin recorded, not yet written"])
def test_recovery_puts_back_99_rollback_as_the_intent_says(world, case):
    """A non-empty previous_rollback (a pin from an earlier failed reload) is
    put back when the reload did not pin anything itself; a pin the reload
    recorded (rollback_pin) wins over it, written by recovery when the
    manager died between the record and the file."""
    earlier = "# an earlier rollback\nengine: {max_num_seqs: 8}\n"
    ours = "# this reload's rollback\nengine: {max_num_seqs: 8}\n" if case != "earlier pin" else None
    intent = intent_of(world, {"max_num_seqs": 4}, previous_rollback=earlier, rollback_pin=ours)
    pin_file(world).write_text("engine: {max_num_seqs: 4}\n")  # what else might be there now
    assert run(world.recover(intent)) == "left"
    assert pin_file(world).read_text() == (ours or earlier)
    assert world.records.intent("tiny") is None


# ---------------------------------------------------------------- the weight daemon


def test_an_engine_on_another_weight_daemon_fails_verify_and_reuses_no_weights(world):
    """model-weights@tiny started again while the engine restarted (the
    engine, BindsTo= it, came up on the new daemon): verify's "same weight
    daemon" rule refuses it, so the reload does not end done and
    WeightsReused stays false."""
    started = world.probe.engine_started

    def on_a_new_daemon(slot: str = "main") -> None:
        world.probe.daemon_restarted()
        started(slot)

    world.probe.engine_started = on_a_new_daemon
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state != R.State.DONE and not op.weights_reused
    assert "the weight daemon changed (pid, inode) (7, 8) -> " in op.error, op.error


def test_a_weights_restart_job_gives_the_daemon_a_new_identity(world):
    before = run(world.probe.weights_identity())

    async def restart_weights():
        await world.connect()
        await world.systemd.restart(units.weights("tiny"), timeout=5)

    run(restart_weights())
    assert run(world.probe.weights_identity()) != before


def test_a_fixed_key_changed_on_disk_is_not_editable_until_the_model_restarts(world):
    """The committed record holds the weight daemon it was verified on
    (Committed.weights). A fixed key changed on disk since is NotEditable
    while that daemon still runs; once another runs (systemctl restart
    model@tiny, which read the disk at its start), the record's fixed keys
    are what ran before it and the reload goes ahead."""
    assert run(world.reload({"max_num_seqs": 4})).state == R.State.DONE
    assert world.records.committed("tiny").weights == (7, 8)
    model_yaml = world.root / "models/tiny.yaml"
    model_yaml.write_text(model_yaml.read_text() + "served_model_name: renamed\n")

    async def check(patch: dict) -> None:
        await world.connect()
        await R.check_only(world.model(), patch)

    with pytest.raises(errors.NotEditable, match="fixed field.*served_model_name.*changed on disk"):
        run(check({"max_num_seqs": 3}))
    world.probe.daemon_restarted()  # the model's units started again
    run(check({"max_num_seqs": 3}))  # no longer refused
    op = run(world.reload({"max_num_seqs": 3}))
    assert op.state == R.State.DONE
    assert world.records.committed("tiny").fixed["served_model_name"] == "renamed"


def restart_model(world) -> None:
    """systemctl restart model@tiny as the fake systemd runs it: the weight
    daemon's unit records the disk it starts on (its ExecStartPre=,
    start_record.py), then another daemon runs."""
    async def restart():
        await world.connect()
        await world.systemd.restart(units.weights("tiny"), timeout=5)

    run(restart())


def test_after_a_restart_a_fixed_key_changed_on_disk_is_refused_and_reverting_it_is_not(world):
    """Issue 53: the start record says what the restart read. A fixed key
    changed after it is NotEditable (it was accepted, and committed as
    running, whenever the daemon had restarted since the last commit);
    putting it back is accepted (it was refused as changed on disk)."""
    assert run(world.reload({"max_num_seqs": 4})).state == R.State.DONE
    restart_model(world)
    assert world.records.running("tiny").fixed["gateway"]["retry_after"] == 5
    dropin = world.root / "models/tiny.d/40-fixed.yaml"
    dropin.write_text("gateway:\n  retry_after: 7\n")

    async def check(patch: dict):
        await world.connect()
        return await R.check_only(world.model(), patch)

    with pytest.raises(errors.NotEditable, match="fixed field.*gateway.*changed on disk"):
        run(check({"max_num_seqs": 3}))
    with pytest.raises(errors.NotEditable, match="gateway"):
        run(world.reload({"max_num_seqs": 3}))
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    dropin.unlink()  # reverted: what runs again
    run(check({"max_num_seqs": 3}))
    assert run(world.reload({"max_num_seqs": 3})).state == R.State.DONE
    assert world.records.running("tiny").fixed["gateway"]["retry_after"] == 5


def test_a_fixed_key_changed_before_a_restart_runs_after_it_and_is_what_running_says(world):
    assert run(world.reload({"max_num_seqs": 4})).state == R.State.DONE
    dropin = world.root / "models/tiny.d/40-fixed.yaml"
    dropin.write_text("gateway:\n  retry_after: 7\n")
    with pytest.raises(errors.NotEditable):
        run(R.check_only(world.model(), {"max_num_seqs": 3}))
    restart_model(world)  # applies it: the units read the disk
    assert world.records.running("tiny").fixed["gateway"]["retry_after"] == 7
    assert run(world.reload({"max_num_seqs": 3})).state == R.State.DONE
    assert world.records.running("tiny") == world.records.committed("tiny")  # the commit is newer


def test_an_engine_that_reports_another_weight_daemon_fails_verify(world):
    """The daemon answering the manager is the one from before, but the new
    engine says it attached another (pid, inode): not the weights retained."""
    started = world.probe.engine_started

    def attached_elsewhere(slot: str = "main") -> None:
        started(slot)
        world.probe.attached[slot] = (9, 9)

    world.probe.engine_started = attached_elsewhere
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state != R.State.DONE and not op.weights_reused
    assert "the engine attached to (9, 9)" in op.error, op.error
