"""The root manager distrusts what a model's sockets answer (issue 22, item
13): the other end runs the model's code. A gateway that never answers, or
answers an impossible count, and an engine whose /health is huge, cost the
manager a bounded wait and a bounded read; one model's bad answer never stops
the in-flight refresh of the others."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import World  # noqa: E402

from hostd.gateway import control  # noqa: E402
from hostd.manager import model_bus, probe, service  # noqa: E402
from hostd.manager.probe import Probe  # noqa: E402
from hostd.manager.tasks import pending as kept_tasks  # noqa: E402


def control_server(tmp_path: Path, answer):
    """A control socket for model tiny that answers ANSWER (a dict) or, when None, never."""
    (tmp_path / "tiny").mkdir(mode=0o700, exist_ok=True)

    async def handle(reader, writer):
        await reader.readline()
        if answer is None:
            await asyncio.Event().wait()
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    return asyncio.start_unix_server(handle, path=str(tmp_path / "tiny" / "control.sock"))


def test_a_gateway_that_accepts_and_never_answers_does_not_hold_the_manager(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(probe, "CONTROL_TIMEOUT", 0.2, raising=False)

    async def go():
        server = await control_server(tmp_path, None)
        try:
            status = await asyncio.wait_for(Probe("tiny").gateway_status(), 5)  # bounds the test only
            with pytest.raises(control.ControlError, match="did not answer"):
                await asyncio.wait_for(Probe("tiny").resume("done"), 5)
            return status
        finally:
            server.close()

    assert asyncio.run(go()) is None  # "no gateway answer", as for one that is down


def test_an_impossible_in_flight_count_is_no_status(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))

    async def go():
        server = await control_server(tmp_path, {"ok": True, "state": "serving", "in_flight": -1})
        try:
            return await Probe("tiny").gateway_status()
        finally:
            server.close()

    assert asyncio.run(go()) is None


async def with_engine_socket(tmp_path: Path, method: str, path: str, handler, probe_call):
    """PROBE_CALL() while tiny's engine.sock under TMP_PATH answers METHOD PATH with HANDLER."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "tiny" / "engine.sock")).start()
    try:
        return await probe_call()
    finally:
        await runner.cleanup()


def test_an_engine_health_answer_past_the_cap_is_not_read(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tiny").mkdir(mode=0o700)
    huge = {"engine_config": {}, "padding": "x" * (3 << 20)}  # 3 MiB (seen: 300 MiB took the manager to 940 MiB)

    async def health(request):
        return web.json_response(huge)

    assert asyncio.run(with_engine_socket(tmp_path, "GET", "/health", health, Probe("tiny").engine_health)) is None
    # Refused for its size, and said so (not merely a JSON the cut made invalid).
    assert "answered /health with more than" in caplog.text


def test_a_smoke_error_is_read_to_300_bytes_never_whole(tmp_path, monkeypatch):
    # Issue 33, L4: a 400 MiB error answer took the manager from 41 to 870 MiB.
    # This one never ends: reading it whole never returns.
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tiny").mkdir(mode=0o700)

    async def completions(request):
        response = web.StreamResponse(status=400)
        await response.prepare(request)
        while True:
            await response.write(b"x" * 65536)

    async def smoke():
        with pytest.raises(probe.VerifyFailed) as failed:
            await asyncio.wait_for(Probe("tiny").smoke("tiny"), 30)  # a safety net, not a timing
        return str(failed.value)

    message = asyncio.run(with_engine_socket(tmp_path, "POST", "/v1/completions", completions, smoke))
    assert message.startswith("smoke request answered 400: xxx") and len(message) < 400


def test_one_models_bad_gateway_answer_does_not_stop_the_others_in_flight_counts(tmp_path, monkeypatch):
    world = World(tmp_path)
    (world.root / "models/bad.yaml").write_text((world.root / "models/tiny.yaml").read_text())

    class Gateway:
        def __init__(self, name):
            self.counts = iter([3, 5]) if name == "tiny" else None

        async def gateway_status(self):
            if self.counts is None:
                raise TypeError("an answer the manager cannot use")
            return control.GatewayStatus(state="serving", in_flight=next(self.counts, 5))

    monkeypatch.setattr(model_bus, "Probe", Gateway)
    monkeypatch.setattr(service, "IN_FLIGHT_INTERVAL", 0)

    async def go():
        await world.connect()
        manager = service.Manager(world.bus, world.systemd, world.root, world.records)
        manager.discover()
        await asyncio.gather(*kept_tasks())
        assert {m.state for m in manager.models.values()} == {"serving"}
        watch = asyncio.create_task(manager.watch_in_flight())
        for _ in range(200):
            await asyncio.sleep(0.01)
            if watch.done() or manager.models["tiny"].in_flight == 5:
                break
        alive = not watch.done()
        watch.cancel()
        return alive, manager.models["tiny"].in_flight

    assert asyncio.run(go()) == (True, 5)
