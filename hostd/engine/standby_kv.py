"""The warm standby's KV cache: small while it waits, full while it serves.

One job: swap the standby engine's batching runner between its idle budget
(Limits.kv_cache_bytes_idle: reload.standby_kv_mib, at most the full one) and
its full budget, on the same model object. The idle runner serves its own
warm-up and /health only. A generation request that reaches it waits for
the grow (app.py's _answer calls ``full``): a new runner with the full budget
(KV allocation and batching start, off the event loop; then its warm-up
generation), the idle one stopped and its cache freed, and the request runs
on the new one. After ``idle_s`` seconds with no generation request in
flight (SHRINK_IDLE_S, or the environment's HOSTD_STANDBY_IDLE_S) it goes
back to an idle runner the same way. One swap at a time (``lock``), never
while a request is in flight; a request that arrives during a shrink waits
for it and then grows the cache again. Each swap is one INFO line in the
journal with its phases in seconds.

The new runner is built before the old one stops, so that a failed
allocation leaves the old one serving: for a moment the two caches are
held together (the idle one is the small one). The requests that waited
for a grow run as soon as the new runner is in; the old one is stopped and
its memory returned after that, in the background (torch.cuda.empty_cache,
and a full collection only where a reference cycle still holds the runner:
return_freed_memory), and the next swap waits for it.

Trust: as app.py; nothing here reads a request.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import time
import weakref
from collections.abc import Callable

import torch

from hostd.engine.generate import Runner

SHRINK_IDLE_S = 10.0  # seconds without a generation request before the standby gives its full cache back
IDLE_ENV = "HOSTD_STANDBY_IDLE_S"  # overrides SHRINK_IDLE_S (the tests use about 1 s)

_log = logging.getLogger("hostd.engine")


def idle_seconds() -> float:
    """SHRINK_IDLE_S, or HOSTD_STANDBY_IDLE_S's seconds when it is set to a positive number."""
    value = os.environ.get(IDLE_ENV, "")
    try:
        seconds = float(value) if value else SHRINK_IDLE_S
    except ValueError:
        seconds = -1.0
    if seconds > 0:
        return seconds
    _log.warning("%s=%r is not a positive number of seconds; the standby shrinks after %g s", IDLE_ENV, value,
                 SHRINK_IDLE_S)
    return SHRINK_IDLE_S


def references(runner: Runner) -> list:
    """Weak references to RUNNER and, for a batched one, its KV cache: what
    must be gone for the runner's memory to be free (return_freed_memory).
    The cache too, since the library's objects that hold it may sit in a
    reference cycle of their own, and its own collections no longer run
    (batch.py's _quiet_collections)."""
    refs = [weakref.ref(runner)]
    cache = getattr(runner, "cache", None)
    if cache is not None:
        refs.append(weakref.ref(cache))
    return refs


def return_freed_memory(gone: "list[weakref.ref] | None" = None) -> bool:
    """Hand a stopped runner's memory back: to the host, and on CUDA to the
    driver. GONE, weak references to that runner and its cache
    (references()): when all are dead they were freed when their last
    reference went (batch.py's router holds the runner weakly), so no
    collection is needed; a full one holds the
    interpreter's lock for 0.3-0.8 s with torch and transformers loaded,
    which a request arriving just then (the standby's verification after a
    rebuild, its first token after a grow) would wait for. Otherwise, or
    without GONE, a collection frees what a reference cycle still holds.
    Returns whether it collected (the journal says so: a collection on this
    path is a reference this module meant to drop)."""
    collected = gone is None or any(ref() is not None for ref in gone)
    if collected:
        gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # so that NVML, and the manager's preflight through it, sees the memory returned
    return collected


def join_and_drop(box: list) -> None:
    """Join the runner that BOX holds (blocking: run it in a thread) and let
    go of it. asyncio.to_thread(runner.join) would leave the runner
    referenced by the executor's work item for a moment after the await
    returns (the worker thread drops it after it sets the result), long
    enough for return_freed_memory to find it alive and collect."""
    box.pop().join()


