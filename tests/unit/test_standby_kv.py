"""The warm standby's runner swap (hostd/engine/standby_kv.py) on fake runners:
a request grows the cache once however many wait, the idle runner is stopped,
a quiet standby shrinks back, and never while a request is in flight."""

from __future__ import annotations

import asyncio
import logging

from hostd.engine.generate import RunnerStats
from hostd.engine.standby_kv import IDLE_ENV, SHRINK_IDLE_S, StandbyKV, idle_seconds

IDLE, FULL = 1 << 20, 64 << 20


class FakeRunner:
    def __init__(self, full: bool) -> None:
        self.kv_cache_bytes = FULL if full else IDLE
        self.stats, self.on_change = RunnerStats(), None
        self.warmed = self.cancelled = self.joined = False

    async def warm_up(self) -> None:
        await asyncio.sleep(0.05)  # long enough for other requests to arrive meanwhile
        self.warmed = True

    def cancel_all(self) -> None:
        self.cancelled = True

    def join(self) -> None:
        self.joined = True


class FakeEngine:
    def __init__(self) -> None:
        self.runner = FakeRunner(full=False)
        self.in_flight, self.idle = 0, asyncio.Event()
        self.idle.set()

    def swap_runner(self, new):
        old, self.runner = self.runner, new
        return old

    def changed(self) -> None:
        pass

    def begin(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self.idle.set()


def standby(idle_s: float = 0.2) -> tuple[FakeEngine, StandbyKV, list[FakeRunner]]:
    engine, made = FakeEngine(), []

    def make(*, full: bool) -> FakeRunner:
        made.append(FakeRunner(full))
        return made[-1]

    return engine, StandbyKV(engine, make, full_bytes=FULL, log=logging.getLogger("test"), idle_s=idle_s), made


def test_requests_waiting_for_an_idle_standby_share_one_grow_and_the_idle_runner_is_stopped(caplog):
    async def scenario():
        engine, kv, made = standby(idle_s=60)
        idle_runner = engine.runner
        assert kv.facts() == {"kv_budget": "idle", "kv_cache_bytes_full": FULL, "grow_s": None}
        for _ in range(3):
            engine.begin()
        await asyncio.gather(kv.full(), kv.full(), kv.full())
        assert len(made) == 1 and engine.runner is made[0] and made[0].warmed
        await kv.settled()  # the idle runner is stopped after the waiting requests went on
        assert idle_runner.cancelled and idle_runner.joined
        facts = kv.facts()
        assert facts["kv_budget"] == "full" and set(facts["grow_s"]) == {"kv_alloc_and_batching_start", "warm_up", "swap",
                                                                         "free_old"}
        await kv.full()  # full already: nothing is built
        assert len(made) == 1
        await kv.close()

    with caplog.at_level(logging.INFO, logger="test"):
        asyncio.run(scenario())
    assert any("standby KV cache grown to 67108864 bytes" in r.message and "warm_up" in r.message
               for r in caplog.records)


def test_a_quiet_standby_shrinks_back_but_never_while_a_request_is_in_flight():
    async def scenario():
        engine, kv, made = standby(idle_s=0.2)
        engine.begin()
        await kv.full()
        await asyncio.sleep(0.5)  # a long request: still full
        assert kv.budget == "full" and len(made) == 1
        engine.end()
        await asyncio.sleep(0.1)
        assert kv.budget == "full"  # not yet idle_s since it ended
        await asyncio.sleep(0.4)
        assert kv.budget == "idle" and engine.runner is made[1] and made[1].kv_cache_bytes == IDLE
        await kv.settled()
        assert made[0].cancelled and made[0].joined
        engine.begin()  # the next request grows it again
        await kv.full()
        assert kv.budget == "full" and engine.runner is made[2]
        engine.end()
        await kv.close()

    asyncio.run(scenario())


def test_each_of_the_shrinks_two_guards_of_a_request_in_flight_holds_alone():
    """Issue 53: the shrink never runs while a request is in flight, by two
    guards that each hide the other's absence: the watch waits for the
    engine to be idle before its quiet period (it asks for no shrink while a
    request runs), and a shrink asked for while one is in flight does
    nothing."""
    async def scenario():
        engine, kv, made = standby(idle_s=0.05)
        engine.begin()
        await kv.full()
        asked: list[str] = []
        real = kv._swap

        async def spy(budget, priming=False):
            asked.append(budget)
            return await real(budget, priming)
        kv._swap = spy
        await asyncio.sleep(0.3)  # six quiet periods, the request still running
        assert asked == []  # the watch waited for idle: it asked for nothing
        await real("idle")  # asked anyway, a request in flight: nothing happens
        assert kv.budget == "full" and len(made) == 1 and engine.runner is made[0]
        engine.end()
        await kv.close()

    asyncio.run(scenario())


def test_a_request_arriving_during_a_shrink_waits_for_it_and_grows_again():
    async def scenario():
        engine, kv, made = standby(idle_s=0.1)
        engine.begin()
        await kv.full()
        engine.end()
        while not kv.lock.locked():  # the shrink has started (its idle runner warms up)
            await asyncio.sleep(0.01)
        engine.begin()
        await kv.full()
        assert kv.budget == "full" and [r.kv_cache_bytes for r in made] == [FULL, IDLE, FULL]
        assert engine.runner is made[2]
        engine.end()
        await kv.close()

    asyncio.run(scenario())


def test_a_failed_grow_leaves_the_idle_runner_serving_and_the_next_request_tries_again():
    async def scenario():
        engine, kv, made = standby()
        idle_runner, calls = engine.runner, []

        def make(*, full: bool):
            calls.append(full)
            if len(calls) == 1:
                raise RuntimeError("CUDA out of memory")
            return FakeRunner(full)

        kv.make_runner = make
        engine.begin()
        try:
            await kv.full()
        except RuntimeError:
            pass
        else:
            raise AssertionError("the grow's failure reaches the request")
        assert engine.runner is idle_runner and not idle_runner.cancelled and kv.budget == "idle"
        await kv.full()
        assert kv.budget == "full" and calls == [True, True]
        engine.end()
        await kv.close()

    asyncio.run(scenario())


def test_the_shrink_delay_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(IDLE_ENV, raising=False)
    assert idle_seconds() == SHRINK_IDLE_S == 10
    monkeypatch.setenv(IDLE_ENV, "1.5")
    assert idle_seconds() == 1.5
    monkeypatch.setenv(IDLE_ENV, "soon")
    assert idle_seconds() == SHRINK_IDLE_S


def test_priming_grows_and_shrinks_once_and_counts_as_no_grow(caplog):
    # What a process pays for its first full cache is paid at the start (issue 34).
    async def scenario():
        engine, kv, made = standby(idle_s=0.1)
        await kv.prime()
        assert [runner.kv_cache_bytes for runner in made] == [FULL, IDLE] and engine.runner is made[1]
        assert kv.facts() == {"kv_budget": "idle", "kv_cache_bytes_full": FULL, "grow_s": None}
        assert made[0].cancelled and made[0].joined
        await asyncio.sleep(0.3)  # no shrink watch was left behind by the priming grow
        assert len(made) == 2

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    assert sum("priming it at start" in r.getMessage() for r in caplog.records) == 2
