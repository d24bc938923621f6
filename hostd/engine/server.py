"""The builtin engine's process: listen, report status, stop gracefully.

One job: run the application of app.py for one loaded model as a process --
warm the model up, take its listening socket, say when it serves and what it
is doing (a one-line status for systemd's STATUS=), and shut down gracefully
on SIGTERM.

Trust: the engine listens on /run/hostd/NAME/engine.sock, a 0600 socket in the
model's private 0700 runtime directory, taken through hostd/sockets.py
(acquire: systemd's socket if passed, else bound there; release: the file
removed only if it is still ours), so only the service user (the gateway, the
manager) and root can connect; it trusts those peers and does no
authentication, and app.py still validates every request.

Shutdown (SIGTERM or SIGINT): stop listening, answer 503 with Retry-After to
any new request on an open connection, let admitted requests (streams
included) finish for up to ``Limits.shutdown_timeout`` seconds, then cancel
what is left, and return exit code 0. A second signal cancels at once.

Rebuild (the main engine and the warm standby: run_server's ``rebuild``):
``POST /hostd/rebuild`` with ``{"engine": {...}}`` applies that engine
section in this process on the same model object (``rebuild`` returns a
Rebuilt: the refusals checked, new limits, new /health facts), builds a
runner for it (its KV cache: the main engine's full budget, the standby's
idle one; off the event loop) beside the serving one, warms it up, and
only then swaps it in: a new application on the same listening socket takes
new connections, the old one closes its connections as their requests end,
finishes what it admitted (up to its shutdown_timeout) and stops. No imports,
no process start, no new socket, no new skeleton. Its phases (rebuild_s):
refusals, runner, warm_up, swap. Answers 200 with the new /health, 422 with
{"error"} when the section is refused (the old runner keeps serving,
untouched), 409 while another rebuild runs or the process shuts down. The route is the manager's: no backend's
public routes list it, so the gateway never forwards a client to it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from hostd import logs, sockets
from hostd.engine.app import ENGINE, Engine, Limits, build_app, make_runner
from hostd.engine.generate import warm_up
from hostd.engine.standby_kv import references, return_freed_memory

CANCEL_GRACE_S = 5.0  # after cancelling, how long handlers get to write their error and close
STATUS_INTERVAL_S = 1.0  # on_status is called at most about this often

_log = logging.getLogger("hostd.engine")

__all__ = ["Limits", "REBUILD_PATH", "Rebuilt", "RebuildRefused", "run_server"]

REBUILD_PATH = "/hostd/rebuild"  # the manager's rebuild-in-place verb (module docstring)
REBUILD_MAX_BODY = 64 << 10  # bytes: an engine section is a few hundred


class RebuildRefused(Exception):
    """The engine section a rebuild was given cannot be served (the old model keeps serving)."""


@dataclass
class Rebuilt:
    """What ``rebuild`` returns: the model to serve (the same object), the
    new section's limits and its /health facts (as run_server's health_info)."""

    model: Any
    limits: Limits
    health_info: "dict | Callable[[], dict] | None" = None
    phases_s: dict[str, float] = field(default_factory=dict)  # seconds per rebuild phase, for /health


@dataclass
class _Serving:
    """The application that takes new connections now, and what it runs on."""

    app: web.Application
    engine: Engine
    runner: web.AppRunner
    site: "web.SockSite | None" = None
    sock: "socket.socket | None" = None  # the listening socket the site owns (closed by its stop)


class _StatusLine:
    """Hands a one-line status to a callback when it changes, at most about once per interval."""

    def __init__(self, callback: Callable[[str], None] | None, log: logging.Logger, interval: float) -> None:
        self._callback = callback
        self._log = log
        self._interval = interval
        self._wanted: str | None = None
        self._shown: str | None = None
        self._last = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    def set(self, text: str, *, now: bool = False) -> None:
        self._wanted = text
        if self._callback is None or (self._timer is not None and not now):
            return  # nothing to call, or a pending report will carry the latest text
        loop = asyncio.get_running_loop()
        wait = self._last + self._interval - loop.time()
        if now or wait <= 0:
            self._emit()
        else:
            self._timer = loop.call_later(wait, self._emit)

    def _emit(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wanted == self._shown:
            return
        self._shown = self._wanted
        self._last = asyncio.get_running_loop().time()
        try:
            self._callback(self._shown)
        except Exception:
            self._log.exception("the on_status callback failed")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def run_server(
    model,
    tokenizer,
    limits: Limits,
    *,
    served_name: str,
    socket_path: Path,
    on_ready: "Callable[[], None] | None" = None,
    on_status: "Callable[[str], None] | None" = None,
    health_info: "dict | Callable[[], dict] | None" = None,
    log: logging.Logger | None = None,
    rebuild: "Callable[[object], Rebuilt] | None" = None,
    on_phase: "Callable[[str], None] | None" = None,
) -> int:
    """Serve MODEL as SERVED_NAME within LIMITS until SIGTERM or SIGINT;
    returns the process exit code. With REBUILD (the main engine, the warm standby), POST
    /hostd/rebuild rebuilds the model in this process (module docstring):
    REBUILD(the request's engine section) runs on a worker thread and raises
    RebuildRefused for a section it cannot serve.

    Warms the model up first, then listens on the socket systemd passed or
    else on ``socket_path`` (hostd/sockets.py's acquire: 0600 in a private
    directory, a stale socket replaced); ``on_ready`` is called once the
    socket is listening and the model has generated, ``on_status`` with a
    one-line summary when it changes (about once a second at most), and
    ``on_phase`` with the name of each start-up step as it ends (warm_up:
    one generation on the model; runner: the runner built and warmed up;
    listen: the socket taken), for /health's phases_s. Must run on the main
    thread (signal handlers).
    """
    log = log or _log
    return asyncio.run(_serve(
        model, tokenizer, limits, served_name=served_name, socket_path=Path(socket_path), on_ready=on_ready,
        status=_StatusLine(on_status, log, STATUS_INTERVAL_S), health_info=health_info, log=log, rebuild=rebuild,
        on_phase=on_phase or (lambda phase: None),
    ))


async def _serve(model, tokenizer, limits: Limits, *, served_name, socket_path: Path, on_ready, status: _StatusLine,
                 health_info, log: logging.Logger, rebuild=None, on_phase=lambda phase: None) -> int:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            log.info("%s received: shutting down gracefully (up to %gs for requests in flight)", name,
                     limits.shutdown_timeout)
            stop.set()
        else:
            log.warning("%s received again: cancelling requests in flight now", name)
            hurry.set()

    handled = (signal.SIGTERM, signal.SIGINT)
    for signum in handled:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        status.set("warming up", now=True)
        try:
            # Batched, the runner's own warm-up generation follows (and on
            # CUDA the library runs each step eagerly before capturing it):
            # a generation here first cost 0.54 s of a 0.5B CPU start's
            # 2.52 s of warm-up and saved the runner's nothing.
            if limits.batching != "continuous":
                await asyncio.to_thread(warm_up, model, tokenizer)
        except Exception:
            log.exception("the warm-up generation failed, so the model cannot serve; check the checkpoint, "
                          "its dtype and the device")
            return 1
        on_phase("warm_up")
        if stop.is_set():
            log.info("stopped before serving")
            return 0

        rebuilder = _Rebuilder(rebuild, tokenizer, served_name, status, log, stop, hurry) if rebuild else None
        try:
            serving = await _application(model, tokenizer, limits, served_name, health_info, log, status, rebuilder)
        except Exception as error:
            log.exception("the engine cannot serve with batching=%s: %s", limits.batching, logs.one_line(error))
            return 1
        engine = serving.engine
        if engine.standby_kv is not None:  # the warm standby: its first full cache costs the start, not a failover
            try:
                await engine.standby_kv.prime()
            except Exception as error:
                log.exception("the standby cannot hold its full KV budget: %s", logs.one_line(error))
                await serving.runner.cleanup()
                return 1
        on_phase("runner")
        try:
            listener = sockets.acquire(socket_path, bind=functools.partial(sockets.bind_private, backlog=socket.SOMAXCONN))
        except (sockets.UnsafePath, OSError) as error:
            log.error("cannot listen: %s", error)
            await serving.runner.cleanup()
            return 1
        serving.sock = listener
        serving.site = web.SockSite(serving.runner, listener)
        await serving.site.start()
        if rebuilder is not None:
            rebuilder.serving = serving
        log.info("serving %s on unix:%s (max_num_seqs=%d, max_model_len=%d)", served_name, listener.getsockname(),
                 limits.max_num_seqs, limits.max_model_len)
        on_phase("listen")
        if on_ready is not None:
            try:
                on_ready()
            except Exception:
                log.exception("the on_ready callback failed")
        status.set(engine.summary(), now=True)

        await stop.wait()

        if rebuilder is not None:  # a rebuild under way finishes (or gives up) first; none starts now
            async with rebuilder.lock:
                serving = rebuilder.serving
            engine = serving.engine
        engine.draining = True
        status.set(engine.summary(), now=True)
        await serving.site.stop()  # closes the listening socket; open connections stay
        sockets.release(listener)  # and its file, if still ours
        if engine.in_flight:
            log.info("waiting for %d request(s) in flight", engine.in_flight)
        shutdown_timeout = engine.limits.shutdown_timeout
        if not await _wait_idle(engine, shutdown_timeout, hurry):
            log.warning("%d request(s) still in flight after %gs; cancelling them", engine.in_flight,
                        shutdown_timeout)
            engine.runner.cancel_all()
        await serving.runner.cleanup()  # closes connections, then stops the worker threads
        if rebuilder is not None and rebuilder.retiring:  # a model a rebuild replaced, still finishing
            await asyncio.wait(set(rebuilder.retiring), timeout=shutdown_timeout + CANCEL_GRACE_S)
        status.set("stopped", now=True)
        log.info("stopped")
        return 0
    finally:
        status.close()
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _application(model, tokenizer, limits: Limits, served_name: str, health_info, log: logging.Logger,
                       status: _StatusLine, rebuilder: "_Rebuilder | None", runner=None) -> _Serving:
    """MODEL's application (on RUNNER when given), warmed up and set up (not
    yet listening); with REBUILDER its rebuild route too."""
    app = build_app(model, tokenizer, limits, served_name=served_name, health_info=health_info, log=log,
                    runner=runner)
    if rebuilder is not None:
        app.router.add_post(REBUILD_PATH, rebuilder.handle)
    engine = app[ENGINE]
    if hasattr(engine.runner, "warm_up"):  # the batched loop: one generation through it too
        try:
            await engine.runner.warm_up()
        except BaseException:
            await app.shutdown()
            await app.cleanup()
            raise
    engine.on_change = lambda: status.set(engine.summary())
    # auto_decompress off: a body is never inflated here, whatever its
    # Content-Encoding says (a bomb costs this loop what it weighs, issue 33 M3);
    # an encoded body is not JSON, so it is answered 400.
    runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                           shutdown_timeout=CANCEL_GRACE_S, auto_decompress=False,
                           logger=logs.protocol_logger(log))
    await runner.setup()
    return _Serving(app=app, engine=engine, runner=runner)


class _Rebuilder:
    """The rebuild-in-place verb (module docstring): one at a time, never
    while shutting down; the old application serves until the new one is
    warm and listening."""

    def __init__(self, rebuild: Callable[[object], Rebuilt], tokenizer, served_name: str, status: _StatusLine,
                 log: logging.Logger, stop: asyncio.Event, hurry: asyncio.Event) -> None:
        self.rebuild, self.tokenizer, self.served_name = rebuild, tokenizer, served_name
        self.status, self.log, self.stop, self.hurry = status, log, stop, hurry
        self.lock = asyncio.Lock()
        self.serving: "_Serving | None" = None
        self.retiring: set[asyncio.Task] = set()  # rebuilds under way and replaced models finishing: held to their end

    @staticmethod
    def answer(status: int, body: dict) -> web.Response:
        return web.Response(status=status, body=json.dumps(body), content_type="application/json")

    async def handle(self, request: web.Request) -> web.Response:
        if self.lock.locked() or self.stop.is_set() or self.serving is None:
            return self.answer(409, {"error": "a rebuild is running or the engine is shutting down; not rebuilding"})
        raw = await request.content.read(REBUILD_MAX_BODY + 1)
        try:
            body = json.loads(raw) if len(raw) <= REBUILD_MAX_BODY else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or not isinstance(body.get("engine"), dict):
            return self.answer(400, {"error": 'expected {"engine": {...}}, the engine section to rebuild with'})
        # Shielded: a manager that dies (or gives up) mid-rebuild cancels this
        # handler, never the rebuild, which ends as it would have, its new
        # runner swapped in or freed (a half-built one would stay allocated).
        task = asyncio.ensure_future(self._locked(body["engine"]))
        self.retiring.add(task)  # held to its end (and waited for at shutdown) even when nobody awaits it
        task.add_done_callback(self.retiring.discard)
        return await asyncio.shield(task)

    async def _locked(self, section: dict) -> web.Response:
        async with self.lock:
            return await self._rebuild(section)

    async def _rebuild(self, section: dict) -> web.Response:
        log, started = self.log, time.monotonic()
        log.info("rebuild requested: engine %s", json.dumps(section, sort_keys=True))
        self.status.set("rebuilding", now=True)
        try:
            rebuilt = await asyncio.to_thread(self.rebuild, section)
            phases = rebuilt.phases_s
            phases["refusals"] = round(time.monotonic() - started, 4)
            mark = time.monotonic()
            # No pre-capture of the largest step's CUDA graph: most of a rebuild's time on the H200 (batch.py)
            runner = await asyncio.to_thread(make_runner, rebuilt.model, self.tokenizer, rebuilt.limits,
                                             precapture=False)
            phases["runner"] = round(time.monotonic() - mark, 4)  # KV allocation and batching start
            if self.stop.is_set():
                runner.cancel_all()
                await asyncio.to_thread(runner.join)
                return self.answer(409, {"error": "the engine is shutting down; not rebuilding"})
            mark = time.monotonic()
            # The application around a built runner costs nothing beside its warm-up generation.
            try:
                new = await _application(rebuilt.model, self.tokenizer, rebuilt.limits, self.served_name,
                                         rebuilt.health_info, log, self.status, self, runner=runner)
            except BaseException:  # no application took the runner (or its cleanup stopped it: idempotent)
                runner.cancel_all()
                await asyncio.to_thread(runner.join)
                raise
            phases["warm_up"] = round(time.monotonic() - mark, 4)
        except RebuildRefused as error:
            log.error("rebuild refused, the old runner keeps serving: %s", error)
            self.status.set(self.serving.engine.summary(), now=True)
            return self.answer(422, {"error": str(error)})
        except Exception as error:
            log.exception("rebuild failed, the old runner keeps serving")
            self.status.set(self.serving.engine.summary(), now=True)
            return self.answer(500, {"error": f"rebuild failed: {type(error).__name__}: {error}"})
        old = self.serving
        swap = time.monotonic()
        # The new application takes new connections on the same socket before
        # the old one stops taking them: none is refused in between.
        new.sock = socket.socket(old.sock.family, old.sock.type, old.sock.proto, fileno=os.dup(old.sock.fileno()))
        new.site = web.SockSite(new.runner, new.sock)
        await new.site.start()
        await old.site.stop()
        self.serving = new
        phases["swap"] = round(time.monotonic() - swap, 4)
        task = asyncio.create_task(self._retire(old))
        self.retiring.add(task)
        task.add_done_callback(self.retiring.discard)
        log.info("rebuilt in %.3f s (phases %s): serving with max_num_seqs=%d, max_model_len=%d",
                 time.monotonic() - started, json.dumps(phases), rebuilt.limits.max_num_seqs,
                 rebuilt.limits.max_model_len)
        self.status.set(new.engine.summary(), now=True)
        answer = self.answer(200, msgspec.to_builtins(msgspec.structs.replace(new.engine.health(), rebuild_s=phases)))
        # This connection belongs to the old application, which closes it once
        # idle (_retire): a client reusing it could send its next request just
        # as it closes, and lose it. Connection: close makes it open a new one.
        answer.force_close()
        return answer

    async def _retire(self, old: _Serving) -> None:
        """The old application finishes what it admitted (up to its
        shutdown_timeout), then stops and frees its worker threads."""
        await asyncio.sleep(0)  # the rebuild's own answer goes out first
        # Its connections close once their request ends (idle ones now), so a
        # client's next request opens a connection to the new model; none is
        # answered 503 for it.
        old.runner.server.pre_shutdown()
        if not await _wait_idle(old.engine, old.engine.limits.shutdown_timeout, self.hurry):
            self.log.warning("%d request(s) still ran on the model before the rebuild; cancelling them",
                             old.engine.in_flight)
            old.engine.runner.cancel_all()
        await old.runner.cleanup()
        # The old model's runner and its KV cache are garbage now: so that
        # NVML (and the manager's preflight through it) sees them returned.
        # The old engine and its runner refer to each other (on_change), and
        # the engine sits in cycles of its own (its metrics, its standby KV):
        # let go of the runner so that it is freed now, without a collection.
        for _ in range(2):  # its last outputs' deliveries, queued on this loop, run (they hold it)
            await asyncio.sleep(0)
        engine = old.engine
        gone = references(engine.runner)
        engine.runner.on_change = None
        engine.runner = None
        del engine, old
        started = time.monotonic()
        collected = await asyncio.to_thread(return_freed_memory, gone)
        self.log.info("the model's runner before the rebuild is freed: %.3f s (%s)", time.monotonic() - started,
                      "a collection ran: a reference to it was still alive" if collected
                      else "freed when its last reference went")


async def _wait_idle(engine: Engine, timeout: float, hurry: asyncio.Event) -> bool:
    """Wait until no generation request is in flight; False on timeout or a second signal."""
    if engine.in_flight == 0:
        return True
    idle = asyncio.ensure_future(engine.idle.wait())
    hurried = asyncio.ensure_future(hurry.wait())
    done, pending = await asyncio.wait({idle, hurried}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return idle in done
