"""What a hostd process needs from systemd, and nothing when run by hand.

One job: sd_notify (READY=1, STATUS=, EXTEND_TIMEOUT_USEC=, STOPPING=1),
socket activation (LISTEN_FDS), and keeping systemd's per-process variables
out of the children a daemon starts (child_env). Outside systemd (no
NOTIFY_SOCKET, no LISTEN_FDS) every call is a no-op, so each daemon runs the
same by hand.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Optional

import sdnotify

SD_LISTEN_FDS_START = 3

# What systemd sets for this process alone: its notify socket, the sockets it
# passed, its watchdog. A child that inherited them would notify systemd in
# our name or take our sockets.
PER_PROCESS_VARIABLES = ("NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")

_notifier: Optional[sdnotify.SystemdNotifier] = None
_log = logging.getLogger("hostd.systemd")


def notify(*lines: str) -> None:
    """Send sd_notify lines (e.g. "READY=1", "STATUS=serving"); no-op outside systemd."""
    global _notifier
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    if _notifier is None:
        _notifier = sdnotify.SystemdNotifier()
    _notifier.notify("\n".join(lines))


async def feed_watchdog() -> None:
    """Tell systemd every third of the unit's WatchdogSec= that this event
    loop still runs (WATCHDOG=1, sd_watchdog_enabled(3)'s rule: WATCHDOG_USEC,
    and WATCHDOG_PID when set, naming this process). A loop that stops
    turning stops feeding, and systemd restarts the unit (Restart=). Returns
    at once when the unit has no watchdog."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(int(usec) / 3e6)


def barrier(timeout: float = 10.0) -> bool:
    """Wait until systemd has processed every notification this process sent
    (sd_notify_barrier(3): BARRIER=1 with a pipe's write end, which systemd
    closes once it got there). True outside systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return True
    read_end, write_end = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect("\0" + path[1:] if path.startswith("@") else path)
            sock.sendmsg([b"BARRIER=1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", write_end))])
        os.close(write_end)
        write_end = -1
        poller = select.poll()
        poller.register(read_end, select.POLLHUP)
        return bool(poller.poll(int(timeout * 1000)))
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def status(text: str) -> None:
    notify(f"STATUS={text.splitlines()[0] if text else ''}")


def process_age() -> float:
    """Seconds since this process started (/proc/self/stat's starttime
    against /proc/uptime): how much of its unit's start timeout it has used."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return max(0.0, float(f.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class ExtendTimeout:
    """While a long step runs (loading weights, an upstream server's start),
    keep asking systemd for more start-up time (EXTEND_TIMEOUT_USEC), never
    past LIMIT seconds from the process's start (timeouts.start, which the
    generator also writes as the unit's TimeoutStartSec=; None: no bound, for
    a unit without one). An extension sent for ever made timeouts.start
    bound nothing: a start that hung stayed `activating`, holding its
    memory, and Restart= never ran (issue 52). Past the limit one error line
    and the unit's status name PHASE, the step that hung, and systemd fails
    the unit at its start timeout."""

    def __init__(self, limit: Optional[float] = None, phase: str = "starting", every: float = 10.0,
                 extend_by: float = 30.0):
        self._limit, self._phase, self._every, self._extend_by = limit, phase, every, extend_by
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + (self._limit - process_age()) if self._limit is not None else float("inf")
        while True:
            left = deadline - time.monotonic()
            if left <= 1.0:  # said just before systemd's own timeout stops the unit
                _log.error("the start hung in phase %s: timeouts.start (%g s) is up; systemd stops the unit",
                           self._phase, self._limit)
                status(f"start hung in phase {self._phase}: timeouts.start ({self._limit:g} s) is up")
                return
            notify(f"EXTEND_TIMEOUT_USEC={int(min(self._extend_by, left) * 1_000_000)}")
            if self._stop.wait(min(self._every, left - 1.0)):
                return

    def __enter__(self) -> "ExtendTimeout":
        if os.environ.get("NOTIFY_SOCKET"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def listen_sockets() -> list[socket.socket]:
    """Sockets passed by systemd socket activation (empty when run by hand).

    The variables are removed so that children do not inherit them."""
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(key, None)
    if not count or pid != str(os.getpid()):
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets


def child_env(command_env: dict[str, str], unset: tuple[str, ...] = ()) -> dict[str, str]:
    """The full environment of a child (an upstream daemon or server): ours
    minus systemd's per-process variables, plus COMMAND_ENV, minus UNSET."""
    env = {key: value for key, value in os.environ.items() if key not in PER_PROCESS_VARIABLES}
    env.update(command_env)
    for key in unset:
        env.pop(key, None)
    return env
