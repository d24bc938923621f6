"""hostd engine NAME: the builtin engine of one model.

One job: get the model's weights into this process without copying them,
then serve the OpenAI API (server.py) on /run/hostd/NAME/engine.sock.

Normal start: connect to the weight cache daemon, send the fingerprint this
engine expects (checkpoint content, dtype, device, versions), build the model
on the meta device and attach the daemon's tensors by assignment; the daemon's
PID and socket inode are checked before and after mapping (client.py).
`--from-disk` loads the checkpoint itself instead: the cold start that the
benchmarks compare against, never used by the units.

Refuses to start (exit 1, reason in the journal) when the config cannot be
served: a max_model_len beyond the model's positions, a daemon holding other
weights, a cache that changed while attaching.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from hostd import backends, paths, sockets, systemd
from hostd import config as hostd_config
from hostd.weights import checkpoint, client, fingerprint, shared

log = logging.getLogger("hostd.engine")


def expected_fingerprint(cfg, device: torch.device, state_dir):
    dtype = checkpoint.resolve_dtype(Path(cfg.model), cfg.dtype)
    device_id = f"cuda:{shared.cuda_uuid(device)}" if device.type == "cuda" else "cpu"
    return fingerprint.compute(Path(cfg.model), dtype=dtype, device=device_id, cache_dir=state_dir)


def load_model(cfg, name: str, args, timings: dict) -> tuple[torch.nn.Module, dict]:
    """The model with its weights, and facts about where they came from."""
    model_dir = Path(cfg.model)
    device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
    dtype = checkpoint.resolve_dtype(model_dir, cfg.dtype)
    t0 = time.monotonic()
    model = checkpoint.build_skeleton(model_dir, dtype, meta_buffers=True)
    if args.from_disk:
        skeleton = checkpoint.build_skeleton(model_dir, dtype, meta_buffers=False)
        tensors = checkpoint.load_tensors(model_dir, skeleton, device)
        info = {"weights": "disk"}
    else:
        state = Path(args.state_dir) if args.state_dir else paths.state_dir(name)
        expected = expected_fingerprint(cfg, device, state if state.is_dir() else None)
        socket_path = Path(args.weights) if args.weights else paths.weights_socket(name)
        attached = client.attach(socket_path, expected)
        tensors = attached.tensors
        info = {
            "weights": "daemon",
            "weights_pid": attached.status.pid,
            "weights_socket_inode": attached.status.socket_inode,
            "content_digest": attached.status.fingerprint.content_digest,
            "shared_ptr": attached.block.data_ptr(),
            "shared_bytes": attached.block.numel(),
        }
    checkpoint.attach(model, tensors)
    timings["load_s"] = time.monotonic() - t0
    return model, info


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from hostd import logs

    logs.setup(args.name, "engine")
    loaded = hostd_config.load_model(args.name, hostd_config.config_root(args.config_dir))
    cfg = loaded.config
    backend = backends.for_config(cfg)
    try:
        backend.check(cfg)
    except backends.Refused as exc:
        log.error("cannot serve %s: %s", args.name, exc)
        systemd.status(f"refused: {exc}")
        return 1
    timings: dict = {}
    systemd.status("loading weights from disk" if args.from_disk else "attaching weights")
    try:
        with systemd.ExtendTimeout():
            model, info = load_model(cfg, args.name, args, timings)
    except (client.WeightsRefused, OSError, ValueError) as exc:
        log.error("cannot get the weights of %s: %s", args.name, exc)
        systemd.status(f"failed: {exc}")
        return 1
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    positions = getattr(model.config, "max_position_embeddings", None) or 2048
    max_model_len = cfg.engine.max_model_len or positions
    log.info("weights from %s in %.3f s (%s)", info["weights"], timings["load_s"], json.dumps(info))
    health = {
        "model": args.name,
        "limits": {"max_num_seqs": cfg.engine.max_num_seqs, "max_model_len": max_model_len},
        **info,
        "load_s": round(timings["load_s"], 4),
    }
    sock = next(iter(systemd.listen_sockets()), None)
    unix_path = None
    if sock is None:
        unix_path = str(Path(args.socket) if args.socket else paths.engine_socket(args.name))
        if not args.socket:
            sockets.ensure_private_dir(Path(unix_path).parent)

    def ready() -> None:
        systemd.notify("READY=1", f"STATUS=serving {args.name}")
        log.info("serving %s on %s", args.name, unix_path or sock.getsockname())

    from hostd.engine import server

    return server.run_server(
        model,
        tokenizer,
        served_name=cfg.served_model_name or args.name,
        max_num_seqs=cfg.engine.max_num_seqs,
        max_model_len=max_model_len,
        shutdown_timeout=cfg.engine.shutdown_timeout,
        unix_path=unix_path,
        sock=sock,
        on_ready=ready,
        on_status=systemd.status,
        health_info=health,
        log=log,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="model name (/etc/hostd/models/NAME.yaml)")
    parser.add_argument("--socket", metavar="PATH", help="serve HTTP here (default /run/hostd/NAME/engine.sock)")
    parser.add_argument("--weights", metavar="PATH", help="weight daemon socket (default /run/hostd/NAME/weights.sock)")
    parser.add_argument("--state-dir", metavar="DIR", help="digest cache (default /var/lib/hostd/NAME)")
    parser.add_argument("--from-disk", action="store_true", help="load the checkpoint from disk (cold start; for benchmarks)")
