"""Promises of docs/dbus-api.md that had no test, each through the manager's
D-Bus methods (org.hostd1.Manager, org.hostd1.Operation) as a caller sees
them: the D-Bus error's name and text, the files left on disk, and which
systemd jobs were asked for. Behind the manager: hostd's real systemd client
on the fake bus and the fake probe of reload_fakes.py; for the GPU preflight,
hostd's real Probe reading fake NVML numbers (pynvml's own functions
replaced, nothing of hostd's)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from dbus_fast import Message, Variant
from dbus_fast.errors import DBusError

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import FakeProbe, World  # noqa: E402

from hostd import units  # noqa: E402
from hostd.manager import authority, model_bus, service  # noqa: E402
from hostd.manager.preflight import Preflight  # noqa: E402
from hostd.manager.probe import Probe  # noqa: E402
from hostd.manager.tasks import pending as kept_tasks  # noqa: E402

STRATEGIES = ("overlap", "restart")
GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture(params=STRATEGIES)
def world(request, tmp_path: Path, monkeypatch) -> World:
    """A running model tiny under the manager, with STRATEGY; the caller is root."""
    world = World(tmp_path, strategy=request.param)
    world.strategy = request.param
    as_root(world, monkeypatch)
    return world


def as_root(world: World, monkeypatch) -> None:
    """Method calls come from bus name :1.9, which the bus daemon says is uid 0."""
    inner = world.bus.call

    async def call(msg: Message) -> Message:
        if msg.member == "GetConnectionUnixUser":
            msg.serial = msg.serial or 1
            return Message.new_method_return(msg, "u", [0])
        return await inner(msg)

    monkeypatch.setattr(world.bus, "call", call)
    monkeypatch.setattr(model_bus, "Probe", lambda name: world.probe)
    authority.CALLER.set(":1.9")


def dbus(method, *args):
    """Call a D-Bus method as the bus would (dbus-fast's decorator drops the
    result of a direct call)."""
    return method.__wrapped__(method.__self__, *args)


async def manager_of(world: World) -> service.Manager:
    await world.connect()
    manager = service.Manager(world.bus, world.systemd, world.root, world.records)
    manager.discover()
    await asyncio.gather(*kept_tasks())
    return manager


async def refused(method, *args) -> DBusError:
    with pytest.raises(DBusError) as info:
        await dbus(method, *args)
    return info.value


def operation(world: World, path: str):
    """The org.hostd1.Operation object at PATH, as the bus exports it."""
    return world.bus.exported[path]


async def finished(world: World, path: str) -> str:
    op = operation(world, path)
    while op.State == "running":
        await asyncio.sleep(0.001)
    return op.State


def write(world: World, name: str, text: str) -> Path:
    path = world.root / "models/tiny.d" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def umbrella_jobs(world: World) -> list:
    return [job for job in world.bus.job_log if job[1] == units.umbrella("tiny")]


# ---------------------------------------------------------------- refusals


def test_a_patch_whose_key_a_later_dropin_sets_is_refused_naming_that_file(world):
    later = write(world, "95-admin.yaml", "engine: {max_num_seqs: 2}\n")

    async def go():
        manager = await manager_of(world)
        return await refused(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})

    error = asyncio.run(go())
    assert error.type == "org.hostd1.Error.InvalidValue"
    assert f"engine.max_num_seqs is set by {later}" in error.text and "90-reload.yaml" in error.text
    assert not world.dropin.exists() and world.restarts() == 0 and world.probe.calls.count("drain") == 0
    assert world.records.intent("tiny") is None


def test_fixed_fields_changed_on_disk_refuse_every_reload_with_not_editable(world):
    model_yaml = world.root / "models/tiny.yaml"

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        assert await finished(world, path) == "done"  # the running config is committed
        jobs = list(world.bus.job_log)
        model_yaml.write_text(model_yaml.read_text() + "dtype: float32\n")  # fixed: the weights' layout
        errors = (await refused(manager.Reload, "tiny", {}),
                  await refused(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 2)}))
        assert world.bus.job_log == jobs  # no unit touched by the refusals
        return errors

    on_disk, patched = asyncio.run(go())
    for error in (on_disk, patched):
        assert error.type == "org.hostd1.Error.NotEditable"
        assert "fixed field(s) dtype changed on disk" in error.text
        assert "systemctl restart model@tiny.service" in error.text
    assert yaml.safe_load(world.dropin.read_text()) == {"engine": {"max_num_seqs": 4}}  # untouched
    assert world.probe.engine["max_num_seqs"] == 4  # still what the first reload started


# ---------------------------------------------------------------- the GPU preflight


class NvmlProbe(FakeProbe):
    """The fake probe, but the GPU preflight is hostd's own (Probe's, handed to preflight.py), reading NVML."""

    read_memory = Probe.read_memory
    memory_problem = Probe.memory_problem
    overlap_problem = Probe.overlap_problem
    gpu_memory = Probe.gpu_memory

    def __init__(self, world: World):
        super().__init__(world)
        self.name = world.name
        self.preflight = Preflight(world.name)


def fake_nvml(monkeypatch, *, total: int, free: int, engine_pid: int, engine_bytes: int) -> None:
    """pynvml answering for one GPU 0 whose serving engine (ENGINE_PID) holds ENGINE_BYTES."""
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", lambda *a, **k: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda *a, **k: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: f"gpu{index}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetUUID", lambda handle: f"GPU-{handle}".encode())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda handle: SimpleNamespace(total=total, free=free, used=total - free))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses",
                        lambda handle: [SimpleNamespace(pid=engine_pid, usedGpuMemory=engine_bytes)])


def on_gpu(world: World, monkeypatch, *, free: int, engine_bytes: int) -> World:
    """WORLD's model on GPU 0 (80 GiB), hostd's own GPU preflight reading
    NVML numbers: FREE bytes free, ENGINE_BYTES held by the serving engine."""
    model_yaml = world.root / "models/tiny.yaml"
    model_yaml.write_text(model_yaml.read_text().replace("device: cpu", "device: cuda") + "gpus: [0]\n")
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(world.root.parent / "run"))  # no weight daemon answers there
    world.probe = NvmlProbe(world)
    world.probe.engine_started()
    fake_nvml(monkeypatch, total=80 * GiB, free=free, engine_pid=world.bus.unit(units.engine("tiny"))["MainPID"],
              engine_bytes=engine_bytes)
    return world


def test_the_gpu_preflight_refuses_with_insufficient_memory_when_nvml_says_it_would_not_fit(world, monkeypatch):
    # Under overlap, a second engine does not fit either, so the reload falls
    # back to restart, whose preflight refuses: the same answer for both.
    world = on_gpu(world, monkeypatch, free=100 * MiB, engine_bytes=100 * MiB)

    async def go():
        manager = await manager_of(world)
        return await refused(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})

    error = asyncio.run(go())
    assert error.type == "org.hostd1.Error.InsufficientMemory"
    assert error.text.startswith("GPU 0: the new engine needs about 0.5 GiB")
    assert "only 0.2 GiB would be free" in error.text  # NVML's free + what the old engine holds
    assert not world.dropin.exists() and world.restarts() == 0 and world.bus.job_log == []
    assert world.records.intent("tiny") is None


def test_the_same_gpu_reload_is_accepted_when_nvml_reports_room(world, monkeypatch):
    # The positive control of the test above: only NVML's numbers differ.
    world = on_gpu(world, monkeypatch, free=40 * GiB, engine_bytes=2 * GiB)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        return operation(world, path).Strategy, await finished(world, path)

    strategy, state = asyncio.run(go())
    assert (strategy, state) == (world.strategy, "done")
    assert world.probe.engine["max_num_seqs"] == 4


#: A config.json the KV budget can be sized from (Qwen2.5-7B's layer shapes).
SIZED = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
         "max_position_embeddings": 32768, "dtype": "bfloat16"}


def gpu_world(tmp_path: Path, monkeypatch, strategy: str, *, free: int, engine_bytes: int) -> World:
    """A model on the fakes' GPU (80 GiB) reloading by STRATEGY, with the warm
    standby up when that is the strategy, and a checkpoint its KV can be sized for."""
    world = World(tmp_path, strategy="restart" if strategy == "restart" else "overlap",
                  standby=strategy == "standby")
    world.strategy = strategy
    as_root(world, monkeypatch)
    (tmp_path / "checkpoint/config.json").write_text(json.dumps(SIZED))
    world = on_gpu(world, monkeypatch, free=free, engine_bytes=engine_bytes)
    if strategy == "standby":
        world.probe.engine_started("standby")
    return world


@pytest.mark.parametrize("strategy", ["restart", "overlap", "standby"])
def test_a_kv_cache_that_does_not_fit_is_refused_by_every_strategy_and_by_the_check(tmp_path, monkeypatch,
                                                                                   strategy):
    """Issue 53: the standby's reload had no memory check (Standby inherited
    a memory_problem that was always None). A builtin standby grows to the
    new config's full KV cache while the main engine restarts beside it."""
    world = gpu_world(tmp_path, monkeypatch, strategy, free=2 * GiB, engine_bytes=10 * GiB)

    async def go():
        manager = await manager_of(world)
        patch = {"kv_cache_mib": Variant("u", 60000)}
        return await refused(manager.Reload, "tiny", patch), await refused(manager.CheckReload, "tiny", patch)

    reload_error, check_error = asyncio.run(go())
    for error in (reload_error, check_error):
        assert error.type == "org.hostd1.Error.InsufficientMemory", (error.type, error.text)
        assert "KV cache of 60000 MiB" in error.text and "only 12.0 GiB would be free" in error.text
    assert ("warm standby" in reload_error.text) == (strategy == "standby")
    assert not world.dropin.exists() and world.restarts() == 0 and world.bus.job_log == []
    assert world.records.intent("tiny") is None and "rebuild standby" not in world.probe.calls


