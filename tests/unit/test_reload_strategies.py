"""The strategies as the bus shows them (hostd/manager/strategies/,
org.hostd1.Operation's Stages and Cancellable): each reload publishes its
strategy's stages and whether Cancel() would be honoured now, with a
PropertiesChanged at every transition, and Cancel() agrees with Cancellable.
Driven through the manager with the fake systemd and probe of
reload_fakes.py; the expected paths are spelled here, from docs/dbus-api.md,
not read from the module under test.

Another strategy (beside restart, overlap, standby, swap, in-place) needs no file: a dummy
one, defined here, runs through the same manager and Operation object and
publishes its own stages and Cancellable, and recovery after a crash under it
calls its own hooks."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Optional

import pytest
import yaml
from dbus_fast import Variant

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402
from test_reload_dbus_api import as_root, dbus, finished, manager_of, operation, refused  # noqa: E402

from hostd.manager import operation_bus, strategies  # noqa: E402
from hostd.manager.operation import Stage  # noqa: E402

PATHS = {  # docs/dbus-api.md, "Stages"
    "restart": ["validate", "preflight", "record", "drain", "restart", "verify", "resume", "commit", "finished"],
    "overlap": ["validate", "preflight", "record", "start-next", "switch", "settle", "restart", "verify",
                "resume", "retire", "commit", "finished"],
    "standby": ["validate", "preflight", "record", "rebuild", "switch", "settle", "restart", "verify",
                "resume", "commit", "finished"],
    "in-place": ["validate", "preflight", "record", "rebuild", "verify", "commit", "finished"],
}
CANCELLABLE = {  # docs/dbus-api.md, "Cancel()": until the drain, or until the switch
    "restart": {"preflight", "record", "drain"},
    "overlap": {"preflight", "record", "start-next"},
    "standby": {"preflight", "record", "rebuild"},
    "in-place": {"preflight", "record"},
}


def world_for(tmp_path: Path, strategy: str, monkeypatch) -> World:
    world = World(tmp_path, strategy=strategy if strategy in ("restart", "in-place") else "overlap",
                  standby=strategy == "standby")
    as_root(world, monkeypatch)
    return world


def record_changes(monkeypatch) -> list[dict]:
    """Every PropertiesChanged of a transition an Operation object emits, in
    order (not those of the engine's STATUS= alone)."""
    seen: list[dict] = []
    monkeypatch.setattr(operation_bus.OperationInterface, "emit_properties_changed",
                        lambda self, changed, invalidated=(): "Stage" in changed and seen.append(dict(changed)))
    return seen


@pytest.mark.parametrize("strategy", sorted(PATHS))
def test_every_transition_publishes_the_stages_and_whether_cancel_is_honoured(tmp_path, monkeypatch, strategy):
    world = world_for(tmp_path, strategy, monkeypatch)
    seen = record_changes(monkeypatch)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        return await finished(world, path), operation(world, path)

    state, op = asyncio.run(go())
    assert (state, op.Strategy) == ("done", strategy)
    assert op.Stages == PATHS[strategy] and op.Cancellable is False
    # A PropertiesChanged at every transition, from preflight (the reload is
    # published once checked) to finished (entered, then ended done), each
    # with both properties.
    assert stages_of(seen) == PATHS[strategy][1:]
    assert (seen[-1]["State"], seen[-1]["Cancellable"]) == ("done", False)
    assert all(change["Stages"] == PATHS[strategy] for change in seen)
    assert {change["Stage"] for change in seen if change["Cancellable"]} == CANCELLABLE[strategy]


def stages_of(changes: list[dict]) -> list[str]:
    """The stages CHANGES pass through, in order (a stage's repeats are one)."""
    stages: list[str] = []
    for change in changes:
        if not stages or stages[-1] != change["Stage"]:
            stages.append(change["Stage"])
    return stages


def hold(world: World, strategy: str) -> asyncio.Event:
    """The stage that prepares the new config (drain, start-next, rebuild)
    waits until the returned event is set."""
    release = asyncio.Event()
    probe = world.probe
    if strategy == "restart":
        real_drain = probe.drain

        async def drain(timeout):
            await release.wait()
            return await real_drain(timeout)
        probe.drain = drain
    elif strategy == "standby":
        real_rebuild = probe.rebuild

        async def rebuild(engine, slot="standby"):
            await release.wait()
            return await real_rebuild(engine, slot)
        probe.rebuild = rebuild
    else:
        real_verify = probe.verify_engine

        async def verify(cfg, weights, slot="main", **more):
            if slot == "next":
                await release.wait()
            return await real_verify(cfg, weights, slot, **more)
        probe.verify_engine = verify
    return release


@pytest.mark.parametrize("strategy,stage", [("restart", "drain"), ("overlap", "start-next"), ("standby", "rebuild")])
def test_cancel_is_honoured_exactly_where_cancellable_says_so(tmp_path, monkeypatch, strategy, stage):
    """The standby's rebuild among them: the Cockpit page once hid Cancel there."""
    world = world_for(tmp_path, strategy, monkeypatch)
    release = hold(world, strategy)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        op = operation(world, path)
        while op.Stage != stage:
            await asyncio.sleep(0.001)
        cancellable = op.Cancellable
        await dbus(op.Cancel)
        release.set()
        return cancellable, await finished(world, path), op

    cancellable, state, op = asyncio.run(go())
    assert cancellable is True
    assert (state, op.Restored, op.Cancellable) == ("cancelled", True, False)
    assert not world.dropin.exists()


def test_past_the_switch_cancellable_is_false_and_cancel_answers_busy(tmp_path, monkeypatch):
    world = world_for(tmp_path, "standby", monkeypatch)
    release = asyncio.Event()
    real_settle = world.probe.settle

    async def settle(slot, timeout):
        await release.wait()
        return await real_settle(slot, timeout)
    world.probe.settle = settle

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        op = operation(world, path)
        while op.Stage != "settle":
            await asyncio.sleep(0.001)
        cancellable, error = op.Cancellable, await refused(op.Cancel)
        release.set()
        return cancellable, error, await finished(world, path)

    cancellable, error, state = asyncio.run(go())
    assert cancellable is False
    assert error.type == "org.hostd1.Error.Busy"
    assert error.text == "operation 1 is past its switch to the standby (settle); it cannot be cancelled now"
    assert state == "done"


def test_start_stop_and_restart_operations_publish_no_stages_and_are_not_cancellable(tmp_path, monkeypatch):
    world = world_for(tmp_path, "overlap", monkeypatch)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Restart, "tiny")
        op = operation(world, path)
        return (op.Stages, op.Cancellable), await finished(world, path)

    (stages, cancellable), state = asyncio.run(go())
    assert (stages, cancellable, state) == ([], False, "done")


