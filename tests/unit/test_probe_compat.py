"""The manager against a gateway started by an older hostd (models keep
running across an upgrade of hostd.service): a gateway of control protocol 1
refuses the `outcome` field of `switch`, so the manager asks which protocol
the gateway speaks before it sends one, and an overlap reload still hands
back; below protocol 6 an in-place reload's mark is not sent (a metric
only: the reload goes on). The answers are decoded as the control socket's
types."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from hostd.gateway import control
from hostd.engine.health import EngineHealth
from hostd.manager.probe import Probe


def switch_against(tmp_path: Path, protocol: int | None, switch_refusal: str = "",
                   ask=lambda probe: probe.switch("main", "done")) -> tuple[object, list[dict]]:
    """ASK (Probe.switch("main", "done")) against a control socket of PROTOCOL
    (None: its answers do not say, as protocol 1 gateways' did not), which
    refuses an `outcome` with a switch below PROTOCOL 2, a mark below 6, and
    every switch with SWITCH_REFUSAL when set."""
    (tmp_path / "tiny").mkdir(mode=0o700)
    seen: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = json.loads(await reader.readline())
        seen.append(request)
        said = {} if protocol is None else {"protocol": protocol}
        if request["verb"] == "switch" and switch_refusal:
            answer = {"ok": False, "error": switch_refusal, **said}
        elif request["verb"] == "switch" and "outcome" in request and (protocol or 1) < 2:
            answer = {"ok": False, "error": "Object contains unknown field `outcome`"}
        elif request["verb"] == "mark" and (protocol or 1) < 6:
            answer = {"ok": False, "error": "Invalid value 'mark' - at `$.verb`", **said}
        else:
            answer = {"ok": True, "state": "serving", "in_flight": 0, "slot": request.get("slot", "main"), **said}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_unix_server(handle, path=str(tmp_path / "tiny" / "control.sock"))
        try:
            return await ask(Probe("tiny"))
        except control.ControlError as exc:
            return exc
        finally:
            server.close()

    return asyncio.run(scenario()), seen


def test_a_switch_back_to_a_protocol_1_gateway_goes_without_the_outcome(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, protocol=None)
    assert isinstance(answer, control.GatewayStatus) and (answer.slot, answer.protocol) == ("main", 1)
    assert seen == [{"verb": "status"}, {"verb": "switch", "slot": "main"}]  # asked, then never refused


def test_a_gateway_of_this_protocol_gets_the_outcome(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, protocol=control.PROTOCOL)
    assert isinstance(answer, control.GatewayStatus) and answer.slot == "main"
    assert seen == [{"verb": "status"}, {"verb": "switch", "slot": "main", "outcome": "done"}]


def test_an_in_place_reload_marks_a_gateway_of_protocol_6_and_skips_an_older_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, protocol=control.PROTOCOL, ask=lambda probe: probe.mark("done"))
    assert answer is None and seen == [{"verb": "status"}, {"verb": "mark", "outcome": "done"}]
    (tmp_path / "old").mkdir()
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path / "old"))
    answer, seen = switch_against(tmp_path / "old", protocol=5, ask=lambda probe: probe.mark())
    assert answer is None and seen == [{"verb": "status"}]  # never sent a verb it would refuse


def test_a_mark_the_gateway_does_not_answer_never_fails_the_reload(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))  # no control socket at all
    assert asyncio.run(Probe("tiny").mark()) is None


def test_any_refusal_of_a_switch_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, protocol=control.PROTOCOL,
                                  switch_refusal="the engine in slot main does not answer /health; not switching")
    assert isinstance(answer, control.ControlError) and "does not answer /health" in str(answer)
    assert [r["verb"] for r in seen] == ["status", "switch"]  # not retried


def test_answers_decode_as_the_answer_type_of_their_request(tmp_path):
    line = b'{"ok": true, "protocol": 2, "drained": false, "remaining": 2, "state": "draining", "later": 1}'
    answer = control._answer_of(tmp_path, control.Drain(timeout=5), line)
    assert answer == control.Drained(drained=False, remaining=2, state="draining", protocol=2)
    try:
        control._answer_of(tmp_path, control.Drain(timeout=5), b'{"ok": true, "state": "paused"}')
    except control.ControlError as exc:
        assert "not an answer to drain" in str(exc) and "drained" in str(exc)
    else:
        raise AssertionError("an answer without `drained` decoded as Drained")


def test_settle_is_not_sent_to_a_gateway_older_than_protocol_3(tmp_path, monkeypatch):
    """A protocol 2 gateway has no settle verb: the overlap reload does not
    wait through it (the old engine's shutdown_timeout applies, as before)."""
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "tiny").mkdir(mode=0o700)
    seen: list[dict] = []

    async def handle(reader, writer):
        request = json.loads(await reader.readline())
        seen.append(request)
        writer.write(json.dumps({"ok": True, "protocol": 2, "state": "serving", "slot": "next"}).encode() + b"\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_unix_server(handle, path=str(tmp_path / "tiny" / "control.sock"))
        try:
            return await Probe("tiny").settle("main", 30)
        finally:
            server.close()

    assert asyncio.run(scenario()) is None
    assert seen == [{"verb": "status"}]


def test_verify_refuses_an_engine_on_another_weight_daemon(tmp_path):
    """The real Probe.verify_engine (the fakes of reload_fakes.py apply the
    same probe.weights_problem): health and the smoke request pass, but the
    daemon answering now, or the one the engine reports, is not the one from
    before the reload."""
    import msgspec
    import pytest

    from hostd import config
    from hostd.manager.probe import VerifyFailed

    (tmp_path / "models").mkdir()
    (tmp_path / "models/tiny.yaml").write_text("backend: builtin\nmodel: /m\ndevice: cpu\n")
    cfg = config.load_model("tiny", tmp_path).config
    probe = Probe("tiny")
    engine = msgspec.to_builtins(cfg.engine)
    daemon = {"now": (7, 8), "engine": (7, 8)}

    async def engine_health(slot="main"):
        pid, inode = daemon["engine"]
        return EngineHealth(engine_config=engine, weights_pid=pid, weights_socket_inode=inode)

    async def smoke(served, slot="main"):
        return None

    async def weights_identity(slot="main"):
        return daemon["now"]

    probe.engine_health, probe.smoke, probe.weights_identity = engine_health, smoke, weights_identity
    asyncio.run(probe.verify_engine(cfg, (7, 8)))  # the same daemon: verified
    for now, saw in [((1007, 1008), (1007, 1008)), ((7, 8), (9, 9))]:
        daemon.update(now=now, engine=saw)
        with pytest.raises(VerifyFailed, match="the weight daemon changed"):
            asyncio.run(probe.verify_engine(cfg, (7, 8)))
