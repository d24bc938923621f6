"""hostd engine NAME for the vllm and sglang backends: supervise upstream's server.

One job: run `vllm serve` (on a private Unix socket) or SGLang's
`launch_server` (on a private loopback port) as this process's child, and
serve /run/hostd/NAME/engine.sock beside it. The gateway sends vLLM's public
requests to vLLM's own socket (backend.engine_socket: one proxy per token,
not two); here every request is proxied unchanged (streaming included: all
of SGLang's, whose port only this process knows, and vLLM's /metrics)
except GET /health, which answers upstream's
health plus hostd's contract (engine/health.py's EngineHealth) for the manager: {"engine_config", "weights",
"weights_not_retained", "weights_pid", "weights_socket_inode"} and for the
gateway's /metrics ("upstream_version").
Without the weight cache (the backend's weights_not_retained) upstream's
server loads from disk and "weights" is "disk". Each slot (--slot) has its own
upstream socket or port; in the next slot upstream runs as the overlap
reload's bridge, on the backend's bridge budget, and /health says so under
"bridge".

Trusts: the uid it runs as and root, through the private runtime directory
(engine.sock is 0600 in /run/hostd/NAME, 0700). The loopback port SGLang
needs is reachable by any local user while it runs: SGLang cannot serve on a
Unix socket (docs/sglang.md).

Lifecycle: reads the weight daemon's identity (PID, socket inode) from
weights.sock first; starts the child; sends EXTEND_TIMEOUT_USEC until
upstream's /health answers 200 (meanwhile STATUS= follows upstream's start
phases: UpstreamStderr), then binds engine.sock and sends READY=1. On
SIGTERM it sends STOPPING=1 and SIGTERM to the child, keeps proxying while
upstream drains (vLLM: --shutdown-timeout; SGLang drains without limit, so
hostd kills it after the backend's drain_seconds), then SIGKILLs what is left.
When the child dies on its own this process exits non-zero.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import aiohttp
import msgspec
from aiohttp import web

from hostd import forward, logs, memory, paths, sockets, systemd
from hostd.config import redact
from hostd.engine.health import EngineHealth
from hostd.engine.health import encode as health_encode
from hostd.weights import client as weights_client
from hostd.weights import protocol

log = logging.getLogger("hostd.engine")

STDERR_CHUNK = 1 << 16  # upstream's stderr read as it comes (copy_stderr)
PHASE_STATUS_S = 0.5  # at most one STATUS= a phase's progress redraws per this many seconds

CLIENT_MAX_SIZE = 64 * 1024 * 1024

# Seconds between looks at whether the upstream server exited (child_exit).
CHILD_POLL = 0.1

# The standby's exit when it does not fit (EX_CONFIG): its unit's
# RestartPreventExitStatus= keeps systemd from starting it again and again.
STANDBY_DOES_NOT_FIT = 78


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]




class UpstreamStderr:
    """Upstream's stderr, as the engine supervisor hears it: passed through to
    ours (the journal) unchanged; its last lines kept, so that when upstream
    exits before it serves its own error is logged at error priority (and so
    reaches a reload's Error); and, while it starts (STARTING, until READY=1),
    its phase lines (the backend's phase_lines: loading shards, the KV cache,
    graph capture) relayed to STATUS= from the phase's words on, so that
    `hostctl status`, a reload's and a start's progress show where the start
    is. Read as it comes, not by lines: a progress bar redraws one line with
    carriage returns, and each redraw is a line here; a new phase goes to
    STATUS= at once, a redraw of the same one at most every PHASE_STATUS_S."""

    def __init__(self, backend: str, phase_lines: tuple[re.Pattern, ...]) -> None:
        self.backend, self.phase_lines = backend, phase_lines
        self.tail: collections.deque[str] = collections.deque(maxlen=200)
        self.starting = True
        self._phase_sent: tuple[float, Optional[re.Pattern]] = (0.0, None)  # when STATUS= got a phase, and which

    async def copy(self, stream: asyncio.StreamReader) -> None:
        out = sys.stderr.buffer
        pending = b""
        while chunk := await stream.read(STDERR_CHUNK):
            out.write(chunk)
            out.flush()
            *lines, pending = re.split(rb"[\r\n]", pending + chunk)
            pending = pending[-STDERR_CHUNK:]  # a line longer than this is kept by its end
            self.heard(lines)
        self.heard([pending])  # the last line, when upstream wrote no newline after it

    def heard(self, lines: list[bytes]) -> None:
        for raw in lines:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.tail.append(line)
                if self.starting:
                    self.phase(line)

    def phase(self, line: str) -> None:
        for pattern in self.phase_lines:
            found = pattern.search(line)
            if found:
                break
        else:
            return
        phase, now = line[found.start():].strip()[:160], asyncio.get_running_loop().time()
        when, last = self._phase_sent
        if last is not pattern or now - when >= PHASE_STATUS_S:
            self._phase_sent = (now, pattern)
            systemd.status(f"{self.backend} starting: {phase}")

    def error(self) -> str:
        """Upstream's own error: the last of its stderr lines that names an
        error or exception with the indented detail lines under it (as
        pydantic's "1 validation error for ModelConfig" has), else its last line."""
        lines = [l for l in self.tail if l.strip()]
        found = [i for i, l in enumerate(lines) if re.search(r"Error\b|Exception\b|error:", l)]
        if not found:
            return lines[-1].strip() if lines else ""
        start = found[-1]
        end = start + 1
        while end < len(lines) and end - start <= 3 and lines[end][:1].isspace():
            end += 1
        return " ".join(l.strip() for l in lines[start:end])


class EngineSupervisor:
    """BACKEND: the model's UpstreamBackend (hostd/backends/upstream.py), which
    says what to run and how to tell that it serves."""

    def __init__(self, name: str, cfg, backend, socket_path: Path, weights_identity: tuple[int, int],
                 slot: str = "main", weights_slot: str = "main",
                 fingerprint: Optional[protocol.Fingerprint] = None):
        self.name, self.cfg, self.backend, self.socket_path, self.slot = name, cfg, backend, socket_path, slot
        self.weights_pid, self.weights_inode = weights_identity
        # The checkpoint the weight daemon holds (or, not retained, names):
        # /health's, which a checkpoint swap's verify holds the engine to.
        self.fingerprint = fingerprint
        self.not_retained = self.backend.weights_not_retained(cfg)
        self.proc: Optional[asyncio.subprocess.Process] = None
        self.stderr = UpstreamStderr(cfg.backend, backend.phase_lines)
        self.stderr_copier: Optional[asyncio.Future] = None
        self.stopping = asyncio.Event()
        self.session: Optional[aiohttp.ClientSession] = None
        self.upstream_socket: Optional[Path] = self.backend.engine_socket(name, slot)
        if self.upstream_socket:
            self.port = 0
            self.base = "http://engine"
        else:
            self.port = free_loopback_port()
            self.base = f"http://127.0.0.1:{self.port}"
        # The next slot runs only during an overlap reload: there it is the
        # bridge, on a KV budget of its own (the main engine keeps the
        # administrator's values). The warm standby (`standby: true`) waits
        # on the same small budget: it serves a failover or a standby reload
        # with it, and cannot grow it without a restart.
        bridge = self.backend.bridge(cfg) if slot in ("next", "standby") else None
        self.command = (self.backend.standby_command(name, cfg, bridge, port=self.port) if slot == "standby"
                        else self.backend.engine_command(name, cfg, port=self.port, slot=slot, bridge=bridge,
                                                         weights_slot=weights_slot))
        self.bridge = self.backend.bridge_summary(cfg, bridge) if bridge else ""
        self.upstream_version = self.backend.upstream_version(cfg)  # probed by install_refusals already

    def standby_fit_problem(self) -> Optional[str]:
        """The standby's start preflight: why it does not fit beside what
        runs (the backend's standby_fit_problem, on NVML's free memory of the
        model's GPUs or the host's MemAvailable), or None."""
        return self.backend.standby_fit_problem(self.cfg, memory.snapshot().get("host_available"),
                                                self.backend.gpu_free(self.cfg))

    # ------------------------------------------------------------ upstream

    def _session(self) -> aiohttp.ClientSession:
        return forward.session(forward.upstream_connector(self.upstream_socket), 10)

    async def start(self) -> None:
        if self.upstream_socket:
            sockets.claim(self.upstream_socket)  # vLLM binds it: clear a stale one, refuse a live one
        if self.bridge:
            log.info("the %s engine of %s in slot %s %s: %s (reload.bridge_kv_mib=%d)", self.cfg.backend, self.name,
                     self.slot, "runs on the bridge's budget" if self.slot == "standby" else "is the bridge",
                     self.bridge, self.cfg.reload.bridge_kv_mib)
        log.info("starting %s", " ".join(redact.argv(self.command.argv)))
        self.proc = await asyncio.create_subprocess_exec(
            *self.command.argv, env=systemd.child_env(self.command.env, self.command.unset), stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self.stderr_copier = asyncio.ensure_future(self.stderr.copy(self.proc.stderr))
        self.session = self._session()

    async def upstream_health(self) -> Optional[int]:
        """Upstream's health status code (the backend's health_path), None when
        it does not answer."""
        assert self.session
        if self.upstream_socket and not self.upstream_socket.exists():
            return None
        try:
            probe = self.backend.health_path
            timeout = aiohttp.ClientTimeout(total=self.backend.health_timeout)
            async with self.session.get(self.base + probe, timeout=timeout) as response:
                await response.read()
                return response.status
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return None

    async def wait_healthy(self) -> bool:
        """True once upstream's /health is 200; False if it died or we stop."""
        assert self.proc
        while not self.stopping.is_set():
            if self.proc.returncode is not None:
                return False
            if await self.upstream_health() == 200:
                return True
            try:
                await asyncio.wait_for(self.stopping.wait(), 0.2)
            except asyncio.TimeoutError:
                pass
        return False

    def deadline(self) -> float:
        """Seconds the child gets after SIGTERM before SIGKILL."""
        drain = self.backend.drain_seconds(self.cfg)
        grace = self.backend.stop_grace_seconds
        return max(1.0, min(drain + grace, self.cfg.timeouts.stop - 2.0))

    async def child_exit(self, within: Optional[float] = None) -> Optional[int]:
        """The server's exit code once it exited, waiting up to WITHIN seconds
        (None: until it does, or until we are asked to stop); None if it
        still runs. Polled, not Process.wait(): asyncio's wait() returns
        only once every pipe of the child closed too, and a killed `vllm
        serve` leaves its engine core holding stderr (until systemd's cgroup
        kill), which would hide the server's death from this process."""
        assert self.proc
        loop = asyncio.get_running_loop()
        deadline = None if within is None else loop.time() + within
        while self.proc.returncode is None:
            if deadline is None and self.stopping.is_set() or deadline is not None and loop.time() >= deadline:
                return None
            await asyncio.sleep(CHILD_POLL)
        return self.proc.returncode

    async def stop_child(self) -> Optional[int]:
        assert self.proc
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            if await self.child_exit(self.deadline()) is None:
                log.warning("upstream engine pid %d still running after %.0f s; killing it",
                            self.proc.pid, self.deadline())
                self.proc.kill()
                await self.child_exit(30.0)
        return self.proc.returncode

    async def upstream_exited(self, within: float = 1.0) -> bool:
        """Has upstream's server exited, or does it within WITHIN seconds (a
        refused connection comes before the child is reaped)?"""
        return self.proc is not None and await self.child_exit(within) is not None

    # ------------------------------------------------------------ serving

    async def health(self, _request: web.Request) -> web.Response:
        code = await self.upstream_health()
        body = EngineHealth(
            status="ok" if code == 200 else "unhealthy",
            backend=self.cfg.backend,
            upstream_health=code,
            upstream_pid=self.proc.pid if self.proc else None,
            engine_config=msgspec.to_builtins(self.cfg.engine),  # what a rollback restores
            weights="disk" if self.not_retained else "daemon",
            weights_not_retained=self.not_retained or "",
            weights_pid=self.weights_pid,
            weights_socket_inode=self.weights_inode,
            **({"content_digest": self.fingerprint.content_digest, "checkpoint": self.fingerprint.model_path}
               if self.fingerprint is not None else {}),
            slot=self.slot,
            bridge=self.bridge,  # what the bridge runs with; "" in the main slot
            upstream_version=self.upstream_version,  # hostd_build_info (the gateway's /metrics)
            memory=memory.snapshot(),  # host_available: the overlap preflight's on CPU
        )
        return web.Response(body=health_encode(body), status=200 if code == 200 else 503,
                            content_type="application/json")

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        assert self.session
        body = await request.read()
        try:
            return await forward.forward(self.session, self.base + str(request.rel_url), request, body)
        except forward.Unreachable as exc:
            if await self.upstream_exited():
                # Upstream died and this process exits next: fail as a dead
                # engine does (the connection drops, no answer), so that the
                # gateway sends the request to the warm standby, as it does
                # when the engine's socket is gone (gateway/retry.py).
                if request.transport is not None:
                    request.transport.abort()  # the answer below is then written nowhere
            return web.json_response(
                {"error": {"message": f"the {self.cfg.backend} engine did not answer: {exc}", "type": "engine_unavailable"}},
                status=502,
            )
        except forward.Broken as exc:
            log.warning("the %s engine failed mid-response: %s", self.cfg.backend, exc)
            return exc.response

    def app(self) -> web.Application:
        app = web.Application(client_max_size=CLIENT_MAX_SIZE)
        app.router.add_get("/health", self.health)
        app.router.add_route("*", "/{tail:.*}", self.proxy)
        return app

    # ------------------------------------------------------------ main

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.stopping.set)
        runner: Optional[web.AppRunner] = None
        listener: Optional[socket.socket] = None
        try:
            if self.not_retained:
                log.warning("weights of %s are not retained: %s; the %s engine loads them from disk",
                            self.name, self.not_retained, self.cfg.backend)
            if self.slot == "standby":
                problem = self.standby_fit_problem()
                if problem:
                    log.error("the standby of %s does not fit: %s", self.name, problem)
                    systemd.status(f"refused: the standby does not fit: {problem}")
                    return STANDBY_DOES_NOT_FIT
            await self.start()
            systemd.status(f"{self.cfg.backend} engine starting on weights pid {self.weights_pid}"
                           + (" (loading from disk: weights not retained)" if self.not_retained else ""))
            with systemd.ExtendTimeout(self.cfg.timeouts.start, f"waiting for the {self.cfg.backend} server "
                                       "to answer /health"):
                healthy = await self.wait_healthy()
            if not healthy:
                if self.stopping.is_set():
                    await self.stop_child()
                    return 0
                if self.stderr_copier is not None:
                    await asyncio.wait({self.stderr_copier}, timeout=5)
                log.error("upstream engine exited with %s before it served: %s", self.proc.returncode,
                          self.stderr.error())
                systemd.status(f"failed: upstream exited with {self.proc.returncode}")
                return 1
            listener = sockets.acquire(self.socket_path)
            # auto_decompress off: bodies pass to the upstream engine as they came, never inflated here.
            runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True,
                                   auto_decompress=False, logger=logs.protocol_logger(log))
            await runner.setup()
            await web.SockSite(runner, listener).start()
            log.info("serving %s through %s engine pid %d", self.name, self.cfg.backend, self.proc.pid)
            self.stderr.starting = False
            systemd.notify("READY=1", f"STATUS=serving {self.name} ({self.cfg.backend})")
            await self.child_exit()  # the server exits, or we are asked to stop
            if not self.stopping.is_set():
                code = self.proc.returncode
                log.error("upstream engine pid %d exited with %s", self.proc.pid, code)
                systemd.status(f"failed: upstream exited with {code}")
                return code if code else 1
            systemd.notify("STOPPING=1")
            systemd.status(f"shutting down: {self.cfg.backend} drains for up to {self.deadline():.0f} s")
            code = await self.stop_child()
            log.info("upstream engine stopped (exit %s)", code)
            return 0
        finally:
            if self.proc is not None and self.proc.returncode is None:
                await self.stop_child()
            if runner is not None:
                await runner.cleanup()
            if self.session is not None:
                await self.session.close()
            if listener is not None:
                sockets.release(listener)


def checkpoint_problem(cfg, held: protocol.Fingerprint, weights_path: Path) -> Optional[str]:
    """Why an engine of CFG must not start on the weight daemon at
    WEIGHTS_PATH, which holds (or, not retained, names) HELD: it is another
    checkpoint than CFG's `model:` (resolved), as after `model:` changed on
    disk before the daemon restarted. Upstream would serve `model:` from
    disk beside the daemon (CPU) or refuse the daemon's weights (GPU), and
    /health would name the daemon's checkpoint; as the builtin engine, which
    refuses a fingerprint mismatch, it does not start."""
    wanted = str(Path(cfg.model).resolve())
    if held.model_path == wanted:
        return None
    return (f"the weight daemon at {weights_path} holds {held.model_path}, but model: names {wanted}; "
            "a checkpoint swap (systemctl reload, hostctl reload NAME model=...) or systemctl restart of the "
            "model loads it")


def version_problem(cfg, backend, held: str, weights_path: Path, name: str) -> Optional[str]:
    """Why this engine must not start on a daemon that started upstream at
    version HELD: its own upstream is another (installed in place since,
    `pip install -U vllm`). vLLM keys its weight cache by its version and
    hostd runs it without a fallback to disk, so it would fail later and
    less clearly; SGLang's client and daemon are one release. None when the
    two match or either cannot be told."""
    mine = backend.upstream_version(cfg)
    if not held or not mine or held == mine:
        return None
    return (f"the weight daemon at {weights_path} runs {cfg.backend} {held}, this engine's {cfg.backend} is {mine} "
            f"(upgraded in place since the daemon started?): both must be one version; restart the model so that "
            f"both run {mine} (systemctl restart model@{name}.service, which loads the weights once), or put "
            f"{held} back (docs/vllm.md, Upgrading vLLM)")


def run(args, cfg, backend) -> int:
    """`hostd engine NAME` for an upstream BACKEND (its run_engine, once
    hostd/dispatch.py has checked CFG)."""
    weights_path = Path(args.weights) if args.weights else paths.weights_socket(args.name, args.weights_slot)
    try:
        status = weights_client.status(weights_path)
    except (OSError, weights_client.WeightsRefused, protocol.ProtocolError) as exc:
        log.error("cannot reach the weight cache of %s at %s: %s", args.name, weights_path, exc)
        systemd.status(f"failed: no weight cache ({exc})")
        return 1
    problem = (checkpoint_problem(cfg, status.fingerprint, weights_path)
               or version_problem(cfg, backend, status.upstream_version, weights_path, args.name))
    if problem:
        log.error("cannot serve %s: %s", args.name, problem)
        systemd.status(f"refused: {problem}")
        return 1
    socket_path = Path(args.socket) if args.socket else paths.engine_socket(args.name, args.slot)
    if not args.socket:
        sockets.ensure_private_dir(socket_path.parent)
    supervisor = EngineSupervisor(args.name, cfg, backend, socket_path, (status.pid, status.socket_inode), args.slot,
                                  args.weights_slot, status.fingerprint)
    return asyncio.run(supervisor.main())
