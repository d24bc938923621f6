"""hostd weights NAME for the vllm and sglang backends: supervise upstream's daemon.

One job: run the upstream weight cache daemon (`vllm preload`, or SGLang's
`python -m sglang.srt.weight_cache.daemon`) as this process's child for its
whole life, and answer hostd's own weights.sock with its status. SGLang's
daemon dies with its parent (PR_SET_PDEATHSIG), so this process never execs
or detaches it.

Trusts: the uid it runs as, and root (SO_PEERCRED on weights.sock, as the
builtin daemon). Engines attach through upstream's own sockets in
/run/hostd/NAME/{vllm,sglang}/ (0700, upstream checks its peers); weights.sock
answers status only and refuses attach requests.

Lifecycle: clears stale upstream files from its private directory, starts the
child, sends EXTEND_TIMEOUT_USEC while it loads and READY=1 once one socket per
GPU exists (and, for SGLang, its .ready file). SIGTERM/SIGINT is forwarded to
the child, which gets the unit's stop timeout before SIGKILL. When the child
dies on its own this process exits non-zero, so systemd restarts the weights
(and the engine with them, BindsTo=).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import hostd
from hostd import paths, sockets, systemd
from hostd.config import redact
from hostd.weights import fingerprint, protocol
from hostd.weights import listener as listener_mod

log = logging.getLogger("hostd.weights")

# The fingerprint's (torch, transformers) versions: unknown to this process.
# Upstream's torch is in upstream's environment, and hostd's own may have none
# (installed without its `builtin` extra), so importing it here would fail the
# weights unit of every vllm and sglang model on such a host.
UPSTREAM_LIBRARIES = ("", "")


def upstream_sockets(directory: Path) -> dict[str, int]:
    """{socket file name: inode} of the Unix sockets in DIRECTORY."""
    found = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return {}
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            found[entry.name] = st.st_ino
    return found


def ready_pids(directory: Path) -> list[int]:
    """PIDs named by SGLang's .ready files (pid=N lines)."""
    pids = []
    for ready in sorted(directory.glob("*.ready")):
        try:
            text = ready.read_text()
        except OSError:
            continue
        match = re.search(r"^pid=(\d+)", text, re.MULTILINE)
        if match:
            pids.append(int(match.group(1)))
    return pids


