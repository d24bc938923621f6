"""The manager's NVML preflight on a host with more than one GPU (issue 39):
it asks NVML about the model's own GPUs and no other, charges the weight
daemon's bytes to the GPU they lie on, and weighs each GPU's free memory
against what lands on that GPU. NVML here is a fake pynvml (as the other
preflight tests fake it); the weight daemon's status is a fake answer."""

from __future__ import annotations

import asyncio
import sys
import types

import msgspec
import pytest

from hostd.config import schema
from hostd.manager import preflight
from hostd.manager.preflight import GpuMemory, Memory, Preflight

GiB = 1 << 30
MIG_UUID = "MIG-5a1b2c3d-0000-4000-8000-00000000abcd"


def gpu_uuid(index: int) -> str:
    return f"GPU-8f3e0000-0000-4000-8000-00000000000{index}"


class Host:
    """pynvml on a host with GPUs 0 and 1 (80 GiB each), remembering every
    GPU it was asked about. FREE and USED per GPU; PROCESSES: pid -> bytes per GPU."""

    def __init__(self, free: dict[int, int], processes: dict[int, dict[int, int]]):
        self.free, self.processes, self.asked = free, processes, []

    def module(self) -> types.SimpleNamespace:
        def handle(index):
            if index not in self.free:
                raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
            self.asked.append(index)
            return index

        def by_uuid(uuid: bytes):
            # GPU N's UUID ends in N; MIG_UUID names a slice of GPU 1 (its handle "mig").
            if uuid.decode() == MIG_UUID:
                return "mig"
            return handle(int(uuid.decode()[-1]))

        return types.SimpleNamespace(
            nvmlInit=lambda: None,
            nvmlShutdown=lambda: None,
            NVMLError=RuntimeError,
            nvmlDeviceGetCount=lambda: len([g for g in self.free if g != "mig"]),
            nvmlDeviceGetHandleByIndex=handle,
            nvmlDeviceGetHandleByUUID=by_uuid,
            nvmlDeviceGetUUID=lambda h: (MIG_UUID if h == "mig" else gpu_uuid(h)).encode(),
            nvmlDeviceGetIndex=lambda h: h,
            nvmlDeviceGetMinorNumber=lambda h: h,
            nvmlDeviceGetDeviceHandleFromMigDeviceHandle=lambda h: 1,
            nvmlDeviceGetGpuInstanceId=lambda h: 3,
            nvmlDeviceGetComputeInstanceId=lambda h: 0,
            nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
                total=80 * GiB, free=self.free[h], used=80 * GiB - self.free[h]),
            nvmlDeviceGetComputeRunningProcesses=lambda h: [
                types.SimpleNamespace(pid=pid, usedGpuMemory=per_gpu[h])
                for pid, per_gpu in self.processes.items() if h in per_gpu],
        )


@pytest.fixture
def host(monkeypatch):
    def install(free, processes, daemon_bytes_by_device):
        fake = Host(free, processes)
        monkeypatch.setitem(sys.modules, "pynvml", fake.module())
        status = types.SimpleNamespace(bytes_by_device=daemon_bytes_by_device)
        monkeypatch.setattr(preflight.weights_client, "status", lambda path: status)
        return fake

    return install


def builtin(gpus: list[int]):
    # model: /m has no config.json: no KV target, so a second engine needs what the serving one holds
    return msgspec.convert({"backend": "builtin", "model": "/m", "device": "cuda", "gpus": gpus},
                           schema.BuiltinModel)


def test_a_model_pinned_to_gpu_1_reads_gpu_1_only_and_its_daemon_bytes_land_there(host):
    # GPU 0 belongs to another model and is nearly full: this model's reading never sees it.
    fake = host(free={0: 1 * GiB, 1: 50 * GiB}, processes={7: {1: 4 * GiB}, 99: {0: 70 * GiB}},
                daemon_bytes_by_device={"cuda:0": 14 * GiB})  # the daemon's own first GPU: host GPU 1
    [gpu] = asyncio.run(Preflight("right").gpu_memory(builtin([1]), 7))
    assert set(fake.asked) == {1}
    assert (gpu.index, gpu.free, gpu.engine, gpu.daemon) == (1, 50 * GiB, 4 * GiB, 14 * GiB)
    assert (gpu.uuid, gpu.mig_uuid) == (gpu_uuid(1), "")


def test_gpus_named_by_uuid_and_mig_slice_are_read_by_their_handles_and_carry_their_uuids(host):
    """Issue 55, item 3: `gpus: ["GPU-…"]` reads the same GPU as its index
    would; a MIG slice is read by its own handle (its memory is the slice's),
    with its parent's index and UUID beside its own, as DCGM-exporter labels them."""
    fake = host(free={0: 1 * GiB, 1: 50 * GiB, "mig": 9 * GiB}, processes={7: {"mig": 3 * GiB}},
                daemon_bytes_by_device={"cuda:0": 2 * GiB})
    [gpu] = asyncio.run(Preflight("byuuid").gpu_memory(builtin([gpu_uuid(1)]), 8))
    assert (gpu.index, gpu.uuid, gpu.mig_uuid, gpu.free, gpu.daemon) == (1, gpu_uuid(1), "", 50 * GiB, 2 * GiB)
    assert set(fake.asked) == {1}
    [slice_] = asyncio.run(Preflight("mig").gpu_memory(builtin([MIG_UUID]), 7))
    assert (slice_.index, slice_.uuid, slice_.mig_uuid) == (1, gpu_uuid(1), MIG_UUID)
    assert (slice_.free, slice_.engine, slice_.daemon) == (9 * GiB, 3 * GiB, 2 * GiB)


