"""Which engine gets the gateway's new requests: the one state machine of slots.

One job: hold where new requests go (``current``: main, next or standby) and,
during a failover, whose engine died (``failed_over``), and move them:

    switch(slot)      the manager's control verb (an overlap or standby
                      reload): refused while that engine does not answer;
                      ends any failover (the manager decides from then on)
    fail_over(slot)   standby: true, the engine in SLOT stopped answering
                      (a request could not reach it, or the health monitor):
                      new requests go to the standby, if it answers
    fail_back()       after a failover, once the dead engine's slot answers
                      /health again (a restarted engine listens only once
                      warm): new requests go back to it

What is in flight on each slot is Admission's (state.py: sent, moved, settle).

Trusts: the manager on the control socket (control.py), for switch.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Awaitable, Callable

log = logging.getLogger("hostd.gateway")


class SwitchRefused(Exception):
    """A switch the slots cannot make (no such slot, or its engine does not answer)."""


class Slots:
    def __init__(self, engine_sockets: dict[str, Path], answers: Callable[[str], Awaitable[bool]],
                 on_failover: Callable[[], None] = lambda: None):
        self.sockets = engine_sockets  # slot -> socket (paths.ENGINE_SOCKETS)
        self.answers = answers  # does SLOT's engine answer /health now?
        self.on_failover = on_failover  # counted in metrics
        self.current = "main"
        self.failed_over = ""  # the slot whose engine died, while new requests go to the standby
        # standby: true (the standby's socket is given): where new requests go
        # when the engine serving them dies.
        self.standby = "standby" in engine_sockets
        self._lock = asyncio.Lock()

    def status_line(self) -> str:
        """What systemd's STATUS= adds during a failover ('' otherwise)."""
        return f"; on the standby (the {self.failed_over} engine stopped answering)" if self.failed_over else ""

    async def fail_over(self, slot: str, held: bool) -> bool:
        """New requests go to the standby because the engine in SLOT, which
        they went to, stopped answering; True when they do (or a request that
        saw the same death moved them already). Never while HELD (a drain or
        pause: the manager is restarting engines)."""
        if not self.standby or slot == "standby" or held:
            return False
        async with self._lock:
            if self.current != slot:
                return self.current == "standby"
            if not await self.answers("standby"):
                log.warning("the %s engine stopped answering and the standby does not answer either", slot)
                return False
            self.current, self.failed_over = "standby", slot
        self.on_failover()
        log.warning("failover: the %s engine stopped answering; new requests go to the standby (%s) until it "
                    "answers again", slot, self.sockets["standby"])
        return True

    async def fail_back(self, running_on_standby: int) -> bool:
        """After a failover: back to the engine that died once it answers; True when moved."""
        back = self.failed_over
        if not back or self.current != "standby" or not await self.answers(back):
            return False
        async with self._lock:
            if self.failed_over != back or self.current != "standby":
                return False
            self.current, self.failed_over = back, ""
        log.info("failover ends: the %s engine answers again; new requests go to it, %d running on the "
                 "standby finish there", back, running_on_standby)
        return True

    async def switch(self, slot: str, in_flight: int) -> None:
        """New requests go to SLOT's engine from now on; running ones finish
        where they are. SwitchRefused while that engine does not answer, so a
        switch never sends traffic into the void."""
        if slot not in self.sockets:
            raise SwitchRefused(f"this model has no {slot} slot (standby: true makes the standby's)")
        if slot != self.current:
            if not await self.answers(slot):
                raise SwitchRefused(
                    f"the engine in slot {slot} ({self.sockets[slot]}) does not answer /health; not switching")
            log.info("switch: new requests go to the %s engine (%s); %d in flight stay where they are",
                     slot, self.sockets[slot], in_flight)
            self.current = slot
        if self.failed_over:
            log.info("switch: the failover from the %s engine ends (the manager decides now)", self.failed_over)
            self.failed_over = ""
