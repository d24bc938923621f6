"""The manager's CheckReload (`hostctl reload --check`) against a fake systemd
and probe: it answers what the reload would change and which strategy would
run, refuses exactly what Reload refuses with the same error and message,
says unchanged when the engine runs the target already, and changes nothing
at all: no drop-in, no record, no unit job, no gateway verb, no operation id
taken, no Operation on the bus; and it needs no polkit."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest
from dbus_fast.errors import DBusError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd.manager import model_bus, service  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.systemd1 import MANAGER  # noqa: E402
from hostd.manager.tasks import pending as kept_tasks  # noqa: E402

# The gateway and unit verbs a check must never send (reads only).
CHANGING_PROBE_CALLS = ("drain", "resume", "switch", "settle", "rebuild", "verify")


def call(dbus_method, *args):
    """Call a D-Bus method as the bus would, with no caller (so polkit, if
    asked, refuses: only a read-only method answers)."""
    return dbus_method.__wrapped__(dbus_method.__self__, *args)


async def manager_of(world: World, monkeypatch) -> service.Manager:
    monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)
    await world.connect()
    manager = service.Manager(world.bus, world.systemd, world.root, world.records)
    manager.discover()
    await asyncio.gather(*kept_tasks())
    return manager


def snapshot(world: World) -> dict:
    """Every file under the config root and the manager's records, with content."""
    files = {}
    for top in (world.root, world.records.root):
        if top.exists():
            files.update({str(p): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()})
    return files


def assert_nothing_changed(world: World, manager: service.Manager, before: dict, sent_before: int) -> None:
    assert snapshot(world) == before  # the operation counter's file too: no id was taken
    jobs = [m for m in world.bus.sent[sent_before:] if m.startswith(MANAGER) and m.endswith("Unit")
            and not m.endswith("LoadUnit")]
    assert jobs == [], jobs
    assert not [c for c in world.probe.calls if c.split()[0] in CHANGING_PROBE_CALLS], world.probe.calls
    assert manager.operations == {} and manager.models["tiny"].active is None


def test_a_valid_check_says_what_would_change_and_the_strategy_and_changes_nothing(tmp_path, monkeypatch):
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        before, sent = snapshot(world), len(world.bus.sent)
        answer = json.loads(await call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 4}'))
        running = world.probe.engine
        assert answer == {
            "model": "tiny", "outcome": "reload", "patch": {"max_num_seqs": 4},
            "changes": {"max_num_seqs": {"old": running["max_num_seqs"], "new": 4}},
            "strategy": "overlap", "reason": "room for a second engine beside the serving one",
            "notes": [], "weights_not_retained": "",
        }
        assert_nothing_changed(world, manager, before, sent)
        # The a{sv} twin and the model object's method answer the same.
        assert json.loads(await call(manager.CheckReload, "tiny", {"max_num_seqs": 4})) == answer
        assert json.loads(await call(manager.models["tiny"].CheckReload, {"max_num_seqs": 4})) == answer
        assert_nothing_changed(world, manager, before, sent)
        # And the reload then does what the check said.
        await manager.reload("tiny", {"max_num_seqs": 4})
        await asyncio.gather(*kept_tasks())
        [op] = manager.operations.values()
        assert op.op.id == 1  # the checks took no id
        assert (op.op.state, op.op.strategy_name) == (R.State.DONE, "overlap")
        assert world.probe.engine["max_num_seqs"] == 4

    asyncio.run(go())


def test_a_check_names_the_restart_fallback_and_its_reason(tmp_path, monkeypatch):
    world = World(tmp_path)
    world.probe.no_room = "a second engine needs 900 MiB, 100 MiB available"

    async def go():
        manager = await manager_of(world, monkeypatch)
        answer = json.loads(await call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 2}'))
        assert answer["strategy"] == "restart"
        assert answer["reason"] == ("overlap does not fit, falling back to restart: "
                                    "a second engine needs 900 MiB, 100 MiB available")
        assert answer["notes"] == [f"strategy restart: {answer['reason']}"]

    asyncio.run(go())


def test_an_unchanged_patch_is_said_unchanged(tmp_path, monkeypatch):
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        before, sent = snapshot(world), len(world.bus.sent)
        running = world.probe.engine["max_num_seqs"]
        answer = json.loads(await call(manager.CheckReloadJSON, "tiny", json.dumps({"max_num_seqs": running})))
        assert answer["outcome"] == "unchanged" and answer["changes"] == {} and answer["strategy"] == ""
        assert "a reload would restart nothing" in answer["reason"]
        assert "memory" not in world.probe.calls  # validate ended it, as it ends the reload
        assert_nothing_changed(world, manager, before, sent)

    asyncio.run(go())


