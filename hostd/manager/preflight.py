"""The manager's GPU and host memory preflight: will a reload's engine fit?

One job: read the memory a reload weighs once (NVML's view of the model's
GPUs, read_memory) and say why the new engine, or a second one beside the
serving one (an overlap reload), would not fit: memory_problem and
overlap_problem, each a sentence naming the config key to change, or None.
The Probe hands these over here (Probe.preflight).

Trusts NVML and the weight daemon's status (through weights/client.py's
typed, capped frames); the serving engine's /health (an EngineHealth, decoded
under its cap by the Probe) only for the memory it reports of itself and the
host on CPU, which only decides whether a reload overlaps or restarts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import NamedTuple, Optional

from hostd import backends, nvml, paths
from hostd.engine.health import EngineHealth
from hostd.weights import client as weights_client

log = logging.getLogger("hostd.manager.probe")


class Preflight:
    """The preflight of model NAME (Probe.preflight)."""

    def __init__(self, name: str):
        self.name = name

    async def read_memory(self, cfg, engine_pid: int, standby_pid: int = 0) -> "Memory":
        """The one memory reading a preflight weighs (memory_problem and
        overlap_problem): NVML's view of CFG's GPUs when its engine uses any."""
        if not backends.for_config(cfg).uses_gpu(cfg):
            return Memory(None, "")
        try:
            return Memory(await self.gpu_memory(cfg, engine_pid, standby_pid), "")
        except Exception as exc:  # no driver library here (Unavailable), or NVML's own error (a GPU gone)
            return Memory(None, str(exc) or type(exc).__name__)

    def memory_problem(self, cfg, memory: "Memory", standby_grows: bool = False) -> Optional[str]:
        """Why the new engine would not fit on its GPUs (MEMORY, read_memory),
        or None. STANDBY_GROWS: a builtin warm standby takes the traffic
        during the reload and grows to the new config's full KV cache beside
        the main engine's restart, so that cache counts twice (an upstream
        standby serves as it was started: nothing grows).

        Memory the new engine may use = free now + what the old engine holds
        (it is stopped first). The old engine's share comes from NVML's
        per-process accounting when NVML sees our PIDs; inside a container its
        PIDs are another namespace's, so then it falls back to the device:
        used - the weight daemon's share. vLLM and SGLang size their pools as a
        fraction of the whole GPU that includes the daemon-held weights."""
        if memory.unreadable:  # verify and rollback still guard
            log.warning("GPU preflight skipped for %s: %s", self.name, memory.unreadable)
            return None
        backend = backends.for_config(cfg)
        fraction = backend.memory_fraction(cfg)
        for gpu in memory.gpus or ():
            available = gpu.free + gpu.engine
            kv = None if fraction else backend.engine_kv_bytes(cfg, gpu.total)
            grown = (kv or 0) if standby_grows and not fraction else 0
            need = (fraction * gpu.total - gpu.daemon) if fraction else (512 << 20) + (kv or 0) + grown
            if need > available:
                if fraction:
                    why = (f"fraction {fraction} of {gpu.total / 2**30:.1f} GiB, less the daemon-held weights; "
                           "lower the memory fraction")
                elif grown:
                    why = (f"its context and a KV cache of {kv >> 20} MiB, and the warm standby's KV cache, "
                           f"which grows to the same {kv >> 20} MiB while it serves; lower engine.kv_cache_mib, "
                           "max_num_seqs or max_model_len")
                elif kv:
                    why = (f"its context and a KV cache of {kv >> 20} MiB; lower engine.kv_cache_mib, "
                           "max_num_seqs or max_model_len")
                else:
                    why = "for its context"
                return (
                    f"GPU {gpu.index}: the new engine needs about {need / 2**30:.1f} GiB ({why}), "
                    f"but only {available / 2**30:.1f} GiB would be free"
                )
        return None

    def in_place_problem(self, cfg, health: Optional[EngineHealth], memory: "Memory",
                         alone: bool = False) -> Optional[str]:
        """Why the engine cannot rebuild in place on CFG for memory, or None:
        the new runner's KV cache (Backend.engine_kv_bytes) is allocated and
        warmed while the serving runner's still holds its own, so it and
        reload.overlap_reserve_mib must fit in what is free now (each GPU's
        free memory by NVML; on CPU the host's MemAvailable as the engine's
        /health reports it). ALONE: whether it would fit even once the
        serving runner's KV cache (HEALTH's kv_cache_bytes) is freed; a
        cache that does not is no strategy's to start. Never an
        out-of-memory in the serving process: the reload takes another
        strategy, or is refused, instead."""
        backend = backends.for_config(cfg)
        reserve = cfg.reload.overlap_reserve_mib << 20
        held = health.kv_cache_bytes if health is not None and isinstance(health.kv_cache_bytes, int) else 0
        freed = held if alone else 0
        where = "even once the serving runner's is freed" if alone else "beside the serving runner's until it drains"
        words = f"reload.overlap_reserve_mib={cfg.reload.overlap_reserve_mib}"
        if backend.uses_gpu(cfg):
            if memory.unreadable:
                return f"cannot read GPU memory: {memory.unreadable}"
            for gpu in memory.gpus or ():
                kv = backend.engine_kv_bytes(cfg, gpu.total) or 0
                if kv + reserve > gpu.free + freed:
                    return (f"GPU {gpu.index}: the new runner's KV cache of {kv >> 20} MiB and {words} must fit "
                            f"{where}, but {(gpu.free + freed) >> 20} MiB would be free")
            return None
        reported = (health.memory if health is not None else None) or {}
        if "host_available" not in reported:
            return "the engine does not report its memory on /health (hostd/memory.py)"
        kv = backend.engine_kv_bytes(cfg, reported.get("host_total")) or 0
        available = reported["host_available"] + freed
        if kv + reserve > available:
            return (f"the new runner's KV cache of {kv >> 20} MiB and {words} must fit {where}, but "
                    f"MemAvailable would be {available >> 20} MiB")
        return None

    async def gpu_memory(self, cfg, engine_pid: int, standby_pid: int = 0) -> list["GpuMemory"]:
        """NVML's view of each of the model's GPUs: free, total, the serving
        engine's share, the weight daemon's and the warm standby's (STANDBY_PID,
        0: none). The engines' shares are NVML's per-process figures where NVML
        sees our PIDs; inside a container they are another namespace's, so
        then the engine's is the device's used memory less the daemon's share
        (the standby's, if any, included) and the standby's is unknown (None).
        RuntimeError when NVML cannot be read."""
        status = None
        try:
            status = await asyncio.to_thread(weights_client.status, paths.weights_socket(self.name))
        except (OSError, weights_client.WeightsRefused):
            pass
        held = daemon_bytes_per_gpu(status.bytes_by_device if status else {}, list(cfg.gpus))
        # In a thread: NVML takes milliseconds per GPU, and this is root's only loop.
        return await asyncio.to_thread(_nvml_gpu_memory, list(cfg.gpus), engine_pid, held, standby_pid)

    def overlap_problem(self, cfg, health: Optional[EngineHealth], memory: "Memory",
                        weights: int = 0, swap: bool = False) -> Optional[str]:
        """Why a second engine would not fit beside the serving one, or None.
        HEALTH is the serving engine's /health answer (the one validate read),
        MEMORY the preflight's reading (read_memory): nothing is asked again.

        vllm and sglang run a bridge there, whose need their backend knows
        (Backend.bridge_need, UpstreamBackend.room_problem: _bridge_problem). Otherwise (builtin) the second
        engine needs what the serving one uses beyond the shared weights (its
        footprint), its KV cache swapped for the one the new config sizes
        (Backend.engine_kv_bytes, the builtin engine's paged cache:
        _second_engine), and reload.overlap_reserve_mib must stay free besides. CPU: the footprint is the engine's anonymous memory against
        the host's MemAvailable, both as the engine reports them on /health
        (hostd/memory.py: this sandbox cannot read them). GPU: NVML's per-process figure for
        the engine (device used - the daemon's share where NVML cannot see our
        PIDs), against each GPU's free memory. WEIGHTS: bytes of a second
        copy of the weights that must fit as well (a checkpoint swap's new
        checkpoint, on each GPU and on the host), 0 otherwise. SWAP: the
        second engine is a checkpoint swap's, whose KV cache is the smaller
        one of reload.bridge_kv_mib (budget.swap_bytes)."""
        backend = backends.for_config(cfg)
        refusal = backend.overlap_refusal(cfg)
        if refusal:
            return refusal
        if backend.bridge_need(cfg) is not None:
            return self._bridge_problem(cfg, backend.uses_gpu(cfg), health, memory, weights)
        reserve = (cfg.reload.overlap_reserve_mib << 20) + weights
        if backend.uses_gpu(cfg):
            return self._overlap_gpu(cfg, memory, reserve, backend, health, weights, swap)
        reported = (health.memory if health is not None else None) or {}
        if "anonymous" not in reported or "host_available" not in reported:
            return "the engine does not report its memory on /health (hostd/memory.py)"
        available = reported["host_available"]
        footprint = _second_engine(cfg, backend, health, reported["anonymous"], reported.get("host_total"), swap)
        if footprint + reserve > available:
            return (
                f"a second engine needs about {footprint >> 20} MiB (what the serving one uses beyond "
                f"the shared weights{_kv_words(cfg, backend, reported.get('host_total'), swap)}) and "
                f"{_reserve_words(cfg, weights)} must stay free, but MemAvailable is {available >> 20} MiB"
            )
        return None

    @staticmethod
    def _bridge_problem(cfg, gpu: bool, health: Optional[EngineHealth], memory: "Memory",
                        weights: int) -> Optional[str]:
        """vllm and sglang: the bridge engine's own budget, the reserve and
        WEIGHTS (a swap's new copy; the backend's room_problem, which the
        warm standby's start weighs too), against each GPU's NVML free
        memory, or on CPU the host's MemAvailable as the engine's /health
        reports it."""
        backend = backends.for_config(cfg)
        if gpu:
            if memory.unreadable:
                return f"cannot read GPU memory: {memory.unreadable}"
            return backend.room_problem(cfg, "bridge engine", None, {g.index: g.free for g in memory.gpus or ()},
                                        weights)
        available = ((health.memory if health is not None else None) or {}).get("host_available")
        if available is None:
            return "the engine does not report the host's memory on /health (hostd/memory.py)"
        return backend.room_problem(cfg, "bridge engine", available, {}, weights)

    @staticmethod
    def _overlap_gpu(cfg, memory: "Memory", reserve: int, backend, health: Optional[EngineHealth],
                     weights: int = 0, swap: bool = False) -> Optional[str]:
        if memory.unreadable:
            return f"cannot read GPU memory: {memory.unreadable}"
        for gpu in memory.gpus or ():
            need = _second_engine(cfg, backend, health, gpu.engine, gpu.total, swap)
            if need + reserve > gpu.free:
                kv = _kv_words(cfg, backend, gpu.total, swap)
                return (
                    f"GPU {gpu.index}: a second engine needs about {need >> 20} MiB"
                    f"{' (' + kv.removeprefix(', ') + ')' if kv else ''} and "
                    f"{_reserve_words(cfg, weights)} must stay free, "
                    f"but {gpu.free >> 20} MiB are free"
                )
        return None


def _second_engine(cfg, backend, health: Optional[EngineHealth], serving: int, device_total: Optional[int],
                   swap: bool = False) -> int:
    """What a second engine of CFG takes beyond the shared weights: what the
    serving one takes (SERVING), with its KV cache (its /health's
    kv_cache_bytes: allocated and touched at start, so inside SERVING)
    replaced by the one CFG's engine will allocate (Backend.engine_kv_bytes;
    SWAP: a checkpoint swap's engine), when the backend can tell."""
    target = backend.engine_kv_bytes(cfg, device_total, swap)
    if target is None:
        return serving
    held = health.kv_cache_bytes if health is not None else None
    held = held if isinstance(held, int) and held >= 0 else 0
    return max(0, serving - held) + target


def _reserve_words(cfg, weights: int) -> str:
    reserve = f"reload.overlap_reserve_mib={cfg.reload.overlap_reserve_mib}"
    return f"the new checkpoint's weights ({weights >> 20} MiB) and {reserve}" if weights else reserve


def _kv_words(cfg, backend, device_total: Optional[int], swap: bool = False) -> str:
    target = backend.engine_kv_bytes(cfg, device_total, swap)
    if target is None:
        return ""
    if swap:
        return f", with the swap engine's KV cache of {target >> 20} MiB, reload.bridge_kv_mib={cfg.reload.bridge_kv_mib}"
    return f", with the new config's KV cache of {target >> 20} MiB"


def daemon_bytes_per_gpu(bytes_by_device: dict[str, int], gpus: list[nvml.GpuName]) -> dict[nvml.GpuName, int]:
    """The weight daemon's bytes on each of GPUS (the config's `gpus:`, host
    indices or UUIDs), from its status's bytes_by_device. The daemon counts its own
    CUDA devices: its "cuda:N" is the Nth GPU of GPUS (CUDA_VISIBLE_DEVICES
    lists them in that order), so a model on `gpus: [1]` holds its weights on
    GPU 1, and a daemon that holds everything on its first GPU charges
    nothing to the second. A CUDA key without an ordinal is spread evenly
    over GPUS (what every key was before)."""
    out = dict.fromkeys(gpus, 0)
    for key, size in bytes_by_device.items():
        kind, _, ordinal = key.partition(":")
        if kind != "cuda":
            continue
        if ordinal.isdigit() and int(ordinal) < len(gpus):
            out[gpus[int(ordinal)]] += size
        else:
            for gpu in gpus:
                out[gpu] += size // max(1, len(gpus))
    return out


def _nvml_gpu_memory(gpus: list[nvml.GpuName], engine_pid: int, held: dict[nvml.GpuName, int],
                     standby_pid: int = 0) -> list["GpuMemory"]:
    """Preflight.gpu_memory's NVML reading of GPUS, and of no other GPU
    (blocking: run it in a thread). HELD: the weight daemon's bytes on each
    of them (daemon_bytes_per_gpu). A MIG slice's figures are the slice's."""
    with nvml.session() as pynvml:
        out = []
        for gpu in gpus:
            handle = nvml.handle(pynvml, gpu)
            index, uuid, mig_uuid, _ = nvml.identify(pynvml, gpu, handle)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            daemon = held.get(gpu, 0)
            processes = {p.pid: p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            engine = processes.get(engine_pid)
            if engine is None:
                engine = max(0, info.used - daemon)
            standby = processes.get(standby_pid) if standby_pid else None
            out.append(GpuMemory(index, info.total, info.free, engine, daemon, standby, uuid, mig_uuid))
        return out


class GpuMemory(NamedTuple):
    """Bytes on one GPU, as NVML reports them (Preflight.gpu_memory)."""

    index: int  # NVML's index of the GPU (of a MIG slice: its parent's)
    total: int
    free: int
    engine: int  # the serving engine's share
    daemon: int  # the weight daemon's share
    standby: Optional[int] = None  # the warm standby's share; None: no standby, or NVML does not list its PID
    uuid: str = ""  # the GPU's 'GPU-…', as DCGM-exporter's UUID label has it
    mig_uuid: str = ""  # the MIG slice's 'MIG-…', "" for a whole GPU


class Memory(NamedTuple):
    """One preflight's reading (Preflight.read_memory)."""

    gpus: Optional[list[GpuMemory]]  # None: the engine uses no GPU, or NVML could not be read
    unreadable: str  # why NVML could not be read; "" when it was (or was not needed)