class StandbyKV:
    """ENGINE's (app.py's Engine) runner swap. MAKE_RUNNER(full=...) builds a
    runner on the full or the idle budget (app.py's make_runner; blocking);
    the engine starts on an idle one."""

    def __init__(self, engine, make_runner: Callable[..., Runner], *, full_bytes: int,
                 log: logging.Logger | None = None, idle_s: float | None = None) -> None:
        self.engine, self.make_runner, self.full_bytes = engine, make_runner, full_bytes
        self.log = log or _log
        self.idle_s = idle_seconds() if idle_s is None else idle_s
        self.budget = "idle"
        self.grow_s: dict[str, float] | None = None  # the last grow's phases, once its old runner is freed
        self.lock = asyncio.Lock()
        self._grow: asyncio.Task | None = None  # the grow every waiting request awaits
        self._watch: asyncio.Task | None = None  # while full: the shrink after idle_s
        self._arrived = asyncio.Event()  # a generation request came (the shrink's quiet period restarts)
        self._closed = False
        self._swapping: str | None = None  # the budget a swap under way goes to
        self._retiring: asyncio.Task | None = None  # the last swap's old runner, being stopped and freed

    def facts(self) -> dict:
        """/health's fields of the standby's KV cache (health.py)."""
        return {"kv_budget": self.budget, "kv_cache_bytes_full": self.full_bytes, "grow_s": self.grow_s}

    async def full(self) -> None:
        """Return once the full runner serves: at once when it does, else
        after the grow (one for every request that waits). A request's
        cancellation does not cancel the grow."""
        self._arrived.set()
        if self.budget == "full" and self._swapping is None:
            return
        if self._grow is None or self._grow.done():
            self._grow = asyncio.create_task(self._swap("full"))
        await asyncio.shield(self._grow)

    async def settled(self) -> None:
        """Return once the last swap's old runner is stopped and its memory returned."""
        if self._retiring is not None:
            await self._retiring

    async def close(self) -> None:
        """No swap from now on; one under way finishes first (the engine's shutdown)."""
        self._closed = True
        async with self.lock:
            if self._watch is not None:
                self._watch.cancel()
            await self.settled()

    async def prime(self) -> None:
        """At the engine's start, before it listens: one grow and one shrink.
        What a process pays the first time it holds its full cache (the
        driver mapping that much memory, the attention kernels at the full
        cache's shapes: 0.8-0.9 s of the first grow on the H200, against
        0.14-0.18 s for the grows after it, 2026-12-02) is then paid by the
        start, not by the first request after a failover. Neither swap
        counts as the standby's grow (grow_s)."""
        await self._swap("full", priming=True)
        await self._swap("idle", priming=True)
        await self.settled()

    async def _swap(self, budget: str, priming: bool = False) -> None:
        async with self.lock:
            if self._closed or self.budget == budget or (budget == "idle" and self.engine.in_flight):
                return
            await self.settled()  # never two big caches and a third being built
            self._swapping = budget
            try:
                started = time.monotonic()
                new = await asyncio.to_thread(self.make_runner, full=budget == "full")
                built = time.monotonic()
                try:
                    await new.warm_up()
                except BaseException:
                    new.cancel_all()
                    await asyncio.to_thread(new.join)
                    raise
                warm = time.monotonic()
                old = self.engine.swap_runner(new)
                self.budget = budget
            finally:
                self._swapping = None
            phases = {"kv_alloc_and_batching_start": round(built - started, 4), "warm_up": round(warm - built, 4),
                      "swap": round(time.monotonic() - started, 4)}
            if budget == "full" and not priming:
                self._watch = asyncio.create_task(self._shrink_when_idle())
            self._retiring = asyncio.create_task(self._retire(old, new.kv_cache_bytes, budget, phases, started,
                                                              priming))
            self.engine.changed()

    async def _retire(self, old: Runner, kv_bytes: int, budget: str, phases: dict, started: float,
                      priming: bool = False) -> None:
        """The swapped-out runner stopped and its memory returned; then the swap's journal line."""
        old.cancel_all()  # nothing runs on it: requests wait in full(), and a shrink needs none in flight
        old.on_change = None
        gone, box = references(old), [old]
        del old
        await asyncio.to_thread(join_and_drop, box)
        for _ in range(2):  # its last outputs' deliveries, queued on this loop, run (they hold it)
            await asyncio.sleep(0)
        collected = await asyncio.to_thread(return_freed_memory, gone)
        phases["free_old"] = round(time.monotonic() - started - phases["swap"], 4)
        if budget == "full" and not priming:
            self.grow_s = phases  # /health's, once complete
        self.log.info("standby KV cache %s to %d bytes (%s budget%s) in %.3f s (phases %s; the old runner %s)",
                      "grown" if budget == "full" else "shrunk", kv_bytes, budget,
                      ", priming it at start" if priming else "", phases["swap"], json.dumps(phases),
                      "was still referenced: a collection ran" if collected else "went with its last reference")

    async def _shrink_when_idle(self) -> None:
        """While full: back to the idle runner once no generation request was in flight for idle_s."""
        while self.budget == "full" and not self._closed:
            await self.engine.idle.wait()
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), self.idle_s)
                continue  # a request came: wait for it to end, then for a quiet idle_s again
            except TimeoutError:
                pass
            try:
                await self._swap("idle")  # nothing, if a request is in flight by now
            except Exception:
                self.log.exception("the standby could not go back to its idle KV budget; it keeps the full one")
                return
