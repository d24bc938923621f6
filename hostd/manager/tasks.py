"""The manager's one keeper of background tasks.

One job: hold a strong reference to a task the manager starts and does not
await (a reload run, an Operation's tracking, recovery, a standby restarted
in the background) until it ends: asyncio keeps only weak references, so a
task nobody holds may be collected mid-way.

Trust: nothing here reads input.
"""

from __future__ import annotations

import asyncio

_KEPT: set[asyncio.Task] = set()


def keep(task: asyncio.Task) -> asyncio.Task:
    """Hold TASK until it ends; returns it."""
    _KEPT.add(task)
    task.add_done_callback(_KEPT.discard)
    return task


def pending() -> list[asyncio.Task]:
    """The tasks held now that belong to the running event loop (a test
    awaits them; another loop's are not its own)."""
    loop = asyncio.get_running_loop()
    return [task for task in _KEPT if task.get_loop() is loop]
