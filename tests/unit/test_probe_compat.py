"""The manager against a gateway started by an older hostd (models keep
running across an upgrade of hostd.service): its control socket refuses the
`outcome` field of `switch`, and an overlap reload must still hand back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from hostd.gateway import control
from hostd.manager.probe import Probe


def switch_against(tmp_path: Path, refuse_outcome_with: str) -> tuple[object, list[dict]]:
    """Probe.switch("main", "done") against a control socket that refuses a
    switch with an outcome (answering REFUSE_OUTCOME_WITH) and takes one without."""
    (tmp_path / "tiny").mkdir(mode=0o700)
    seen: list[dict] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = json.loads(await reader.readline())
        seen.append(request)
        if "outcome" in request:
            answer = {"ok": False, "error": refuse_outcome_with}
        else:
            answer = {"ok": True, "state": "serving", "slot": request["slot"]}
        writer.write(json.dumps(answer).encode() + b"\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_unix_server(handle, path=str(tmp_path / "tiny" / "control.sock"))
        try:
            return await Probe("tiny").switch("main", "done")
        except control.ControlError as exc:
            return exc
        finally:
            server.close()

    return asyncio.run(scenario()), seen


def test_a_switch_back_to_an_old_gateway_is_retried_without_the_outcome(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, "Object contains unknown field `outcome`")
    assert answer == {"ok": True, "state": "serving", "slot": "main"}
    assert [r.get("outcome") for r in seen] == ["done", None]  # refused, then switched without it


def test_any_other_refusal_of_a_switch_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HOSTD_RUNTIME_DIR", str(tmp_path))
    answer, seen = switch_against(tmp_path, "the engine in slot main does not answer /health; not switching")
    assert isinstance(answer, control.ControlError) and "does not answer /health" in str(answer)
    assert len(seen) == 1  # not retried