def child_pids(pid: int) -> list[int]:
    """Direct children of PID (vLLM's per-rank daemons), from /proc."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def clear_directory(directory: Path) -> None:
    """Create the private upstream DIRECTORY, or empty one a dead child left."""
    sockets.ensure_private_dir(directory.parent)  # /run/hostd/NAME first: 0700, not umask's mode
    sockets.ensure_private_dir(directory)
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) or entry.is_symlink() or \
                stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
            os.unlink(entry.path)


class Supervisor:
    """BACKEND: the model's UpstreamBackend (hostd/backends/upstream.py), which
    says what to run and how to tell that it is ready."""

    def __init__(self, name: str, cfg, backend, state_dir: Optional[Path], slot: str = "main"):
        self.name, self.cfg, self.backend, self.state_dir, self.slot = name, cfg, backend, state_dir, slot
        self.directory = self.backend.socket_dir(name, slot)  # a swap's daemon (next) never touches main's
        self.child: Optional[subprocess.Popen] = None
        self.fingerprint: Optional[protocol.Fingerprint] = None
        self.socket_inode = 0
        self.loaded_at = 0.0
        self.stopping = threading.Event()
        # Why the weight cache does not hold this model's weights, or None:
        # then no upstream daemon runs and this process only answers status.
        self.not_retained = self.backend.weights_not_retained(cfg)
        # What the child starts from: probed before it starts, so that an
        # upgrade in place later does not change what this daemon reports.
        self.upstream_version = self.backend.upstream_version(cfg)

    # ------------------------------------------------------------ child

    def start_child(self) -> None:
        clear_directory(self.directory)
        command = self.backend.weights_command(self.name, self.cfg, self.slot)
        log.info("starting %s", " ".join(redact.argv(command.argv)))
        self.child = subprocess.Popen(command.argv, env=systemd.child_env(command.env, command.unset), stdin=subprocess.DEVNULL)

    def ready(self) -> bool:
        """Every GPU's socket exists (and, for SGLang, its .ready file)."""
        want = self.backend.expected_sockets(self.cfg)
        if len(upstream_sockets(self.directory)) < want:
            return False
        if self.backend.writes_ready_files:
            return len(list(self.directory.glob("*.ready"))) >= want
        return True

    def wait_ready(self) -> bool:
        """True once ready; False when the child died or we were told to stop."""
        assert self.child
        while not self.stopping.is_set():
            if self.child.poll() is not None:
                return False
            if self.ready():
                return True
            self.stopping.wait(0.1)
        return False

    def stop_child(self) -> int:
        """SIGTERM the child (upstream ends every rank), SIGKILL after the stop timeout."""
        assert self.child
        if self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)
            try:
                self.child.wait(max(1.0, self.cfg.timeouts.stop - 5.0))
            except subprocess.TimeoutExpired:
                log.warning("upstream daemon pid %d ignored SIGTERM; killing it", self.child.pid)
                self.child.kill()
                self.child.wait()
        return self.child.returncode

    # ------------------------------------------------------------ status

    def compute_fingerprint(self) -> protocol.Fingerprint:
        uuids = self.backend.socket_devices(list(upstream_sockets(self.directory)), self.cfg)
        device = "cuda:" + ",".join(uuids) if uuids else "cuda:" + ",".join(map(str, self.cfg.gpus))
        if self.cfg.device == "cpu":
            device = "cpu"
        try:
            return fingerprint.compute(
                Path(self.cfg.model),
                dtype=self.cfg.dtype,
                device=device,
                backend=self.cfg.backend,
                tensor_parallel_size=self.cfg.tensor_parallel_size,
                cache_dir=self.state_dir,
                library_versions=UPSTREAM_LIBRARIES,
            )
        except (OSError, ValueError) as exc:  # e.g. a .bin checkpoint: no safetensors to hash
            log.warning("no content digest for %s: %s", self.cfg.model, exc)
            return protocol.Fingerprint(
                model_path=str(Path(self.cfg.model).resolve()), content_digest="",
                architecture="unknown", dtype=self.cfg.dtype, device=device,
                tensor_parallel_size=self.cfg.tensor_parallel_size, backend=self.cfg.backend,
                torch_version=UPSTREAM_LIBRARIES[0], transformers_version=UPSTREAM_LIBRARIES[1],
            )

    def status(self) -> protocol.Status:
        assert self.fingerprint
        pids = [self.child.pid, *child_pids(self.child.pid), *ready_pids(self.directory)] if self.child else []
        return protocol.Status(
            fingerprint=self.fingerprint,
            pid=os.getpid(),
            socket_inode=self.socket_inode,
            tensors=0,  # held upstream; hostd does not see them
            bytes_by_device={},
            loaded_at=self.loaded_at,
            clients_served=0,
            upstream_pids=list(dict.fromkeys(pids)),
            upstream_socket_inodes=upstream_sockets(self.directory),
            not_retained=self.not_retained or "",
            protocol=protocol.PROTOCOL,
            hostd_version=hostd.__version__,
            upstream_version=self.upstream_version,
        )

    def summary(self) -> str:
        if self.not_retained:
            return f"weights of {self.name} not retained: {self.not_retained}; the engine loads them from disk"
        count = len(upstream_sockets(self.directory))
        return f"{self.cfg.backend} weight cache for {self.name}: {count} socket(s), upstream pid {self.child.pid if self.child else '-'}"

    # ------------------------------------------------------------ serving

    def serve(self, listener: socket.socket) -> None:
        listener_mod.serve(listener, self.answer)

    def answer(self, conn: socket.socket, request: protocol.Request, _pid: int) -> None:
        if isinstance(request, protocol.StatusRequest):
            protocol.send_frame(conn, self.status())
        else:
            protocol.send_frame(conn, protocol.Error(
                message=f"the weights of {self.name} are held by {self.cfg.backend}; its engine "
                f"attaches through the upstream sockets in {self.directory}, not weights.sock"
            ))


