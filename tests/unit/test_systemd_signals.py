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
