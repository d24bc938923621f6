"""Replacing the gateway's API keys while it runs (issue 22 item 18): the
control verb `keys` is root's alone (the engine and weights units share the
gateway's uid and run upstream code), and `systemctl reload model@NAME`
sends it before the manager's reload."""

from __future__ import annotations

import asyncio
import json
import os
import socket

from hostd import install, sockets
from hostd.gateway import control


def exchange(monkeypatch, peer_uid: int, line: bytes) -> tuple[dict, list]:
    """LINE sent on the control socket by a peer of PEER_UID to a gateway
    running as uid 4242; the answer, and what reached the gateway's handler."""
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    monkeypatch.setattr(sockets, "peer_credentials", lambda conn: (999, peer_uid, peer_uid))
    seen = []

    async def handle(request):
        seen.append(request)
        return control.GatewayStatus(state="serving")

    async def main() -> dict:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        served = asyncio.create_task(control._connection(reader, writer, handle))
        peer_reader, peer_writer = await asyncio.open_unix_connection(sock=theirs)
        peer_writer.write(line)
        await peer_writer.drain()
        answer = await asyncio.wait_for(peer_reader.readline(), 5)
        peer_writer.close()
        await asyncio.wait_for(served, 5)
        return json.loads(answer)

    return asyncio.run(main()), seen


KEYS = json.dumps({"verb": "keys", "source": "/etc/hostd/keys/tiny", "keys": ["sk-1"]}).encode() + b"\n"


def test_keys_from_the_gateways_own_uid_are_refused(monkeypatch):
    answer, seen = exchange(monkeypatch, 4242, KEYS)
    assert answer["ok"] is False and "root" in answer["error"] and seen == []


def test_keys_from_root_reach_the_gateway(monkeypatch):
    answer, seen = exchange(monkeypatch, 0, KEYS)
    assert answer["ok"] is True
    assert seen == [control.Keys(source="/etc/hostd/keys/tiny", keys=["sk-1"])]


def test_the_same_uid_still_has_the_other_verbs(monkeypatch):
    answer, seen = exchange(monkeypatch, 4242, b'{"verb": "status"}\n')
    assert answer["ok"] is True and seen == [control.Status()]


def test_an_empty_key_list_is_refused_before_the_gateway(monkeypatch):
    line = json.dumps({"verb": "keys", "source": "/k", "keys": []}).encode() + b"\n"
    answer, seen = exchange(monkeypatch, 0, line)
    assert answer["ok"] is False and seen == []


def test_systemctl_reload_replaces_the_keys_before_the_managers_reload():
    unit = install.render_units("/usr/bin/python3", "/etc/hostd")["model@.service"]
    reloads = [line for line in unit.splitlines() if line.startswith("ExecReload=")]
    assert reloads == ["ExecReload=+/usr/bin/python3 -m hostd.gateway.keys %i",
                       "ExecReload=+/usr/bin/python3 -m hostd.hostctl reload --from-unit %i"]
