"""The gateway's admission state: one object, one lock-free event loop.

One job: decide, for each new request, admit / queue / reject, and count what
is in flight so a drain knows when it is done. States:

    starting     engine not yet seen healthy            -> 503
    serving      engine healthy, requests admitted
    draining     a drain is running: nothing new admitted; in-flight finish
    paused       drained; the engine may be restarted   -> 503
    engine-down  the engine stopped answering            -> 503

Transitions: the health monitor moves starting/engine-down <-> serving; the
control socket's drain moves serving -> draining -> paused (or stays draining
when the deadline passes, with the count of what still runs); resume leaves
draining/paused for serving (engine healthy) or engine-down.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from hostd.gateway.control import Drained, GatewayStatus, Resumed, Settled


class State(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    PAUSED = "paused"
    ENGINE_DOWN = "engine-down"


HELD = (State.DRAINING, State.PAUSED)  # set by the control socket, not the monitor

# Why a request was not admitted (admit()'s refusal: a state, or the queue's
# two) -> what its 503 says, {model} and {retry} filled in (the Retry-After
# seconds). Drained and paused read alike: to a client both are a reload.
REFUSALS = {
    "draining": "model {model} is reloading; retry after {retry} s",
    "paused": "model {model} is reloading; retry after {retry} s",
    "starting": "model {model} is starting; retry after {retry} s",
    "engine-down": "model {model}'s engine is not running; retry after {retry} s",
    "queue-full": "model {model} has too many waiting requests; retry after {retry} s",
    "queue-timeout": "model {model} did not become available in time; retry after {retry} s",
}


def refusal_message(reason: str, model: str, retry: int) -> str:
    """The 503's message for a request refused for REASON (REFUSALS)."""
    return REFUSALS.get(reason, "model {model} is unavailable ({reason})").format(model=model, retry=retry,
                                                                                 reason=reason)


@dataclass
class Counters:
    admitted: int = 0
    completed: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    drains: int = 0
    proxied_bytes: int = 0


class Admission:
    def __init__(self, mode: str, queue_timeout: float, queue_max: int):
        self.state = State.STARTING
        self.mode = mode
        self.queue_timeout = queue_timeout
        self.queue_max = queue_max
        self.in_flight = 0
        self.on_slot: dict[str, int] = {}  # in flight per engine slot (the gateway's switch)
        self.queued = 0
        self.counters = Counters()
        self.changed_at = time.time()
        self._changed = asyncio.Condition()
        self.on_change: Optional[Callable[[State, State], None]] = None  # (old, new), for metrics

    async def _set(self, state: State) -> None:
        async with self._changed:
            if state != self.state:
                old, self.state = self.state, state
                self.changed_at = time.time()
                if self.on_change is not None:
                    self.on_change(old, state)
            self._changed.notify_all()

    # ------------------------------------------------------------ admission

    async def admit(self) -> str | None:
        """None when admitted (caller must call done()), else the refusal reason."""
        if self.state != State.SERVING and self.mode == "queue":
            if self.queued >= self.queue_max:
                return self._reject("queue-full")
            self.queued += 1
            try:
                async with self._changed:
                    await asyncio.wait_for(
                        self._changed.wait_for(lambda: self.state == State.SERVING),
                        self.queue_timeout,
                    )
            except asyncio.TimeoutError:
                return self._reject("queue-timeout")
            finally:
                self.queued -= 1
        if self.state != State.SERVING:
            return self._reject(self.state.value)
        self.in_flight += 1
        self.counters.admitted += 1
        return None

    def _reject(self, reason: str) -> str:
        self.counters.rejected[reason] = self.counters.rejected.get(reason, 0) + 1
        return reason

    def sent(self, slot: str) -> None:
        """An admitted request goes to the engine in SLOT."""
        self.on_slot[slot] = self.on_slot.get(slot, 0) + 1

    def moved(self, old: str, new: str) -> None:
        """An admitted request that OLD's engine never took goes to NEW's (a failover)."""
        self.on_slot[old] -= 1
        self.sent(new)

    async def done(self, slot: Optional[str] = None) -> None:
        if slot is not None:
            self.on_slot[slot] -= 1
        self.in_flight -= 1
        self.counters.completed += 1
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------ monitor

    async def engine_healthy(self, healthy: bool) -> None:
        if self.state in HELD:
            return
        if healthy and self.state != State.SERVING:
            await self._set(State.SERVING)
        elif not healthy and self.state == State.SERVING:
            await self._set(State.ENGINE_DOWN)

    async def engine_lost(self) -> None:
        """A proxied request found the engine gone: stop admitting at once."""
        if self.state == State.SERVING:
            await self._set(State.ENGINE_DOWN)

    # ------------------------------------------------------------ control

    async def drain(self, timeout: float) -> Drained:
        """Stop admitting; wait until nothing is in flight or TIMEOUT passes."""
        self.counters.drains += 1
        await self._set(State.DRAINING)
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.in_flight == 0), timeout)
        except asyncio.TimeoutError:
            return Drained(drained=False, remaining=self.in_flight, state=self.state.value)
        if self.state == State.DRAINING:
            await self._set(State.PAUSED)
        return Drained(drained=True, remaining=0, state=self.state.value)

    async def settle(self, slot: str, timeout: float) -> Settled:
        """Wait until nothing sent to SLOT runs, or TIMEOUT passes; admits as before."""
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(lambda: not self.on_slot.get(slot)), timeout)
        except asyncio.TimeoutError:
            pass
        remaining = self.on_slot.get(slot, 0)
        return Settled(settled=remaining == 0, remaining=remaining)

    async def resume(self, engine_healthy: bool) -> Resumed:
        await self._set(State.SERVING if engine_healthy else State.ENGINE_DOWN)
        return Resumed(state=self.state.value)

    def snapshot(self, slot: str, failed_over: str = "") -> GatewayStatus:
        """The counters, as the control socket's status answers them; SLOT is
        where new requests go (the gateway's, not the admission's)."""
        return GatewayStatus(
            state=self.state.value,
            in_flight=self.in_flight,
            queued=self.queued,
            admitted=self.counters.admitted,
            completed=self.counters.completed,
            rejected=dict(self.counters.rejected),
            drains=self.counters.drains,
            proxied_bytes=self.counters.proxied_bytes,
            since=self.changed_at,
            slot=slot,
            failed_over=failed_over,
        )