class Drainless(strategies.Strategy):
    """A dummy fifth strategy: restart the engine without a drain (no
    Cancel past record). Everything it needs is what a Strategy subclass in
    its own file of hostd/manager/strategies/ would define."""

    name = "drainless"
    stages = (Stage.VALIDATE, Stage.PREFLIGHT, Stage.RECORD, Stage.RESTART, Stage.VERIFY, Stage.RESUME,
              Stage.COMMIT, Stage.FINISHED)
    cancel_until = Stage.RECORD
    cancel_ends = "its record"

    # prepare: none (no drain); restore: the base's (the file back);
    # the main engine restarted by the base's put_main_on.
    hand_back = staticmethod(strategies.Restart.hand_back)  # resume the gateway

    async def recover_engine(self, model, where: dict, reload_weights: bool = False) -> str:
        return await strategies.restart_main(model, where, reload_weights)

    async def recover_finish(self, model, outcome: str, where: dict) -> None:
        await strategies.RESTART.recover_finish(model, outcome, where)


def test_a_fifth_strategy_runs_publishes_itself_and_is_recovered_with_nothing_but_its_object(tmp_path, monkeypatch):
    world = world_for(tmp_path, "overlap", monkeypatch)
    seen = record_changes(monkeypatch)
    drainless = Drainless()

    async def choose(run, memory) -> tuple[strategies.Strategy, Optional[str]]:
        return drainless, "a test's dummy"
    monkeypatch.setattr(strategies, "choose", choose)
    monkeypatch.setitem(strategies.STRATEGIES, drainless.name, drainless)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        return await finished(world, path), operation(world, path)

    state, op = asyncio.run(go())
    assert (state, op.Strategy, op.WeightsReused) == ("done", "drainless", True)
    assert stages_of(seen) == ["preflight", "record", "restart", "verify", "resume", "commit", "finished"]
    assert {change["Stage"] for change in seen if change["Cancellable"]} == {"preflight", "record"}
    assert op.Stages == ["validate", *stages_of(seen)]
    assert "drain" not in world.probe.calls and world.probe.engine["max_num_seqs"] == 4
    assert yaml.safe_load(world.dropin.read_text()) == {"engine": {"max_num_seqs": 4}}
    assert strategies.named("drainless") is drainless  # recovery finds it by its intent's name

    # A manager that died mid-reload under it: recovery calls its hooks, by its name alone.
    before = world.dropin.read_text()
    restarts = world.restarts()
    intent = world.crashed_reload({"max_num_seqs": 2}, strategy="drainless", previous_reload=before)
    world.probe.engine = None  # the new engine failed before the crash
    assert asyncio.run(world.recover(intent)) == "restarted"
    assert world.dropin.read_text() == before and world.records.intent("tiny") is None
    assert world.restarts() == restarts + 1 and world.probe.engine["max_num_seqs"] == 4
    assert world.probe.calls[-1] == "resume" and world.probe.outcomes[-1] == "recovered"
