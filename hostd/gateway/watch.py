"""Learn that an engine died from a connection it held, not from a poll.

One job: per engine slot, hold one idle Unix connection to the engine's
socket. The kernel ends it the moment the engine process dies (kill -9
included: EOF or reset within a millisecond), long before a request or the
health monitor (HEALTH_INTERVAL) would notice. On that end the socket is
connected again at once:

    refused, no such socket   the engine is gone: ON_LOST(slot), the path a
                              request that cannot reach it takes
    connected                 the engine only closed an idle connection, or
                              it restarted: the watch holds the new one

A slot whose socket takes no connection is tried every RETRY seconds; the
first connection after that is ON_UP(slot) (an engine listens only once
warm, so a failover may end). What a death means (failover, engine-down,
nothing while the gateway is held) is the gateway's (server.py, slots.py);
the health monitor stays as the fallback.

Trusts: nothing it reads; the connection never sends a byte, and whatever
the engine sends on it is discarded.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Awaitable, Callable

log = logging.getLogger("hostd.gateway")

RETRY = 0.5  # a slot with no engine listening is tried this often
QUICK = 1.0  # a connection the engine ends sooner than this is re-armed only after QUICK (no busy loop)
READ_BYTES = 4096


class EngineWatch:
    def __init__(self, sockets: dict[str, Path], on_lost: Callable[[str], Awaitable[None]],
                 on_up: Callable[[str], Awaitable[None]]):
        self.sockets = sockets  # slot -> engine socket
        self.on_lost = on_lost
        self.on_up = on_up
        self.held: dict[str, bool] = {}  # slot -> a connection is held now
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(slot, path), name=f"watch {slot}")
                       for slot, path in self.sockets.items()]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _watch(self, slot: str, path: Path) -> None:
        loop = asyncio.get_running_loop()
        armed = False  # the last attempt held a connection: its end may be a death
        lived = QUICK
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path))
            except OSError:
                self.held[slot] = False
                if armed:
                    armed = False
                    # INFO: a stop the manager made (an overlap's retire) ends the same way;
                    # what it means for the traffic (a failover, engine-down) the gateway logs.
                    log.info("the %s engine's socket %s takes no connection: its engine is gone", slot, path)
                    await self._call(self.on_lost, slot)
                await asyncio.sleep(RETRY)
                continue
            self.held[slot] = True
            if not armed:
                armed = True
                await self._call(self.on_up, slot)
            if lived < QUICK:
                await asyncio.sleep(QUICK)  # held meanwhile: a death is still seen, just later
            opened = loop.time()
            try:
                while await reader.read(READ_BYTES):
                    pass
            except OSError:  # reset: as EOF
                pass
            finally:
                writer.close()
            lived = loop.time() - opened

    async def _call(self, hook: Callable[[str], Awaitable[None]], slot: str) -> None:
        # A failing hook must not end the watch: the next death would go unseen.
        try:
            await hook(slot)
        except Exception:
            log.exception("the %s engine's watch: its hook failed", slot)
