"""Rules of the front door against hostile clients (issue 22) that need no
process: who counts as one client, and how a client's protocol error is
logged by the builtin engine. The gateway's side runs for real in
tests/integration/test_gateway_hostile_clients.py."""

from __future__ import annotations

import asyncio
import json
import os
import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.test_utils import make_mocked_request

from hostd import logs
from hostd.engine.app import ENGINE, _errors
from hostd.gateway import keys, limits


def transport(peer) -> mock.Mock:
    return mock.Mock(get_extra_info=lambda key: peer if key == "peername" else None)


def test_one_client_is_an_ipv4_address_or_an_ipv6_64():
    assert limits.client_of(transport(("192.0.2.7", 4242))) == "192.0.2.7"
    assert limits.client_of(transport(("2001:db8:1:2:aaaa::1", 4242, 0, 0))) == "2001:db8:1:2::/64"
    assert limits.client_of(transport(("2001:db8:1:2:ffff::9", 1, 0, 0))) == "2001:db8:1:2::/64"  # same host
    assert limits.client_of(transport(("::ffff:192.0.2.7", 4242, 0, 0))) == "192.0.2.7"


def test_one_client_on_a_unix_socket_is_its_peers_uid():
    left, right = socket.socketpair()
    with left, right:
        unix = mock.Mock(get_extra_info=lambda key: {"peername": "", "socket": left}.get(key))
        assert limits.client_of(unix) == f"uid {os.getuid()}"


def test_an_authorization_header_that_is_not_utf8_matches_no_key_and_raises_nothing():
    # aiohttp hands header bytes that are not UTF-8 over as surrogates.
    header = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")
    assert keys.authorized([b"sk-one"], header) is False


def test_a_body_that_does_not_decode_is_400_in_the_engine_with_one_debug_line(caplog):
    app = web.Application()
    app[ENGINE] = SimpleNamespace(log=logging.getLogger("hostd.engine.test"))

    async def handler(request):
        raise ContentEncodingError("Can not decode content-encoding: gzip")

    async def call():
        return await _errors(make_mocked_request("POST", "/v1/completions", app=app), handler)

    with caplog.at_level(logging.DEBUG, logger="hostd.engine.test"):
        response = asyncio.run(call())
    assert response.status == 400
    assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.DEBUG, None)]
    assert "client protocol error" in caplog.records[0].getMessage()


def test_aiohttps_server_logs_a_clients_protocol_error_as_one_debug_line_and_a_bug_with_its_traceback(caplog):
    log = logs.protocol_logger(logging.getLogger("hostd.gateway.test"))
    with caplog.at_level(logging.DEBUG, logger="hostd.gateway.test"):
        log.exception("Error handling request from %s", "192.0.2.7",
                      exc_info=ContentEncodingError("bad\nTraceback (most recent call last):\n  planted"))
        try:
            raise RuntimeError("a bug")
        except RuntimeError as bug:
            log.exception("Error handling request from %s", "192.0.2.7", exc_info=bug)
    protocol, bug = caplog.records
    assert protocol.levelno == logging.DEBUG and protocol.exc_info is None
    assert "\n" not in protocol.getMessage()  # a client's text cannot start a line of its own
    assert bug.levelno == logging.ERROR and bug.exc_info is not None


def test_the_gateway_unit_bounds_the_gateways_memory():
    unit = (Path(__file__).resolve().parents[2] / "units" / "model@.service").read_text()
    assert "\nMemoryMax=1G\n" in unit


def test_sse_events_escape_the_characters_that_splitlines_takes_for_line_ends():
    # Issue 33 (info): raw U+2028 in a data line cut the JSON for clients
    # that split the stream with str.splitlines.
    from hostd.engine.openai_api import sse_event

    text = "a\u2028b\u2029c\x85d\u00e9\n"
    event = sse_event({"delta": {"content": text}})
    line, rest = event.split(b"\n", 1)
    assert rest == b"\n" and len(line.decode().splitlines()) == 1
    assert b"\\u2028" in line and b"\\u2029" in line and b"\\u0085" in line
    assert json.loads(line.removeprefix(b"data: "))["delta"]["content"] == text
