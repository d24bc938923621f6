"""hostd engine NAME for the builtin backend: hostd's own engine of one model.

hostd/dispatch.py checked the config and BuiltinBackend.run_engine calls
serve(); the vllm and sglang backends run upstream.py instead, which
supervises upstream's own server behind engine.sock.

One job: get the model's weights into this process without copying them,
then serve the OpenAI API (server.py runs app.py) on /run/hostd/NAME/engine.sock.

Normal start: connect to the weight cache daemon, send the fingerprint this
engine expects (checkpoint content, dtype, device, versions), build the model
on the meta device and attach the daemon's tensors by assignment; the daemon's
PID and socket inode are checked before and after mapping (client.py).
`--from-disk` loads the checkpoint itself instead: the cold start that the
benchmarks compare against, never used by the units.

In the standby slot (model-engine-standby@NAME, `standby: true`) the engine
holds a small KV cache while it waits (reload.standby_kv_mib; standby_kv.py
grows it at the first request). The main engine and the standby answer the
manager's rebuild verb (server.py, POST /hostd/rebuild; /health's
`rebuilds`): rebuild() takes the new engine section's
limits on the same model object (the same daemon allocation; nothing is
built, copied or fetched again); server.py builds a runner for them, warms
it up and swaps it in. What the config cannot serve (a max_model_len beyond
the model's positions, a value out of range) is refused as a start would
refuse it, and the old runner keeps serving.

On the next weight slot (model-engine-swap@NAME `--weights-slot next`, a
checkpoint swap) the engine's KV cache is the smaller one of
reload.bridge_kv_mib (budget.swap_bytes): it is meant to serve alone only
while the main pair restarts on the new checkpoint beside it (where the
main pair does not come back it keeps serving, fewer requests at once).

Refuses to start (exit 1, reason in the journal) when the weights cannot be
had: a daemon holding other weights, a cache that changed while attaching
(what the config itself asks that the engine cannot do, such as a
max_model_len beyond the model's positions, dispatch.py refused already).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import msgspec
import torch

from hostd import memory, paths, systemd
from hostd.checkpoints import config_file
from hostd.engine import budget
from hostd.engine import health as engine_health
from hostd.weights import checkpoint, client, fingerprint, shared

log = logging.getLogger("hostd.engine")


def expected_fingerprint(cfg, device: torch.device, state_dir):
    dtype = checkpoint.resolve_dtype(Path(cfg.model), cfg.dtype)
    device_id = f"cuda:{shared.cuda_uuid(device)}" if device.type == "cuda" else "cpu"
    return fingerprint.compute(Path(cfg.model), dtype=dtype, device=device_id, cache_dir=state_dir)


class Phases:
    """Seconds spent in each start-up phase, for /health and the benchmarks."""

    def __init__(self) -> None:
        import hostd

        self.seconds: dict[str, float] = {}
        self._last = hostd.STARTED

    def mark(self, phase: str) -> None:
        now = time.monotonic()
        self.seconds[phase] = round(now - self._last, 4)
        self._last = now


def load_model(cfg, name: str, args, phases: Phases) -> tuple[torch.nn.Module, dict]:
    """The model with its weights, and facts about where they came from."""
    model_dir = Path(cfg.model)
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.empty(1, device=device)  # create the CUDA context now, to time it apart
        # Attention without cuDNN's SDPA: torch 2.11 on an H200 picks it for
        # every decode shape and pays 40-65 ms of host time per step for each
        # new key length (28 layers of a 7B model, measured 2026-12-02), where
        # the flash and memory-efficient kernels take about 1 ms (issue 37).
        torch.backends.cuda.enable_cudnn_sdp(False)
        phases.mark("cuda_context")
    dtype = checkpoint.resolve_dtype(model_dir, cfg.dtype)
    model = checkpoint.build_skeleton(model_dir, dtype, meta_buffers=True)
    phases.mark("build_skeleton")
    systemd.status("loading weights from disk" if args.from_disk else "attaching weights")
    attached = None
    if args.from_disk:
        skeleton = checkpoint.build_skeleton(model_dir, dtype, meta_buffers=False)
        tensors = checkpoint.load_tensors(model_dir, skeleton, device)
        info = {"weights": "disk", "checkpoint": str(model_dir.resolve())}
    else:
        state = Path(args.state_dir) if args.state_dir else paths.state_dir(name)
        expected = expected_fingerprint(cfg, device, state if state.is_dir() else None)
        phases.mark("fingerprint")
        socket_path = Path(args.weights) if args.weights else paths.weights_socket(name, args.weights_slot)
        attached = client.attach(socket_path, expected)
        tensors = attached.tensors
        info = {
            "weights": "daemon",
            "weights_pid": attached.status.pid,
            "weights_socket_inode": attached.status.socket_inode,
            "content_digest": attached.status.fingerprint.content_digest,
            "checkpoint": attached.status.fingerprint.model_path,
            "shared_ptr": attached.block.data_ptr(),
            "shared_bytes": attached.block.numel(),
        }
    checkpoint.attach(model, tensors)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    phases.mark("load_weights" if args.from_disk else "attach")
    if info["weights"] == "daemon":
        # Evidence for operators and tests that nothing was copied: every
        # parameter and buffer must point into the daemon's allocation.
        low, high = info["shared_ptr"], info["shared_ptr"] + info["shared_bytes"]
        every = [*model.parameters(), *model.buffers()]
        info["tensors_total"] = len(every)
        info["tensors_outside_shared"] = sum(not low <= t.data_ptr() < high for t in every)
    return model, info


def device_memory(device: str) -> int | None:
    """The memory the unset KV budget is a share of (budget.py): GPU 0's total, or the host's MemTotal."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory
    return memory.host_total()


