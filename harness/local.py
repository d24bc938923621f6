"""Run one model's daemons by hand (no systemd) in a directory tree.

For integration tests, benchmarks and the GPU machine: a config root, a
private runtime root and a state root under one directory, exported through
HOSTD_CONFIG_DIR, HOSTD_RUNTIME_DIR and HOSTD_STATE_DIR exactly as an
administrator running the daemons by hand would. Part of the tests, not of
hostd: it needs the test extra (httpx). Import it as harness.local, the
checkout on sys.path (pytest's pythonpath in pyproject.toml; the benchmarks
insert it themselves).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx
import yaml


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the benchmarks' own daemons; the
    system tests hold theirs: tests/system/ports.py)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process PID so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(probe: Callable[[], object], timeout: float, what: str, proc: Optional[subprocess.Popen] = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class ForkedProcess:
    """Popen's poll, send_signal, kill and wait for a process this one did
    not start: an engine forked from the spare (`spare: true`), which its
    `hostd engine` handed over to before exiting (hostd/engine/handoff.py),
    reparented to init. Held by a pidfd, so a signal never reaches another
    process that reused the pid. Its exit status is its adoptive parent's
    to read: returncode 0 means gone, not that it exited 0."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:  # readable: it ended
            self.returncode = 0
            os.close(self._pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout)
            time.sleep(0.05)
        return self.returncode


@dataclass
class Daemon:
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


@dataclass
class ModelTree:
    root: Path
    name: str = "tiny"
    daemons: list[Daemon] = field(default_factory=list)

    @property
    def config_dir(self) -> Path:
        return self.root / "etc"

    @property
    def runtime_dir(self) -> Path:
        return self.root / "run" / self.name

    @property
    def weights_socket(self) -> Path:
        return self.runtime_dir / "weights.sock"

    @property
    def engine_socket(self) -> Path:
        return self.runtime_dir / "engine.sock"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOSTD_CONFIG_DIR": str(self.config_dir),
            "HOSTD_RUNTIME_DIR": str(self.root / "run"),
            "HOSTD_STATE_DIR": str(self.root / "state"),
            "PYTHONUNBUFFERED": "1",
        }

    def write_config(self, checkpoint: Path, device: str = "cpu", fixed: Optional[dict] = None, **engine) -> None:
        """models/NAME.yaml: the builtin backend on CHECKPOINT, fixed keys from
        FIXED (listen, gateway, ...), editable ones from ENGINE."""
        data = {"backend": "builtin", "model": str(checkpoint), "device": device, **(fixed or {})}
        if engine:
            data["engine"] = engine
        path = self.config_dir / "models" / f"{self.name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(data))

    def _spawn(self, kind: str, *args: str) -> Daemon:
        log_path = self.root / f"{kind}-{len(self.daemons)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "hostd.main", kind, self.name, *args],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        daemon = Daemon(proc, log_path)
        self.daemons.append(daemon)
        return daemon

    def start_weights(self, *args: str, timeout: float = 120) -> Daemon:
        daemon = self._spawn("weights", *args)
        path = Path(args[args.index("--socket") + 1]) if "--socket" in args else self.weights_socket
        wait_for(lambda: self._connectable(path), timeout, str(path), daemon.proc)
        return daemon

    def start_engine(self, *args: str, wait: bool = True, timeout: float = 180) -> Daemon:
        daemon = self._spawn("engine", *args)
        if wait:
            self.wait_engine(daemon, timeout)
        return daemon

    def wait_engine(self, daemon: Daemon, timeout: float = 180, socket_path: Optional[Path] = None) -> Daemon:
        """Wait until the engine DAEMON started answers /health on SOCKET_PATH
        (default engine.sock). One that came from the spare (its `hostd
        engine` exited 0, having handed over) becomes the forked process."""
        path = socket_path or self.engine_socket

        def up() -> bool:
            if daemon.proc.poll() not in (None, 0):
                raise AssertionError(f"engine {path}: process exited with {daemon.proc.returncode}")
            return self._connectable(path) and self._healthy(path)

        wait_for(up, timeout, f"engine /health on {path}")
        with self._http(path) as client:
            pid = client.get("/health").json().get("pid")  # the builtin engine's; an upstream supervisor has none
        if pid is not None and pid != daemon.proc.pid:
            daemon.proc.wait(30)
            daemon.proc = ForkedProcess(pid)
        return daemon

    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / "control.sock"

    def start_gateway(self, *args: str, timeout: float = 60) -> Daemon:
        daemon = self._spawn("gateway", *args)
        wait_for(lambda: self._connectable(self.control_socket) if "--control" not in args else
                 self._connectable(Path(args[args.index("--control") + 1])), timeout, "gateway control socket", daemon.proc)
        return daemon

    def start_serving(self, port: int) -> None:
        """Weights, engine and gateway (listening on 127.0.0.1:PORT, as the
        model's YAML says), until the gateway serves; base_url is its URL."""
        self.start_weights()
        engine = self.start_engine(wait=False)
        self.start_gateway()  # while the engine starts, as systemd starts both units
        wait_for(self.engine_healthy, 180, "engine /health", engine.proc)
        self.base_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: self.control("status")["state"] == "serving", 30, "gateway serving")

    def control(self, verb: str, **request) -> dict:
        """One control request as JSON, whatever its fields (a test may send
        what the manager never would, to see the gateway refuse it); the
        answer's fields, or ControlError naming the refusal."""
        from hostd import sockets
        from hostd.gateway import control

        with sockets.connect(self.control_socket, request.get("timeout", 0) + 30.0) as conn:
            conn.sendall(json.dumps({"verb": verb, **request}).encode() + b"\n")
            answer = json.loads(conn.makefile("rb").readline() or b"{}")
        if not answer.get("ok"):
            raise control.ControlError(answer.get("error", "the gateway closed the connection without answering"))
        return answer

    @staticmethod
    def _connectable(path: Path) -> bool:
        if not path.exists():
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except OSError:
                return False
        return True

    def http(self, timeout: float = 60) -> httpx.Client:
        return self._http(self.engine_socket, timeout)

    @staticmethod
    def _http(path: Path, timeout: float = 60) -> httpx.Client:
        transport = httpx.HTTPTransport(uds=str(path))
        return httpx.Client(transport=transport, base_url="http://engine", timeout=timeout)

    def _healthy(self, path: Path) -> bool:
        try:
            with self._http(path, timeout=5) as client:
                return client.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def engine_healthy(self) -> bool:
        return self._connectable(self.engine_socket) and self._healthy(self.engine_socket)

    def health(self) -> dict:
        with self.http() as client:
            response = client.get("/health")
            response.raise_for_status()
            return response.json()

    def stop_all(self) -> None:
        for daemon in reversed(self.daemons):
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
                try:
                    daemon.proc.wait(30)
                except subprocess.TimeoutExpired:
                    daemon.proc.kill()
                    daemon.proc.wait()


def as_other_user(action: Callable[[], str], uid: int = 65534) -> str:
    """Run ACTION in a forked child whose uid and gid are UID (root only), for
    tests of peer checks; returns what it returned, or "error: ..." if it raised."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(read_end)
        try:
            os.setgid(uid)
            os.setuid(uid)
            outcome = action()
        except BaseException as exc:  # report, never raise out of the fork
            outcome = f"error: {exc}"
        os.write(write_end, outcome.encode()[:4000])
        os._exit(0)
    os.close(write_end)
    os.waitpid(child, 0)
    with os.fdopen(read_end, "rb") as result:
        return result.read().decode()