def test_the_overlap_preflight_of_one_model_ignores_the_other_models_full_gpu(host):
    host(free={0: 1 * GiB, 1: 50 * GiB}, processes={7: {1: 4 * GiB}, 99: {0: 70 * GiB}},
         daemon_bytes_by_device={"cuda:0": 14 * GiB})
    cfg = builtin([1])
    memory = asyncio.run(Preflight("right").read_memory(cfg, 7))
    assert Preflight("right").overlap_problem(cfg, None, memory) is None
    assert Preflight("right").memory_problem(cfg, memory) is None
    # The same reading for the model on GPU 0 refuses, naming GPU 0.
    other = builtin([0])
    host(free={0: 1 * GiB, 1: 50 * GiB}, processes={8: {0: 4 * GiB}}, daemon_bytes_by_device={"cuda:0": 14 * GiB})
    memory = asyncio.run(Preflight("left").read_memory(other, 8))
    assert Preflight("left").overlap_problem(other, None, memory).startswith("GPU 0: a second engine needs")


def test_a_daemon_on_the_first_of_two_gpus_charges_nothing_to_the_second():
    # The builtin daemon holds every weight on its first GPU today (its status: {"cuda:0": ...}).
    assert preflight.daemon_bytes_per_gpu({"cuda:0": 14 * GiB}, [2, 3]) == {2: 14 * GiB, 3: 0}
    # A split daemon reports each of its GPUs.
    assert preflight.daemon_bytes_per_gpu({"cuda:0": 9 * GiB, "cuda:1": 5 * GiB}, [2, 3]) == {2: 9 * GiB, 3: 5 * GiB}
    # A CUDA key without an ordinal is spread evenly; host memory is no GPU's.
    assert preflight.daemon_bytes_per_gpu({"cuda": 8 * GiB, "cpu": GiB}, [0, 1]) == {0: 4 * GiB, 1: 4 * GiB}
    assert preflight.daemon_bytes_per_gpu({}, [0]) == {0: 0}


def test_each_gpu_of_a_two_gpu_model_is_weighed_against_what_lands_on_it(host):
    """A model on both GPUs: the engine's per-process share and the daemon's
    bytes are each GPU's own, and the refusal names the GPU that lacks room."""
    host(free={0: 30 * GiB, 1: 3 * GiB}, processes={7: {0: 2 * GiB, 1: 6 * GiB}},
         daemon_bytes_by_device={"cuda:0": 9 * GiB, "cuda:1": 5 * GiB})
    cfg = builtin([0, 1])
    memory = asyncio.run(Preflight("both").read_memory(cfg, 7))
    assert [(g.index, g.engine, g.daemon) for g in memory.gpus] == [(0, 2 * GiB, 9 * GiB), (1, 6 * GiB, 5 * GiB)]
    # GPU 0 has room for a second 2 GiB engine; GPU 1 (3 GiB free) not for its 6 GiB one.
    assert Preflight("both").overlap_problem(cfg, None, memory).startswith("GPU 1: a second engine needs about 6144 MiB")
    roomy = Memory([GpuMemory(0, 80 * GiB, 30 * GiB, 2 * GiB, 9 * GiB), GpuMemory(1, 80 * GiB, 7 * GiB, 6 * GiB, 5 * GiB)], "")
    assert Preflight("both").overlap_problem(cfg, None, roomy) is None


def test_the_bridge_preflight_of_a_tp2_model_weighs_each_of_its_gpus_alone(host):
    """vLLM with tensor_parallel_size 2: the bridge's budget is per GPU
    (Backend.bridge_need), so one full GPU of the two refuses, naming it."""
    cfg = msgspec.convert({"backend": "vllm", "model": "/m", "gpus": [0, 1], "tensor_parallel_size": 2},
                          schema.MODEL_TYPES["vllm"])
    both = Memory([GpuMemory(0, 80 * GiB, 40 * GiB, 30 * GiB, 0), GpuMemory(1, 80 * GiB, GiB // 2, 30 * GiB, 0)], "")
    problem = Preflight("tp").overlap_problem(cfg, None, both)
    assert problem is not None and problem.startswith("GPU 1: the bridge engine needs about"), problem


def test_an_engine_whose_pid_nvml_cannot_see_is_charged_the_gpus_use_less_the_daemons(host):
    """Inside a container NVML lists other PIDs than ours (issue 53): the
    engine's share is then the GPU's used memory less the weight daemon's,
    not zero (which would let an overlap preflight pass with no room)."""
    host(free={0: 50 * GiB, 1: 80 * GiB}, processes={4242: {0: 30 * GiB}},  # PIDs of another namespace
         daemon_bytes_by_device={"cuda:0": 14 * GiB})
    [gpu] = asyncio.run(Preflight("tiny").gpu_memory(builtin([0]), 7))
    assert (gpu.engine, gpu.daemon) == (30 * GiB - 14 * GiB, 14 * GiB)