def limits_for(cfg, model, standby: bool = False, swap: bool = False):
    """The engine's Limits for CFG's engine section on MODEL: its batching and
    KV budget (continuous; in the STANDBY slot also the idle budget,
    reload.standby_kv_mib; a checkpoint SWAP's engine, on the next weight
    slot, the smaller one of reload.bridge_kv_mib: budget.swap_bytes), and
    on CPU without batching the torch threads each request gets."""
    from hostd.engine import server

    if cfg.device == "cpu" and cfg.engine.batching == "none":
        # One request per thread: give each its share of the cores rather than
        # letting every request's matmuls fight over all of them. (Batched,
        # one loop runs the model: it keeps all of them.)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.engine.max_num_seqs))
    positions = getattr(model.config, "max_position_embeddings", None) or 2048
    max_model_len = cfg.engine.max_model_len or positions
    kv_cache_bytes = None
    if cfg.engine.batching == "continuous":
        kv_cache_bytes = budget.for_checkpoint(
            Path(cfg.model), dtype=cfg.dtype, kv_cache_mib=cfg.engine.kv_cache_mib,
            max_num_seqs=cfg.engine.max_num_seqs, max_model_len=max_model_len,
            device_total=device_memory(cfg.device), device=cfg.device,
            bridge_kv_mib=cfg.reload.bridge_kv_mib if swap else None)
    return server.Limits(
        max_num_seqs=cfg.engine.max_num_seqs,
        max_model_len=max_model_len,
        shutdown_timeout=cfg.engine.shutdown_timeout,
        batching=cfg.engine.batching,
        kv_cache_bytes=kv_cache_bytes,
        kv_cache_bytes_idle=min(cfg.reload.standby_kv_mib << 20, kv_cache_bytes) if standby and kv_cache_bytes else None,
        cuda_graphs=cfg.device == "cuda" and cfg.engine.batching == "continuous" and not cfg.engine.enforce_eager
        and not standby,
    )


def rebuilder(cfg, backend, model, health_of, standby: bool):
    """The rebuild in place (server.py's ``rebuild``; the main engine's under
    the in-place strategy, the warm STANDBY's under the standby strategy):
    given an engine section, MODEL (the one this process built and attached
    at start) with that section's limits; HEALTH_OF(cfg, phases) is its
    /health facts. Raises RebuildRefused for what the engine would refuse at
    start."""
    from hostd.engine import server

    try:
        model_config = config_file.read(cfg.model)
    except ValueError:
        model_config = {}  # the start read it: a checkpoint changed under a running engine

    def rebuild(section: object) -> "server.Rebuilt":
        # Every key of the engine section is the runner's or the application's
        # (limits_for, app.py), so the model object serves any of them as it
        # is: no skeleton is built and nothing re-attached. A key that changed
        # the model itself (its dtype, its modules) would need a new skeleton;
        # none of the engine section does today.
        try:
            engine = msgspec.convert(section, type=type(cfg.engine))
        except msgspec.ValidationError as exc:
            raise server.RebuildRefused(f"engine: {exc}") from None
        new = msgspec.structs.replace(cfg, engine=engine)
        problems = backend.engine_refusals(new, model_config)
        if problems:
            raise server.RebuildRefused("; ".join(problems))
        try:
            limits = limits_for(new, model, standby=standby)
        except ValueError as exc:
            raise server.RebuildRefused(f"engine: {exc}") from None
        phases: dict[str, float] = {}  # server.py fills it in; /health's rebuild_s is this dict
        return server.Rebuilt(model=model, limits=limits, health_info=health_of(new, phases), phases_s=phases)

    return rebuild