@pytest.mark.parametrize("strategy", ["restart", "overlap", "standby"])
def test_a_kv_cache_that_fits_beside_the_standby_is_accepted(tmp_path, monkeypatch, strategy):
    # The positive control: 40 GiB free hold a second 8 GiB cache.
    world = gpu_world(tmp_path, monkeypatch, strategy, free=40 * GiB, engine_bytes=10 * GiB)

    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"kv_cache_mib": Variant("u", 8192)})
        return operation(world, path).Strategy, await finished(world, path)

    assert asyncio.run(go()) == (strategy, "done")
    assert world.probe.engine["kv_cache_mib"] == 8192


# ---------------------------------------------------------------- Busy and Cancel


def hold_verify(world: World) -> asyncio.Event:
    """The reload's first engine verification waits until the returned event
    is set: the reload is past its drain (restart) or starting its second
    engine (overlap), and still running."""
    release = asyncio.Event()
    verify = world.probe.verify_engine
    held = []

    async def verify_engine(*args, **kwargs):
        if not held:
            held.append(True)
            await release.wait()
        return await verify(*args, **kwargs)

    world.probe.verify_engine = verify_engine
    return release


async def running_stage(world: World, path: str, stage: str) -> None:
    while operation(world, path).Stage != stage:
        await asyncio.sleep(0.001)


