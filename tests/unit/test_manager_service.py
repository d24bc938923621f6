"""The manager's D-Bus surface without a bus: a model's State follows its
units' signals and its operations (right as a reload ends), finished
operations are kept to the last 64, a model whose YAML goes away leaves the
bus, properties parse the YAML only when a file changed, and every refusal
reaches a caller as one of hostd's D-Bus errors."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from dbus_fast.errors import DBusError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd import backends, units  # noqa: E402
from hostd.config import ConfigError, Problem  # noqa: E402
from hostd.manager import api, errors, model_bus, service  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.records import Degraded  # noqa: E402
from hostd.manager.tasks import pending as kept_tasks  # noqa: E402


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def call(dbus_method, *args):
    """Call a D-Bus method of an interface as the bus would (dbus-fast's
    decorator drops the result of a direct call)."""
    return dbus_method.__wrapped__(dbus_method.__self__, *args)


async def manager_of(world: World) -> service.Manager:
    await world.connect()
    manager = service.Manager(world.bus, world.systemd, world.root, world.records)
    manager.discover()
    await asyncio.gather(*kept_tasks())  # tracking: one GetAll per unit
    return manager


def test_state_follows_unit_signals_and_is_right_as_a_reload_ends(world, monkeypatch):
    monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)

    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        assert model.state == "serving"
        seen = []
        path = await manager.reload("tiny", {"max_num_seqs": 4})
        op = manager.operations[1].op
        ended = asyncio.Event()  # as a client waits: on the change that ends it
        op.on_change = (lambda inner: lambda o: (inner(o), seen.append((o.stage.value, model.state)),
                                                 o.state != R.State.RUNNING and ended.set()))(op.on_change)
        model.refresh(0, "draining")  # what the in-flight watch saw from the gateway mid-reload
        await ended.wait()
        assert path == api.operation_path(1)
        assert seen[-1] == ("finished", "serving")  # not "reloading" a moment longer
        assert ("restart", "reloading") in seen
        model.refresh(0, "paused")  # the gateway's own word, e.g. after a resume that failed
        assert model.state == "paused"
        model.refresh(0, "serving")
        assert model.state == "serving"
        world.bus.set_state(units.engine("tiny"), "inactive")
        assert model.state == "engine-down"
        world.bus.set_state(units.engine("tiny"), "failed")  # past its restarts (hostctl is-failed)
        assert model.state == "failed"
        world.bus.set_state(units.umbrella("tiny"), "deactivating")
        assert model.state == "stopping"
        world.bus.set_state(units.umbrella("tiny"), "failed")
        assert model.state == "failed"
        world.bus.set_state(units.umbrella("tiny"), "inactive")
        assert model.state == "stopped"

    asyncio.run(go())


def test_degraded_outlives_the_next_operation_and_the_manager_and_ends_when_the_model_stops(world):
    world.records.write_degraded("tiny", Degraded(operation=3, cause="engine failed; rollback failed: engine failed"))

    async def go():
        manager = await manager_of(world)  # a manager started after the failed rollback
        model = manager.models["tiny"]
        assert model.state == "degraded"
        iface = manager.new_operation(model, "start", {})  # the next operation
        manager.publish(iface)
        assert model.state == "degraded"
        iface.op.finish(R.State.FAILED, "start: the umbrella is active already")
        assert model.state == "degraded"
        world.bus.set_state(units.umbrella("tiny"), "deactivating")  # systemctl stop|restart model@tiny
        assert model.state == "stopping" and world.records.degraded("tiny") is None
        world.bus.set_state(units.umbrella("tiny"), "active")
        assert model.state == "serving"

    asyncio.run(go())


def test_only_the_last_64_finished_operations_stay_on_the_bus(world):
    async def go():
        manager = await manager_of(world)
        removed = []
        manager.OperationRemoved = lambda *args: removed.append(args)
        model = manager.models["tiny"]
        for _ in range(70):
            iface = manager.new_operation(model, "start", {})
            manager.publish(iface)
            iface.op.finish(R.State.DONE)
        return manager, removed

    manager, removed = asyncio.run(go())
    assert sorted(manager.operations) == list(range(7, 71))
    assert [r[0] for r in removed] == list(range(1, 7))
    assert api.operation_path(6) not in manager.bus.exported
    assert api.operation_path(70) in manager.bus.exported


def test_a_model_whose_yaml_is_deleted_leaves_the_bus(world):
    async def go():
        manager = await manager_of(world)
        assert api.model_path("tiny") in manager.bus.exported
        (world.root / "models/tiny.yaml").unlink()
        assert await call(manager.ListModels) == []
        assert api.model_path("tiny") not in manager.bus.exported
        with pytest.raises(DBusError) as refused:
            await call(manager.GetModel, "tiny")
        assert refused.value.type == "org.hostd1.Error.NoSuchModel"

    asyncio.run(go())


def test_properties_parse_the_yaml_only_when_a_file_changed(world, monkeypatch):
    parsed = []
    real = service.hostd_config.load_model
    monkeypatch.setattr(service.hostd_config, "load_model", lambda *a: parsed.append(a) or real(*a))

    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        for _ in range(5):
            model.Backend, model.Config, model.EditableFields  # noqa: B018 - property reads
        assert len(parsed) == 1
        (world.root / "models/tiny.d").mkdir()
        (world.root / "models/tiny.d/50-x.yaml").write_text("engine: {max_num_seqs: 3}\n")
        assert '"max_num_seqs": 3' in model.Config
        assert len(parsed) == 2

    asyncio.run(go())


def test_config_problem_says_why_the_yaml_does_not_load_and_never_a_value(world):
    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        assert model.ConfigProblem == ""
        (world.root / "models/tiny.d").mkdir()
        (world.root / "models/tiny.d/50-x.yaml").write_text("engine: {max_num_seqs: s3cret}\n")
        problem = model.ConfigProblem
        assert problem.startswith(f"{world.root}/models/tiny.d/50-x.yaml:1: engine.max_num_seqs:"), problem
        assert "s3cret" not in problem and model.Config == "{}"
        assert [row[0] for row in await call(manager.ListModels)] == ["tiny"]  # still listed

    asyncio.run(go())


def test_config_problem_never_shows_a_secret_that_holds_a_control_character(world):
    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        (world.root / "models/tiny.d").mkdir()
        (world.root / "models/tiny.d/50-x.yaml").write_text("env:\n  HF_TOKEN: |\n    hf_s3cret\n")
        problem = model.ConfigProblem
        assert "env.HF_TOKEN" in problem and "U+000A" in problem, problem
        assert "s3cret" not in problem

    asyncio.run(go())


def test_editable_schema_lists_the_editable_fields_with_the_ranges_the_manager_enforces(world):
    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        described = json.loads(model.EditableSchema)
        assert sorted(described["properties"]) == sorted(model.EditableFields)
        seqs = described["properties"]["max_num_seqs"]
        assert (seqs["type"], seqs["minimum"]) == ("integer", 1) and seqs["description"]
        for beyond in (seqs["minimum"] - 1, seqs["maximum"] + 1):  # what a client checks, the manager refuses
            with pytest.raises(errors.InvalidValue) as refused:
                await manager.reload("tiny", {"max_num_seqs": beyond})
            assert "max_num_seqs" in str(refused.value)
        assert described["properties"]["batching"]["enum"] == ["continuous", "none"]
        assert not world.dropin.exists()
        (world.root / "models/tiny.yaml").write_text("backend: [\n")
        assert model.EditableSchema == "{}"

    asyncio.run(go())


def test_reading_running_config_creates_nothing(world):
    async def go():
        manager = await manager_of(world)
        assert manager.models["tiny"].RunningConfig == "{}"

    asyncio.run(go())
    assert not world.records.root.exists()


def test_one_mapping_from_hostds_exceptions_to_dbus_errors():
    cases = [
        (errors.NotEditable("x"), "org.hostd1.Error.NotEditable"),
        (errors.Busy("x"), "org.hostd1.Error.Busy"),
        (errors.AccessDenied("x"), "org.freedesktop.DBus.Error.AccessDenied"),
        (backends.BackendRefused("no such backend"), "org.hostd1.Error.InvalidValue"),
        (ConfigError([Problem("f", "k", "bad")]), "org.hostd1.Error.InvalidValue"),
        (RuntimeError("bug"), "org.hostd1.Error.Failed"),
    ]
    for exc, name in cases:
        assert errors.to_dbus(exc).type == name


def test_mutating_methods_check_the_caller(world):
    async def go():
        manager = await manager_of(world)
        with pytest.raises(DBusError) as denied:
            await call(manager.Reload, "tiny", {})  # no caller: not through the bus
        assert denied.value.type == api.ACCESS_DENIED
        assert not world.dropin.exists()
        with pytest.raises(DBusError) as denied:
            await call(manager.models["tiny"].SetLogLevel, "", "debug")
        assert denied.value.type == api.ACCESS_DENIED
        assert world.bus.kills == []
        pin = world.dropin.with_name("99-rollback.yaml")
        pin.parent.mkdir(exist_ok=True)
        pin.write_text("engine: {max_num_seqs: 2}\n")
        with pytest.raises(DBusError) as denied:
            await call(manager.Revert, "tiny")
        assert denied.value.type == api.ACCESS_DENIED and pin.exists()

    asyncio.run(go())


def test_access_says_what_the_caller_may_do_as_the_mutating_methods_would_decide_and_does_nothing(world):
    async def go():
        manager = await manager_of(world)
        asked = []

        refused = "access denied: uid 1001 is not authorized to start, stop or restart a model (polkit action x)"

        async def require(action, details):  # a rule that grants stop and nothing else of manage
            asked.append((action, details))
            if action == api.MANAGE_ACTION and details["verb"] != "stop":
                raise errors.AccessDenied(refused)

        answer = await call(manager.Access, "tiny")  # no caller (not through the bus): refused, like Reload
        assert set(answer) == {*api.ACTIONS, *api.VERB_ACTIONS} and all(answer.values()), answer
        manager.authority.require = require
        assert await call(manager.Access, "tiny") == {
            "reload": "", "revert": "", "start": refused, "stop": "", "restart": refused, "cancel": refused,
            "log-level": "", api.RELOAD_ACTION: "", api.MANAGE_ACTION: refused, api.LOG_LEVEL_ACTION: ""}
        # polkit asked as each method asks it: its action and its verb
        assert asked == [(api.RELOAD_ACTION, {"model": "tiny", "verb": "reload"}),
                         (api.RELOAD_ACTION, {"model": "tiny", "verb": "revert"}),
                         (api.MANAGE_ACTION, {"model": "tiny", "verb": "start"}),
                         (api.MANAGE_ACTION, {"model": "tiny", "verb": "stop"}),
                         (api.MANAGE_ACTION, {"model": "tiny", "verb": "restart"}),
                         (api.MANAGE_ACTION, {"model": "tiny", "verb": "cancel"}),
                         (api.LOG_LEVEL_ACTION, {"model": "tiny", "verb": "log-level"})]
        with pytest.raises(DBusError) as missing:
            await call(manager.Access, "nope")
        assert missing.value.type == api.error_name("NoSuchModel")
        assert not world.dropin.exists() and manager.operations == {}

    asyncio.run(go())


def test_set_log_level_signals_the_main_process_of_each_running_unit_of_the_role_and_restarts_nothing(world):
    import logging
    import os

    from hostd import logs

    pids = {units.umbrella("tiny"): 101, units.engine("tiny"): 102, units.engine("tiny", "standby"): 104,
            units.weights("tiny"): 105}
    for unit, pid in pids.items():
        world.bus.unit(unit)["MainPID"] = pid
    # The overlap reload's slot is not running; a process that is still starting is not signalled
    # (it would die of a signal it has no handler for yet).
    world.bus.units[units.engine("tiny", "next")] = {"ActiveState": "inactive", "SubState": "dead", "MainPID": 0}

    async def go():
        manager = await manager_of(world)
        model = manager.models["tiny"]
        asked = []

        async def require(action, details):
            asked.append((action, details))

        manager.authority.require = require
        assert await call(model.SetLogLevel, "", "debug") == [
            ["gateway", units.umbrella("tiny"), 101], ["engine", units.engine("tiny"), 102],
            ["engine", units.engine("tiny", "standby"), 104], ["weights", units.weights("tiny"), 105]]
        debug = logs.level_signal("debug")
        assert world.bus.kills == [(unit, "main", debug) for unit in pids]  # main: not upstream's children
        assert asked == [(api.LOG_LEVEL_ACTION, {"model": "tiny", "verb": "log-level"})]
        world.bus.kills.clear()
        world.bus.set_state(units.engine("tiny", "standby"), "activating")
        assert await call(model.SetLogLevel, "engine", "warning") == [["engine", units.engine("tiny"), 102]]
        assert world.bus.kills == [(units.engine("tiny"), "main", logs.level_signal("warning"))]
        world.bus.kills.clear()
        try:  # the manager's own level: this process's, no unit signalled
            assert await call(model.SetLogLevel, "manager", "error") == [["manager", units.MANAGER, os.getpid()]]
            assert logging.getLogger().level == logging.ERROR and world.bus.kills == []
        finally:
            logging.getLogger().setLevel(logging.INFO)
        assert world.bus.job_log == []  # nothing started, stopped or restarted

    asyncio.run(go())


@pytest.mark.parametrize("role, level, error, says", [
    ("", "loud", "InvalidValue", "log level 'loud' is not one of debug, info, warning, error"),
    ("proxy", "debug", "InvalidValue", "role 'proxy' is not one of gateway, engine, weights, manager"),
    ("weights", "debug", "NotRunning", "model tiny has no weights process running to take a log level"),
])
def test_set_log_level_refuses_an_unknown_role_or_level_and_a_role_with_nothing_running(
        world, role, level, error, says):
    world.bus.units[units.weights("tiny")] = {"ActiveState": "failed", "SubState": "failed", "MainPID": 0}

    async def go():
        manager = await manager_of(world)

        async def require(action, details):
            pass

        manager.authority.require = require
        with pytest.raises(DBusError) as refused:
            await call(manager.models["tiny"].SetLogLevel, role, level)
        assert refused.value.type == api.error_name(error) and says in refused.value.text
        assert world.bus.kills == []

    asyncio.run(go())


def test_gpu_memory_is_nvmls_view_of_the_models_gpus_as_the_preflight_reads_it(world, monkeypatch):
    from hostd.manager.probe import GpuMemory, Memory

    async def go():
        monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)
        monkeypatch.setattr(model_bus, "GPU_MEMORY_CACHE_S", -1)  # every call reads again (the cache: below)
        manager = await manager_of(world)
        model = manager.models["tiny"]
        uuid = "GPU-8f3e0000-0000-4000-8000-000000000000"
        readings = iter([Memory([GpuMemory(0, 100, 40, 30, 20, None, uuid)], ""),
                         Memory(None, "NVML unavailable (x)"), Memory(None, "")])

        async def read_memory(cfg, pid, standby_pid=0):
            return next(readings)

        world.probe.read_memory = read_memory
        assert json.loads(await call(model.GpuMemory)) == [
            {"index": 0, "uuid": uuid, "mig_uuid": None, "total": 100, "free": 40, "engine": 30, "weights": 20}]
        assert json.loads(await call(model.GpuMemory)) == {"unreadable": "NVML unavailable (x)"}
        assert json.loads(await call(model.GpuMemory)) == []  # a model on no GPU

    asyncio.run(go())


def test_gpu_memory_answers_every_caller_within_a_second_from_one_reading(world, monkeypatch):
    # Issue 33, N4: any caller ran NVML on root's loop, uncached, per call.
    from hostd.manager.probe import GpuMemory, Memory

    async def go():
        monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)
        monkeypatch.setattr(model_bus, "GPU_MEMORY_CACHE_S", 3600)  # no test run takes this long
        manager = await manager_of(world)
        model = manager.models["tiny"]
        reads = []

        async def read_memory(cfg, pid, standby_pid=0):
            reads.append(pid)
            await asyncio.sleep(0)  # callers arrive while it runs
            return Memory([GpuMemory(0, 100, 40, 30, 20)], "")

        world.probe.read_memory = read_memory
        answers = await asyncio.gather(*(call(model.GpuMemory) for _ in range(5)))
        answers.append(await call(model.GpuMemory))
        assert len(reads) == 1 and len(set(answers)) == 1, (reads, answers)

    asyncio.run(go())


def test_gpu_memory_asks_nvml_from_a_thread_one_session_at_a_time(monkeypatch, tmp_path):
    import threading
    import types

    import msgspec as _msgspec

    from hostd.config import schema
    from hostd.manager.probe import Probe

    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))  # no weights socket: the daemon holds nothing
    threads = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: threads.append(threading.current_thread()),
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=100, free=40, used=60),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    cfg = _msgspec.convert({"backend": "builtin", "model": "/m", "device": "cuda", "gpus": [0]}, schema.BuiltinModel)
    gpus = asyncio.run(Probe("tiny").gpu_memory(cfg, 4242))
    assert [g.free for g in gpus] == [40]
    assert threads and threads[0] is not threading.main_thread()


def test_a_name_that_is_no_model_name_is_refused_with_the_name_rule_not_a_path(world):
    async def go():
        manager = await manager_of(world)
        for name, expected in (("../models/tiny", "model name '../models/tiny' is not allowed: use letters"),
                               ("ghost", f"no such model 'ghost': {world.root}/models/ghost.yaml does not exist")):
            with pytest.raises(DBusError) as refused:
                await call(manager.GetModel, name)
            assert refused.value.type == "org.hostd1.Error.NoSuchModel"
            assert refused.value.text.startswith(expected), refused.value.text

    asyncio.run(go())


def test_the_rollback_pin_keeps_the_whole_cause_in_comment_lines_never_cut_mid_word():
    cause = "engine failed to start: " + "max_model_len 999999 exceeds what the checkpoint supports; " * 6
    text = R.render(R.ROLLBACK_DROPIN, R.rollback_header(cause + "\nsecond line"), {"engine": {"max_num_seqs": 4}})
    comments = [line[2:] for line in text.splitlines() if line.startswith("# ")]
    assert " ".join(comments).startswith("Written by hostd's manager: the reload of these values failed: "
                                         + " ".join(cause.split()) + " second line")
    assert all(len(line) <= 78 for line in text.splitlines())
    assert text.endswith("engine:\n  max_num_seqs: 4\n")


def test_a_reload_during_recovery_answers_busy_and_the_recovery_is_a_visible_operation(world, monkeypatch):
    """After a crash, the administrator's reload is the call that starts the new
    manager: it must not run beside the recovery of the same model (seen: the
    reload said done at 32 and the recovery then put the engine back on 8)."""
    from hostd.gateway import control

    monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)
    world.crashed_reload({"max_num_seqs": 4}, write_dropin=False)
    world.probe.engine = None  # the crash came with the new engine failed: recovery drains and restarts
    release = asyncio.Event()

    async def drain(timeout):
        await release.wait()
        return control.Drained(drained=True, remaining=0, state="paused")

    world.probe.drain = drain

    async def go():
        manager = await manager_of(world)
        recovering = manager.keep(asyncio.create_task(manager.recover()))
        await asyncio.sleep(0)  # it has begun (serve() claims the model before owning the bus name)
        model = manager.models["tiny"]
        assert len(manager.operations) == 1, "no recovery operation: the model is not busy"
        [op] = manager.operations.values()
        assert op.kind == "recovery" and op.running and model.state == "reloading"
        assert model.busy() is op  # ActiveOperation names it
        with pytest.raises(errors.Busy):
            await manager.reload("tiny", {"max_num_seqs": 32})
        release.set()
        await recovering
        assert op.op.state == R.State.ROLLED_BACK and not op.running
        assert world.probe.engine["max_num_seqs"] == 8  # the config before the interrupted reload
        await manager.reload("tiny", {"max_num_seqs": 32})  # free again
        await asyncio.gather(*kept_tasks())
        assert world.probe.engine["max_num_seqs"] == 32
        assert world.records.committed("tiny").engine["max_num_seqs"] == 32

    asyncio.run(go())


def test_a_deeply_nested_json_patch_is_invalid_value_with_no_traceback_in_the_journal(world, caplog):
    # Issue 33, N5: RecursionError reached the journal as an ERROR traceback, once per call.
    async def go():
        manager = await manager_of(world)
        with pytest.raises(DBusError) as nested:
            await call(manager.CheckReloadJSON, "tiny", "[" * 4000 + "]" * 4000)
        assert nested.value.type == "org.hostd1.Error.InvalidValue"
        assert "nested too deeply" in nested.value.text

    with caplog.at_level("DEBUG"):
        asyncio.run(go())
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelname == "ERROR"]
    assert not [r for r in caplog.records if r.exc_info]


def test_revert_removes_the_managers_dropins_then_reloads_and_a_refused_one_puts_them_back(world, monkeypatch):
    """Issue 55, item 2 (hostctl revert): 90-reload.yaml and the rollback pin
    go, a reload of the administrator's files runs and its first note names
    them; refused at its check (the administrator's own drop-in does not
    load here), both files are back byte for byte and the model is not busy."""
    monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)

    async def go():
        manager = await manager_of(world)
        pin = world.dropin.with_name("99-rollback.yaml")
        pin.parent.mkdir(exist_ok=True)
        world.dropin.write_text("engine: {max_num_seqs: 3}\n")
        pin.write_text("# pinned\nengine: {max_num_seqs: 2}\n")
        model = manager.models["tiny"]
        broken = world.dropin.with_name("50-admin.yaml")
        broken.write_text("engine: {max_num_seqs: lots}\n")  # the administrator's own file, not loadable
        async def allowed(action, details):  # polkit says yes
            pass

        manager.authority.require = allowed
        with pytest.raises(DBusError) as refused:
            await call(manager.Revert, "tiny")
        assert refused.value.type == api.error_name("InvalidValue") and "max_num_seqs" in refused.value.text
        assert world.dropin.read_text() == "engine: {max_num_seqs: 3}\n" and pin.read_text() == "# pinned\nengine: {max_num_seqs: 2}\n"
        assert model.busy() is None
        broken.unlink()

        path = await call(manager.Revert, "tiny")
        op = model.active.op
        assert not world.dropin.exists() and not pin.exists()
        assert op.notes[0] == f"revert removed {world.dropin}, {pin}"
        await asyncio.gather(*kept_tasks())
        assert path == api.operation_path(op.id) and op.state.value in ("done", "unchanged"), (op.state, op.error)
        assert not world.dropin.exists() and not pin.exists()

    asyncio.run(go())


@pytest.mark.parametrize("strategy, stage, unit", [
    ("overlap", "start-next", "model-engine-next@tiny.service"),
    ("swap", "load-next", "model-weights-next@tiny.service"),
    ("swap", "start-next", "model-engine-swap@tiny.service"),
    ("standby", "rebuild", "model-engine-standby@tiny.service"),
    ("in-place", "rebuild", "model-engine@tiny.service"),
    ("restart", "restart", "model-engine@tiny.service"),
])
def test_an_operations_engine_status_is_the_status_of_the_unit_its_stage_waits_on(world, strategy, stage, unit):
    """Issue 55, item 4: Operation.EngineStatus follows the engine the current
    stage waits on (the bridge, the swap's daemon and engine, the standby),
    not the main engine alone; each of those units' STATUS= changes reach
    the operation's watchers as PropertiesChanged."""
    from hostd.manager.operation import Stage
    from hostd.manager.operation_bus import OperationInterface

    async def go():
        manager = await manager_of(world)
        assert unit in service.watched_units(manager.models["tiny"])
        op = R.Operation(id=5, model="tiny", patch={})
        op.strategy, op.stage = type("Chosen", (), {"name": strategy})(), Stage(stage)
        iface = OperationInterface(op, "reload", world.systemd, manager.authority)
        assert iface.waited_unit() == unit
        await world.systemd.properties(unit)  # tracked, as a strategy's start of it tracks it
        world.bus.set_status(unit, "vllm starting: Capturing CUDA graphs")  # the unit's STATUS=, by signal
        assert iface.engine_status() == "vllm starting: Capturing CUDA graphs"

    asyncio.run(go())
