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
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from hostd import logs, sockets
from hostd.engine.app import ENGINE, Engine, Limits, build_app
from hostd.engine.generate import warm_up

CANCEL_GRACE_S = 5.0  # after cancelling, how long handlers get to write their error and close
STATUS_INTERVAL_S = 1.0  # on_status is called at most about this often

_log = logging.getLogger("hostd.engine")

__all__ = ["Limits", "run_server"]


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
) -> int:
    """Serve MODEL as SERVED_NAME within LIMITS until SIGTERM or SIGINT;
    returns the process exit code.

    Warms the model up first, then listens on the socket systemd passed or
    else on ``socket_path`` (hostd/sockets.py's acquire: 0600 in a private
    directory, a stale socket replaced); ``on_ready`` is called once the
    socket is listening and the model has generated, ``on_status`` with a
    one-line summary when it changes (about once a second at most). Must run
    on the main thread (signal handlers).
    """
    log = log or _log
    return asyncio.run(_serve(
        model, tokenizer, limits, served_name=served_name, socket_path=Path(socket_path), on_ready=on_ready,
        status=_StatusLine(on_status, log, STATUS_INTERVAL_S), health_info=health_info, log=log,
    ))


async def _serve(model, tokenizer, limits: Limits, *, served_name, socket_path: Path, on_ready, status: _StatusLine,
                 health_info, log: logging.Logger) -> int:
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
            await asyncio.to_thread(warm_up, model, tokenizer)
        except Exception:
            log.exception("the warm-up generation failed, so the model cannot serve; check the checkpoint, "
                          "its dtype and the device")
            return 1
        if stop.is_set():
            log.info("stopped before serving")
            return 0

        try:
            app = build_app(model, tokenizer, limits, served_name=served_name, health_info=health_info, log=log)
            engine = app[ENGINE]
            if hasattr(engine.runner, "warm_up"):  # the batched loop: one generation through it too
                await engine.runner.warm_up()
        except Exception as error:
            log.exception("the engine cannot serve with batching=%s: %s", limits.batching, logs.one_line(error))
            if "app" in locals():
                await app.shutdown()
                await app.cleanup()
            return 1
        engine.on_change = lambda: status.set(engine.summary())
        runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=CANCEL_GRACE_S, logger=logs.protocol_logger(log))
        await runner.setup()
        try:
            listener = sockets.acquire(socket_path, bind=functools.partial(sockets.bind_private, backlog=socket.SOMAXCONN))
        except (sockets.UnsafePath, OSError) as error:
            log.error("cannot listen: %s", error)
            await runner.cleanup()
            return 1
        site = web.SockSite(runner, listener)
        await site.start()
        log.info("serving %s on unix:%s (max_num_seqs=%d, max_model_len=%d)", served_name, listener.getsockname(),
                 limits.max_num_seqs, limits.max_model_len)
        if on_ready is not None:
            try:
                on_ready()
            except Exception:
                log.exception("the on_ready callback failed")
        status.set(engine.summary(), now=True)

        await stop.wait()

        engine.draining = True
        status.set(engine.summary(), now=True)
        await site.stop()  # closes the listening socket; open connections stay
        sockets.release(listener)  # and its file, if still ours
        if engine.in_flight:
            log.info("waiting for %d request(s) in flight", engine.in_flight)
        if not await _wait_idle(engine, limits.shutdown_timeout, hurry):
            log.warning("%d request(s) still in flight after %gs; cancelling them", engine.in_flight,
                        limits.shutdown_timeout)
            engine.runner.cancel_all()
        await runner.cleanup()  # closes connections, then stops the worker threads
        status.set("stopped", now=True)
        log.info("stopped")
        return 0
    finally:
        status.close()
        for signum in handled:
            loop.remove_signal_handler(signum)


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