def serve(args: argparse.Namespace, cfg, backend=None) -> int:
    """The builtin engine (BuiltinBackend.run_engine, which hands in BACKEND:
    the standby slot's rebuild asks it what the engine refuses)."""
    from transformers import AutoTokenizer

    from hostd.engine import server

    phases = Phases()
    phases.mark("process_and_imports")
    # STATUS= says which start-up phase runs (systemctl status, and the
    # manager relays it on a reload's Operation as EngineStatus).
    systemd.status("building the model")
    slot = getattr(args, "slot", "main")
    standby = slot == "standby" and backend is not None
    # The main engine and the standby rebuild in place (server.py's rebuild
    # verb); the overlap's and the swap's second engines serve for one reload.
    rebuilds = slot in ("main", "standby") and backend is not None and getattr(args, "weights_slot", "main") == "main"
    try:
        with systemd.ExtendTimeout(cfg.timeouts.start, "building the model and attaching the weights"):
            model, info = load_model(cfg, args.name, args, phases)
    except (client.WeightsRefused, OSError, ValueError) as exc:
        log.error("cannot get the weights of %s: %s", args.name, exc)
        systemd.status(f"failed: {exc}")
        return 1
    systemd.status("loading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    # The swap's engine serves alone only while the main pair restarts on
    # the new checkpoint beside it: the smaller cache keeps that peak down.
    limits = limits_for(cfg, model, standby=standby, swap=getattr(args, "weights_slot", "main") == "next")
    info["kv_cache_bytes"] = limits.kv_cache_bytes  # the engine's budget (the standby's full one); /health says the live runner's
    phases.mark("tokenizer")
    log.info("weights from %s: %s; phases %s", info["weights"], json.dumps(info), json.dumps(phases.seconds))
    health = engine_health.facts(**{
        "engine_config": msgspec.to_builtins(cfg.engine),  # what a rollback restores
        **info,
        "slot": slot,
        "rebuilds": rebuilds,
        "phases_s": phases.seconds,
        # hostd_build_info's upstream_version (the gateway's /metrics)
        "upstream_version": backend.upstream_version(cfg) if backend is not None else "",
    })

    def health_info(engine_cfg=None, rebuild_s=None):
        facts = health if engine_cfg is None else engine_health.facts(
            **{**health, "engine_config": msgspec.to_builtins(engine_cfg.engine), "rebuild_s": rebuild_s})
        # On CPU the overlap preflight compares the engine's memory with the
        # host's (memory.py); on a GPU it asks NVML, and /health reads nothing.
        return (lambda: {**facts, "memory": memory.snapshot()}) if cfg.device == "cpu" else (lambda: facts)

    def ready() -> None:
        log.info("ready; start-up phases %s", json.dumps(phases.seconds))
        systemd.notify("READY=1", f"STATUS=serving {args.name}")

    def status(text: str) -> None:
        systemd.status(text)
        if text.startswith("shutting down"):
            systemd.notify("STOPPING=1")

    systemd.status("warming up")
    return server.run_server(
        model,
        tokenizer,
        limits,
        served_name=cfg.served_model_name or args.name,
        # Taken once warm (server.py, through hostd/sockets.py): engine.sock
        # exists only while the engine can answer.
        socket_path=Path(args.socket) if args.socket else paths.engine_socket(args.name, args.slot),
        on_ready=ready,
        on_status=status,
        health_info=health_info(),
        log=log,
        rebuild=rebuilder(cfg, backend, model, health_info, standby) if rebuilds else None,
        on_phase=phases.mark,  # warm_up, runner (built and warmed up: the standby's primed too), listen
    )

