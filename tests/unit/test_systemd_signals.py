"""The manager's copy of unit states (hostd/manager/systemd1.py) across a
`systemctl daemon-reload`, on the fake bus of reload_fakes.py: systemd 252
sends UnitRemoved for every unit while it reloads, running ones included."""

from __future__ import annotations

import asyncio

from reload_fakes import World, unit_path
from hostd.manager.systemd1 import MANAGER, PATH

UMBRELLA = "model@tiny.service"


def test_a_daemon_reload_leaves_running_units_running_in_the_managers_copy(tmp_path):
    async def main():
        world = World(tmp_path)
        await world.connect()
        assert await world.systemd.active_state(UMBRELLA) == "active"
        world.bus.emit(PATH, MANAGER, "Reloading", "b", [True])
        world.bus.emit(PATH, MANAGER, "UnitRemoved", "so", [UMBRELLA, unit_path(UMBRELLA)])
        world.bus.emit(PATH, MANAGER, "Reloading", "b", [False])
        await asyncio.sleep(0.01)  # the copy is read again after the reload
        assert await world.systemd.active_state(UMBRELLA) == "active"
        assert world.bus.sent[-1] == "org.freedesktop.DBus.Properties.GetAll"

    asyncio.run(main())


def test_a_unit_unloaded_outside_a_daemon_reload_reads_inactive(tmp_path):
    async def main():
        world = World(tmp_path)
        await world.connect()
        assert await world.systemd.active_state(UMBRELLA) == "active"
        world.bus.emit(PATH, MANAGER, "UnitRemoved", "so", [UMBRELLA, unit_path(UMBRELLA)])
        assert await world.systemd.active_state(UMBRELLA) == "inactive"

    asyncio.run(main())


def test_the_watchdog_is_fed_from_the_event_loop_and_only_for_this_process(tmp_path, monkeypatch):
    """hostd.service's WatchdogSec= (issue 52, S1: a manager frozen on a read
    stayed frozen): feed_watchdog sends WATCHDOG=1 every third of
    WATCHDOG_USEC from the loop, and nothing for a watchdog meant for
    another process (WATCHDOG_PID) or for a unit without one."""
    import os
    import socket

    from hostd import systemd as unit_notify

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(5)
    monkeypatch.setattr(unit_notify, "_notifier", None)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    monkeypatch.setenv("WATCHDOG_USEC", "90000")  # fed every 30 ms
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))

    async def fed_for(seconds: float) -> None:
        try:
            await asyncio.wait_for(unit_notify.feed_watchdog(), seconds)
        except asyncio.TimeoutError:
            pass

    # About 8 feeds due (a datagram queue holds 10 unread: more would block the sender); a loaded machine runs fewer.
    asyncio.run(fed_for(0.25))
    received = []
    listener.setblocking(False)
    while True:
        try:
            received.append(listener.recv(64))
        except BlockingIOError:
            break
    assert received and set(received) == {b"WATCHDOG=1"} and len(received) >= 2, received  # fed again, not once
    for variable, value in (("WATCHDOG_PID", str(os.getpid() + 1)), ("WATCHDOG_USEC", "")):
        monkeypatch.setenv(variable, value)
        asyncio.run(asyncio.wait_for(unit_notify.feed_watchdog(), 1))  # returns at once: nothing to feed
    listener.close()


def test_start_extensions_never_pass_timeouts_start_and_a_hung_start_names_its_phase(tmp_path, monkeypatch, caplog):
    """Issue 52: EXTEND_TIMEOUT_USEC sent every 10 s for as long as a step ran
    kept a hung start `activating` for ever (systemd honours each one).
    Now each extension ends by LIMIT from the process's start, and just
    before it the error line and the status name the phase."""
    import logging
    import socket
    import time

    from hostd import systemd as unit_notify

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    monkeypatch.setattr(unit_notify, "_notifier", None)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    limit = unit_notify.process_age() + 2.0
    caplog.set_level(logging.ERROR, logger="hostd.systemd")
    started = time.monotonic()
    with unit_notify.ExtendTimeout(limit, "loading /srv/qwen", every=0.2):
        time.sleep(2.5)  # the step hangs past the limit
    listener.setblocking(False)
    sent = []
    while True:
        try:
            sent.append(listener.recv(256).decode())
        except BlockingIOError:
            break
    extensions = [int(m.split("=")[1]) / 1e6 for m in sent if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extensions and all(e <= 2.0 for e in extensions), sent  # never past the limit
    assert sent[-1] == "STATUS=start hung in phase loading /srv/qwen: timeouts.start (%g s) is up" % limit, sent
    assert "the start hung in phase loading /srv/qwen" in caplog.text
    assert time.monotonic() - started >= 2.5
    listener.close()
