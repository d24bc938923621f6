"""hostd weights NAME for the builtin backend: the weight cache daemon of one model.

hostd/dispatch.py checked the config and BuiltinBackend.run_weights calls
serve(); the vllm and sglang backends run upstream.py instead, which
supervises upstream's own daemon.

One job: load the checkpoint once, hold it, and hand it to engines zero-copy
for as long as it runs. See shared.py for the memory and protocol.py for the
wire format.

Trusts: the uid it runs as, and root. Refuses: peers with any other uid
(SO_PEERCRED, checked before reading a byte), frames that are malformed,
truncated, oversized or slower than the protocol timeout (that connection is
closed and logged; others are unaffected), and engines whose expected
fingerprint differs from what it holds (answered with the differing fields).

Lifecycle: takes its listening socket from systemd (model-weights@NAME.socket)
or binds /run/hostd/NAME/weights.sock itself; sends EXTEND_TIMEOUT_USEC while
loading, READY=1 once the weights are held, and exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Optional

import torch

import hostd
from hostd import paths, sockets, systemd
from hostd.weights import checkpoint, fingerprint, load, protocol, shared
from hostd.weights import listener as listener_mod

log = logging.getLogger("hostd.weights")


class Shutdown(Exception):
    """SIGTERM or SIGINT arrived."""


class WeightDaemon:
    def __init__(self, name: str, model_dir: Path, dtype: str, device: str, state_dir: Optional[Path]):
        self.name = name
        self.model_dir = model_dir
        self.configured_dtype = dtype
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.state_dir = state_dir
        self.shared: Optional[shared.Shared] = None
        self.fingerprint: Optional[protocol.Fingerprint] = None
        self.socket_inode = 0
        self.loaded_at = 0.0
        self.clients_served = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ loading

    def load(self) -> None:
        started = time.monotonic()
        dtype = checkpoint.resolve_dtype(self.model_dir, self.configured_dtype)
        device_id = "cpu"
        if self.device.type == "cuda":
            device_id = f"cuda:{shared.cuda_uuid(self.device)}"
        systemd.status(f"loading {self.model_dir} ({dtype}) onto {self.device}")
        skeleton = checkpoint.build_skeleton(self.model_dir, dtype, meta_buffers=False)
        self.shared, digest = load.load(
            self.model_dir, skeleton, self.device, label=self.name, cache_dir=self.state_dir
        )
        del skeleton
        self.fingerprint = fingerprint.compute(self.model_dir, dtype=dtype, device=device_id, digest=digest)
        self.loaded_at = time.time()
        log.info(
            "holding %d tensors, %d bytes on %s, loaded in %.2f s; fingerprint %s",
            len(self.shared.table), self.shared.size, self.device,
            time.monotonic() - started, fingerprint.describe(self.fingerprint),
        )

    def status(self) -> protocol.Status:
        assert self.shared and self.fingerprint
        return protocol.Status(
            fingerprint=self.fingerprint,
            pid=os.getpid(),
            socket_inode=self.socket_inode,
            tensors=len(self.shared.table),
            bytes_by_device={self.shared.device: self.shared.size},
            loaded_at=self.loaded_at,
            clients_served=self.clients_served,
            protocol=protocol.PROTOCOL,
            hostd_version=hostd.__version__,
        )

    def summary(self) -> str:
        assert self.shared
        gib = self.shared.size / (1 << 30)
        return (
            f"holding {self.model_dir.name}: {len(self.shared.table)} tensors, "
            f"{gib:.2f} GiB on {self.shared.device}; {self.clients_served} attach(es) served"
        )

    # ------------------------------------------------------------ serving

    def serve(self, listener: socket.socket) -> None:
        listener_mod.serve(listener, self.answer)

    def answer(self, conn: socket.socket, request: protocol.Request, pid: int) -> None:
        assert self.shared and self.fingerprint
        if isinstance(request, protocol.StatusRequest):
            protocol.send_frame(conn, self.status())
            return
        problem = protocol.version_problem(request.protocol, request.hostd_version, self.name)
        if problem:
            log.warning("refused engine pid %d: %s", pid, problem)
            protocol.send_frame(conn, protocol.Error(message=problem))
            return
        differing = self.fingerprint.differences(request.fingerprint)
        if differing:
            log.warning("refused engine pid %d: fingerprint differs in %s", pid, ", ".join(differing))
            protocol.send_frame(
                conn,
                protocol.Mismatch(
                    fields=differing,
                    daemon=self.fingerprint,
                    message=(
                        f"the weight cache holds different weights ({', '.join(differing)} "
                        "differ); restart the weights unit to load the configured checkpoint"
                    ),
                ),
            )
            return
        with self._lock:
            self.clients_served += 1
        fds = (self.shared.fd,) if self.shared.fd >= 0 else ()
        protocol.send_frame(
            conn,
            protocol.Attach(status=self.status(), storage=self.shared.storage, tensors=self.shared.table),
            fds,
        )
        log.info("engine pid %d attached", pid)
        systemd.status(self.summary())


def _raise_shutdown(signum, _frame):
    raise Shutdown(signal.Signals(signum).name)


def serve(args: argparse.Namespace, cfg) -> int:
    """The builtin weight cache daemon (BuiltinBackend.run_weights)."""
    socket_path = Path(args.socket) if args.socket else paths.weights_socket(args.name, args.slot)
    state_dir = Path(args.state_dir) if args.state_dir else paths.state_dir(args.name)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("no state directory %s (%s): digests will not be cached", state_dir, exc)
        state_dir = None

    signal.signal(signal.SIGTERM, _raise_shutdown)
    signal.signal(signal.SIGINT, _raise_shutdown)
    daemon = WeightDaemon(args.name, Path(cfg.model), cfg.dtype, cfg.device, state_dir)
    listener = None
    try:
        with systemd.ExtendTimeout(cfg.timeouts.start, f"loading {cfg.model}"):
            try:
                daemon.load()
            except (OSError, ValueError, RuntimeError, KeyError) as exc:
                # One error line with the checkpoint's own fault (a shard cut
                # short, a missing tensor): what a failed swap or start reports.
                log.error("cannot load %s: %s", cfg.model, exc)
                systemd.status(f"cannot load the checkpoint: {exc}")
                return 1
        listener = sockets.acquire(socket_path)
        address = listener.getsockname()
        daemon.socket_inode = os.stat(address).st_ino
        log.info("serving %s on %s", args.name, address)
        systemd.notify("READY=1", f"STATUS={daemon.summary()}")
        daemon.serve(listener)
    except Shutdown as why:
        log.info("%s: stopping", why)
        systemd.notify("STOPPING=1")
    finally:
        if listener is not None:
            sockets.release(listener)
    return 0