def serve_without_cache(supervisor: Supervisor, socket_path: Path) -> int:
    """No weight cache for this model (supervisor.not_retained says why): run
    no upstream daemon, answer status on weights.sock, saying the weights are
    not retained, until stopped. The engine unit still binds to this one, so a
    reload restarts only the engine, which loads from disk."""
    log.warning("weights of %s are not retained: %s; the %s engine loads them from disk on "
                "every start", supervisor.name, supervisor.not_retained, supervisor.cfg.backend)
    with systemd.ExtendTimeout(supervisor.cfg.timeouts.start, "computing the checkpoint's fingerprint"):
        supervisor.fingerprint = supervisor.compute_fingerprint()
    supervisor.loaded_at = time.time()
    listener = sockets.acquire(socket_path)
    try:
        supervisor.socket_inode = os.stat(listener.getsockname()).st_ino
        threading.Thread(target=supervisor.serve, args=(listener,), daemon=True).start()
        systemd.notify("READY=1", f"STATUS={supervisor.summary()}")
        supervisor.stopping.wait()
        return 0
    finally:
        sockets.release(listener)


def run(args, cfg, backend) -> int:
    """`hostd weights NAME` for an upstream BACKEND (its run_weights, once
    hostd/dispatch.py has checked CFG)."""
    socket_path = Path(args.socket) if args.socket else paths.weights_socket(args.name, args.slot)
    state_dir = Path(args.state_dir) if args.state_dir else paths.state_dir(args.name)
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        state_dir = None
    supervisor = Supervisor(args.name, cfg, backend, state_dir, args.slot)

    def on_signal(signum, _frame):
        log.info("%s: stopping", signal.Signals(signum).name)
        systemd.notify("STOPPING=1")
        supervisor.stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    listener = None
    try:
        if supervisor.not_retained:
            return serve_without_cache(supervisor, socket_path)
        supervisor.start_child()
        systemd.status(f"{cfg.backend} is loading {cfg.model}")
        with systemd.ExtendTimeout(cfg.timeouts.start, f"waiting for {cfg.backend}'s weight cache to load "
                                   f"{cfg.model}"):
            ready = supervisor.wait_ready()
        if not ready:
            if supervisor.stopping.is_set():
                supervisor.stop_child()
                return 0
            log.error("upstream weight cache exited with %s before it was ready", supervisor.child.returncode)
            return 1
        supervisor.fingerprint = supervisor.compute_fingerprint()
        supervisor.loaded_at = time.time()
        listener = sockets.acquire(socket_path)
        supervisor.socket_inode = os.stat(listener.getsockname()).st_ino
        threading.Thread(target=supervisor.serve, args=(listener,), daemon=True).start()
        log.info("upstream weight cache ready: %s", supervisor.status().upstream_socket_inodes)
        systemd.notify("READY=1", f"STATUS={supervisor.summary()}")
        while not supervisor.stopping.is_set():
            if supervisor.child.poll() is not None:
                code = supervisor.child.returncode
                log.error("upstream weight cache pid %d exited with %s; the weights are gone", supervisor.child.pid, code)
                systemd.status(f"failed: upstream exited with {code}")
                return code if code else 1
            supervisor.stopping.wait(0.5)
        code = supervisor.stop_child()
        log.info("upstream weight cache stopped (exit %s)", code)
        return 0
    finally:
        if supervisor.child is not None:
            if supervisor.child.poll() is None:
                supervisor.stop_child()
            # Upstream's daemons install no SIGTERM handler: their sockets,
            # lock and .ready files outlive them. Nothing serves them now.
            clear_directory(supervisor.directory)
        if listener is not None:
            sockets.release(listener)
