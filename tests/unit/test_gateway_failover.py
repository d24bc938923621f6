"""The gateway's two rooms of a failover (issue 34): the watch that learns an
engine died from a connection it holds (hostd/gateway/watch.py), and which
requests an engine that died may have run are sent once more (retry.py).
In-process, on Unix sockets in a temporary directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hostd.gateway import retry, watch
from hostd.gateway.watch import EngineWatch


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.changed = asyncio.Event()

    async def lost(self, slot: str) -> None:
        self.events.append(("lost", slot))
        self.changed.set()

    async def up(self, slot: str) -> None:
        self.events.append(("up", slot))
        self.changed.set()

    async def until(self, event: tuple[str, str], times: int = 1, timeout: float = 5) -> None:
        async def seen():
            while self.events.count(event) < times:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(seen(), timeout)


class Engine:
    """A socket that accepts and holds connections (CLOSE_IDLE: ends each at
    once, as an engine closing idle ones); stop() is a kill -9: the listener
    and every connection it accepted end, the socket file stays."""

    def __init__(self, close_idle: bool = False) -> None:
        self.close_idle = close_idle
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self, path: Path) -> "Engine":
        self.server = await asyncio.start_unix_server(self._handle, path=str(path))
        return self

    async def _handle(self, reader, writer) -> None:
        if self.close_idle:
            writer.close()
            return
        self.writers.append(writer)
        await reader.read()
        writer.close()

    async def stop(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()
        await self.server.wait_closed()


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, 30))


def test_an_engine_that_dies_is_lost_at_once_with_no_request_and_up_again_once_it_listens(tmp_path: Path,
                                                                                          monkeypatch):
    monkeypatch.setattr(watch, "RETRY", 0.05)

    async def body():
        path = tmp_path / "engine.sock"
        server = await Engine().start(path)
        seen = Recorder()
        watcher = EngineWatch({"main": path}, on_lost=seen.lost, on_up=seen.up)
        watcher.start()
        try:
            await seen.until(("up", "main"))
            await server.stop()  # the socket file stays: connect() is refused
            await seen.until(("lost", "main"))
            path.unlink()
            server = await Engine().start(path)  # restarted
            await seen.until(("up", "main"), times=2)
            assert seen.events == [("up", "main"), ("lost", "main"), ("up", "main")]
        finally:
            await watcher.stop()
            await server.stop()

    run(body())


def test_an_engine_that_closes_an_idle_connection_is_not_lost(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(watch, "QUICK", 0.05)

    async def body():
        path = tmp_path / "engine.sock"
        server = await Engine(close_idle=True).start(path)
        seen = Recorder()
        watcher = EngineWatch({"main": path}, on_lost=seen.lost, on_up=seen.up)
        watcher.start()
        try:
            await asyncio.sleep(0.5)  # some ten closed connections, each connected again
            assert seen.events == [("up", "main")]
            assert watcher.held["main"]
        finally:
            await watcher.stop()
            await server.stop()

    run(body())


def test_a_slot_with_no_engine_yet_is_not_lost_and_a_failing_hook_does_not_end_the_watch(tmp_path: Path,
                                                                                        monkeypatch):
    monkeypatch.setattr(watch, "RETRY", 0.05)

    async def body():
        path = tmp_path / "engine-standby.sock"
        calls = []

        async def failing(slot: str) -> None:
            calls.append(slot)
            raise RuntimeError("a hook's bug")

        seen = Recorder()
        watcher = EngineWatch({"standby": path}, on_lost=seen.lost, on_up=failing)
        watcher.start()
        try:
            await asyncio.sleep(0.3)
            assert seen.events == [] and not watcher.held.get("standby")  # never up: nothing lost
            server = await Engine().start(path)
            await asyncio.wait_for(_until(lambda: calls == ["standby"]), 5)
            await server.stop()
            await seen.until(("lost", "standby"))  # the watch outlived its hook's failure
        finally:
            await watcher.stop()

    run(body())


async def _until(probe) -> None:
    while not probe():
        await asyncio.sleep(0.01)


def test_the_watch_sends_nothing_on_its_connection(tmp_path: Path):
    async def body():
        path = tmp_path / "engine.sock"
        received = []
        accepted = asyncio.Event()

        async def handle(reader, writer):
            accepted.set()
            received.append(await reader.read())
            writer.close()

        server = await asyncio.start_unix_server(handle, path=str(path))
        seen = Recorder()
        watcher = EngineWatch({"main": path}, on_lost=seen.lost, on_up=seen.up)
        watcher.start()
        await asyncio.wait_for(accepted.wait(), 5)
        await watcher.stop()
        await _until(lambda: received)
        assert received == [b""]
        server.close()
        await server.wait_closed()

    run(body())


# ------------------------------------------------------------ retry.py

def chat(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


@pytest.mark.parametrize("fields", [{}, {"max_tokens": 3, "stream": True}, {"response_format": {"type": "text"}}])
def test_generation_without_tools_may_run_twice(fields):
    assert retry.retried("POST", "/v1/chat/completions", chat(**fields))
    assert retry.retried("POST", "/v1/completions", json.dumps({"prompt": "x", **fields}).encode())


@pytest.mark.parametrize("key", retry.ACTIONS)
@pytest.mark.parametrize("value", [[], None, "auto", [{"type": "function", "function": {"name": "f"}}]])
def test_a_request_that_names_a_tool_field_is_never_run_twice(key, value):
    assert not retry.retried("POST", "/v1/chat/completions", chat(**{key: value}))
    assert not retry.retried("POST", "/v1/completions", json.dumps({"prompt": "x", key: value}).encode())


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/embeddings", b'{"input": "x"}'),  # not in RETRIED: no evidence it is harmless twice
    ("GET", "/v1/completions", b""),
    ("POST", "/v1/completions", b"not json"),
    ("POST", "/v1/completions", b'["a list"]'),
    ("POST", "/v1/completions", b""),
])
def test_anything_else_is_not_run_twice(method, path, body):
    assert not retry.retried(method, path, body)


def test_a_tool_field_nested_deeper_does_not_count():
    body = chat(metadata={"tools": ["x"]})
    assert retry.retried("POST", "/v1/chat/completions", body)


def test_no_failover_to_a_standby_that_does_not_answer_and_one_to_a_standby_that_does():
    """slots.Slots.fail_over (issue 53): new requests move to the standby
    only when it answers /health; a dead standby keeps them on the slot whose
    death the gateway then reports (503 with Retry-After), never into the
    void. Never while held (a drain) nor without a standby."""
    from hostd.gateway.slots import Slots

    answering: dict[str, bool] = {"main": False, "standby": False}
    failovers: list[int] = []

    async def answers(slot: str) -> bool:
        return answering[slot]

    sockets = {"main": Path("/run/x/engine.sock"), "standby": Path("/run/x/engine-standby.sock")}
    slots = Slots(sockets, answers, on_failover=lambda: failovers.append(1))
    assert asyncio.run(slots.fail_over("main", held=False)) is False
    assert (slots.current, slots.failed_over, failovers) == ("main", "", [])
    answering["standby"] = True
    assert asyncio.run(slots.fail_over("main", held=True)) is False  # a drain: the manager restarts engines
    assert asyncio.run(slots.fail_over("main", held=False)) is True
    assert (slots.current, slots.failed_over, failovers) == ("standby", "main", [1])
    alone = Slots({"main": sockets["main"]}, answers)
    assert asyncio.run(alone.fail_over("main", held=False)) is False and alone.current == "main"