def test_start_and_restart_answer_busy_while_a_reload_runs_and_ask_systemd_for_nothing(world):
    stage = {"restart": "verify", "overlap": "start-next"}[world.strategy]

    async def go():
        manager = await manager_of(world)
        release = hold_verify(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        await running_stage(world, path, stage)
        errors = [await refused(manager.Start, "tiny"), await refused(manager.Restart, "tiny"),
                  await refused(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 2)})]
        assert umbrella_jobs(world) == []  # the refused verbs asked systemd for nothing
        release.set()
        assert await finished(world, path) == "done"
        after = await dbus(manager.Restart, "tiny")  # free again once the reload ended
        assert await finished(world, after) == "done"
        return errors

    errors = asyncio.run(go())
    for error in errors:
        assert error.type == "org.hostd1.Error.Busy"
        assert error.text.startswith("model tiny is busy with operation 1")
    assert umbrella_jobs(world) == [("restart", units.umbrella("tiny"))]
    assert world.probe.engine["max_num_seqs"] == 4


@pytest.mark.parametrize("world", ["restart"], indirect=True)
def test_cancel_past_the_drain_answers_busy_and_the_reload_goes_on(world):
    # Pinned to restart: only it has a drain. Overlap's cancel (up to its
    # switch) is issue 26 item 2, tested with that change.
    async def go():
        manager = await manager_of(world)
        release = hold_verify(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        await running_stage(world, path, "verify")
        error = await refused(operation(world, path).Cancel)
        release.set()
        return error, await finished(world, path), operation(world, path).Restored

    error, state, restored = asyncio.run(go())
    assert error.type == "org.hostd1.Error.Busy"
    assert error.text == "operation 1 is past its drain (verify); it cannot be cancelled now"
    assert (state, restored) == ("done", False)
    assert yaml.safe_load(world.dropin.read_text()) == {"engine": {"max_num_seqs": 4}}
    assert world.probe.engine["max_num_seqs"] == 4


def test_cancel_of_a_finished_operation_answers_not_running_and_changes_nothing(world):
    async def go():
        manager = await manager_of(world)
        path = await dbus(manager.Reload, "tiny", {"max_num_seqs": Variant("u", 4)})
        assert await finished(world, path) == "done"
        jobs = len(world.bus.job_log)
        error = await refused(operation(world, path).Cancel)
        assert len(world.bus.job_log) == jobs
        return error, operation(world, path).State, operation(world, path).Restored

    error, state, restored = asyncio.run(go())
    assert error.type == "org.hostd1.Error.NotRunning"
    assert error.text == "operation 1 already ended (done)"
    assert (state, restored) == ("done", False)
    assert yaml.safe_load(world.dropin.read_text()) == {"engine": {"max_num_seqs": 4}}


def test_nvml_gives_the_standby_its_own_share_and_none_where_it_does_not_list_its_pid(monkeypatch):
    # Issue 34: Model.GpuMemory shows what the warm standby costs (idle, and switched in).
    import pynvml

    from hostd.manager import preflight

    fake_nvml(monkeypatch, total=80 * GiB, free=40 * GiB, engine_pid=11, engine_bytes=20 * GiB)
    listed = pynvml.nvmlDeviceGetComputeRunningProcesses("gpu0") + [SimpleNamespace(pid=12, usedGpuMemory=GiB)]
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", lambda handle: listed)
    [gpu] = preflight._nvml_gpu_memory([0], 11, {0: 15 * GiB}, standby_pid=12)
    assert (gpu.engine, gpu.daemon, gpu.standby) == (20 * GiB, 15 * GiB, GiB)
    [gpu] = preflight._nvml_gpu_memory([0], 11, {0: 15 * GiB}, standby_pid=99)  # another PID namespace
    assert gpu.standby is None
    [gpu] = preflight._nvml_gpu_memory([0], 11, {0: 15 * GiB})  # no standby
    assert gpu.standby is None