@pytest.mark.parametrize("patch, kind, names", [
    ({"max_num_seqs": 0}, "InvalidValue", "max_num_seqs"),
    ({"max_num_seqs": "lots"}, "InvalidValue", "max_num_seqs"),
    ({"device": "cuda"}, "NotEditable", "'device' is fixed"),
    ({"nonsense": 1}, "NotEditable", "'nonsense' is not a field of the builtin backend"),
])
def test_a_check_refuses_as_reload_does_naming_the_key(tmp_path, monkeypatch, patch, kind, names):
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        before, sent = snapshot(world), len(world.bus.sent)
        with pytest.raises(DBusError) as checked:
            await call(manager.CheckReloadJSON, "tiny", json.dumps(patch))
        assert checked.value.type == f"org.hostd1.Error.{kind}" and names in checked.value.text, checked.value.text
        assert_nothing_changed(world, manager, before, sent)
        # Reload's own refusal (as root through polkit) is the same error, word for word.
        monkeypatch.setattr(manager.authority, "require", _allow)
        with pytest.raises(DBusError) as reloaded:
            await call(manager.ReloadJSON, "tiny", json.dumps(patch))
        assert (reloaded.value.type, reloaded.value.text) == (checked.value.type, checked.value.text)

    asyncio.run(go())


def test_a_kv_budget_that_cannot_hold_one_request_is_refused_by_the_check_and_the_reload(tmp_path, monkeypatch):
    """The engine's start-time KV rule before anything is torn down (issue 31):
    kv_cache_mib 128 on a checkpoint of 32768 positions, max_model_len unset."""
    world = World(tmp_path)
    config = {"num_hidden_layers": 48, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896,
              "max_position_embeddings": 32768, "dtype": "bfloat16"}
    (tmp_path / "checkpoint" / "config.json").write_text(json.dumps(config))

    async def go():
        manager = await manager_of(world, monkeypatch)
        before, sent = snapshot(world), len(world.bus.sent)
        with pytest.raises(DBusError) as checked:
            await call(manager.CheckReloadJSON, "tiny", '{"kv_cache_mib": 128}')
        assert checked.value.type == "org.hostd1.Error.InvalidValue"
        assert ("engine.kv_cache_mib: the KV budget of 134217728 bytes holds 5456 tokens (24576 bytes each), "
                "fewer than one request of max_model_len=32768") in checked.value.text, checked.value.text
        assert_nothing_changed(world, manager, before, sent)
        monkeypatch.setattr(manager.authority, "require", _allow)
        with pytest.raises(DBusError) as reloaded:
            await call(manager.ReloadJSON, "tiny", '{"kv_cache_mib": 128}')
        assert (reloaded.value.type, reloaded.value.text) == (checked.value.type, checked.value.text)
        assert not world.dropin.exists() and world.restarts() == 0  # refused before anything was written

    asyncio.run(go())


async def _allow(*args, **kwargs) -> None:
    return None


def test_a_check_refuses_a_stopped_model_and_a_busy_one_as_reload_does(tmp_path, monkeypatch):
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        release = asyncio.Event()

        async def drain(timeout):  # the reload waits in its drain while we check
            await release.wait()
            return world.probe.drain_result

        world.probe.drain = drain
        (world.root / "models/tiny.d").mkdir()
        (world.root / "models/tiny.d/40-restart.yaml").write_text("reload:\n  strategy: restart\n")
        manager.models["tiny"].forget()
        await manager.reload("tiny", {"max_num_seqs": 2})
        with pytest.raises(DBusError) as busy:
            await call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 3}')
        assert busy.value.type == "org.hostd1.Error.Busy"
        assert busy.value.text == "model tiny is busy with operation 1; wait for it or cancel it"
        release.set()
        await asyncio.gather(*kept_tasks())
        world.bus.set_state("model@tiny.service", "inactive")
        with pytest.raises(DBusError) as stopped:
            await call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 3}')
        assert stopped.value.type == "org.hostd1.Error.NotRunning"
        with pytest.raises(DBusError) as ghost:
            await call(manager.CheckReloadJSON, "ghost", "{}")
        assert ghost.value.type == "org.hostd1.Error.NoSuchModel"

    asyncio.run(go())


def test_a_check_with_a_standby_says_standby_and_journals_no_stage(tmp_path, monkeypatch, caplog):
    world = World(tmp_path, standby=True)

    def stage_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "stage" in r.getMessage() or "reload 0" in r.getMessage()]

    async def go():
        manager = await manager_of(world, monkeypatch)
        # A stage line is INFO (operation.Operation.enter): caught at DEBUG,
        # not at the WARNING the root logger passes on by default.
        caplog.set_level(logging.DEBUG)
        caplog.clear()
        answer = json.loads(await call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 3}'))
        assert (answer["strategy"], answer["reason"]) == ("standby", "the warm standby rebuilds on the new config")
        assert world.probe.rebuilds == []  # the standby was asked nothing but /health
        assert stage_lines() == []
        # What the check would have written, had it been a reload: seen here.
        op = await world.reload({"max_num_seqs": 3})
        assert "reload 1 of tiny: stage preflight" in stage_lines() and op.state == R.State.DONE

    asyncio.run(go())


def test_checks_of_one_model_run_one_at_a_time(tmp_path, monkeypatch):
    """Any user may send checks (no polkit): a burst of them runs in turn, so
    the root manager never runs two of one model's preflights at once."""
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        running, most = 0, 0
        real = R.check_only

        async def counted(model, patch):
            nonlocal running, most
            running += 1
            most = max(most, running)
            try:
                await asyncio.sleep(0.01)
                return await real(model, patch)
            finally:
                running -= 1

        monkeypatch.setattr(R, "check_only", counted)
        answers = await asyncio.gather(*(call(manager.CheckReloadJSON, "tiny", '{"max_num_seqs": 4}')
                                         for _ in range(8)))
        assert most == 1 and len({a for a in answers}) == 1

    asyncio.run(go())


@pytest.mark.parametrize("patch, names", [
    ({"max_num_seqs": "x" * (4 << 20)}, "engine.max_num_seqs: the value takes more than 8192 bytes"),  # as JSON
    ({"max_num_seqs": "8", "batching": "none"}, "engine.max_num_seqs: expected `int`, got `str`"),
])
def test_a_patch_is_weighed_and_typed_before_it_is_rendered_naming_the_key(tmp_path, monkeypatch, patch, names):
    # Issue 33, N1: any local user's patch was rendered to YAML on root's only
    # loop before its type was checked (a 4M-character value: 4.9 s).
    world = World(tmp_path)

    def never(*args, **kwargs):
        raise AssertionError("the patch was rendered")

    async def go():
        manager = await manager_of(world, monkeypatch)
        monkeypatch.setattr(R, "render", never)
        for method, argument in ((manager.CheckReload, patch), (manager.CheckReloadJSON, json.dumps(patch))):
            with pytest.raises(DBusError) as checked:
                await call(method, "tiny", argument)
            assert checked.value.type == "org.hostd1.Error.InvalidValue", checked.value.text
            assert names in checked.value.text or "bytes of JSON" in checked.value.text, checked.value.text

    asyncio.run(go())


def test_a_json_patch_over_8_kib_is_refused_before_it_is_parsed(monkeypatch):
    monkeypatch.setattr(service.json, "loads", lambda *a, **k: pytest.fail("the patch was parsed"))
    with pytest.raises(service.errors.InvalidValue, match="patch is 8193 bytes of JSON; at most 8192"):
        service.patch_from_json(" " * 8193)


@pytest.mark.parametrize("patch, said", [
    ({"max_num_seqs": 0}, "engine.max_num_seqs: expected `int` >= 1"),
    ({"batching": "x"}, "engine.batching: value 'x'; expected one of continuous, none"),
])
def test_a_patch_the_engine_struct_refuses_is_worded_as_the_loader_words_it(tmp_path, monkeypatch, patch, said):
    """The patch is typed before it is rendered (issue 33, N1); its refusal keeps
    the loader's words (tests/system/test_verbs.py reads them through hostctl)."""
    world = World(tmp_path)

    async def go():
        manager = await manager_of(world, monkeypatch)
        with pytest.raises(DBusError) as checked:
            await call(manager.CheckReloadJSON, "tiny", json.dumps(patch))
        assert checked.value.text == said

    asyncio.run(go())
