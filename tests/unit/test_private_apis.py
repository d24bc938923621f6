"""What hostd takes from its libraries beyond their public API, one test each,
so that an upgrade which changes it fails here and not on a host.
pyproject.toml bounds each library below the release that could change it
and says why; a new release is admitted by raising the bound once these pass.

- dbus-fast: CallerAwareBus overrides MessageBus._make_method_handler (private)
  to put the sender of the call being handled in authority.CALLER, which
  polkit's check needs: it relies on the handler being made per method at
  export and called as handler(msg, send_reply), and on a coroutine method's
  task being created inside that call (so it inherits the context).
- logging-journald: logs.JournalHandler overrides
  JournaldLogHandler._format_record (private): it relies on the record's
  extra attributes arriving as one ("extra", dict) pair, which it lifts to
  top-level HOSTD_* and MESSAGE_ID fields.
- msgspec: the config loader (config/load.py) and the builtin engine's
  request reader (engine/openai_api.py) read the key path and the kind of a
  problem out of ValidationError's text, which msgspec does not promise.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Annotated

import msgspec
import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method

from hostd import logs
from hostd.config import load
from hostd.engine import openai_api
from hostd.manager import api
from hostd.manager.authority import CALLER, Authority, CallerAwareBus, admin

# ---------------------------------------------------------------- dbus-fast


class Echo(ServiceInterface):
    """Answers who called, as the manager's methods find out."""

    def __init__(self, bus):
        super().__init__("org.hostd1.Test")
        self.authority = Authority(bus)

    @method()
    async def Async(self) -> "s":
        await asyncio.sleep(0)  # past the handler's own return: the task's context must hold it
        return CALLER.get() or ""

    @method()
    def Sync(self) -> "s":
        return CALLER.get() or ""

    @method()
    @admin(api.RELOAD_ACTION)
    async def Guarded(self) -> "s":
        return "allowed"


def test_dbus_fast_method_handler_still_tells_the_manager_its_caller(bus_address):
    async def go():
        service = await CallerAwareBus(bus_address=bus_address).connect()
        service.export("/t", Echo(service))
        client = await MessageBus(bus_address=bus_address).connect()

        async def ask(member: str) -> Message:
            return await client.call(Message(destination=service.unique_name, path="/t",
                                             interface="org.hostd1.Test", member=member))

        for member in ("Async", "Sync"):
            reply = await ask(member)
            assert reply.message_type == MessageType.METHOD_RETURN, reply.body
            assert reply.body == [client.unique_name], f"{member}: the caller was not passed on"
        assert CALLER.get() is None  # set for the call only
        # The polkit check found the caller (root: allowed; anyone else: no
        # polkit on this private bus), never "unknown caller".
        reply = await ask("Guarded")
        if os.geteuid() == 0:
            assert reply.message_type == MessageType.METHOD_RETURN and reply.body == ["allowed"], reply.body
        else:
            assert reply.error_name == api.ACCESS_DENIED and "polkit is not running" in reply.body[0], reply.body
        client.disconnect()
        service.disconnect()

    asyncio.run(go())


# ---------------------------------------------------------------- logging-journald


def journal_fields(datagram: bytes) -> dict[str, str]:
    """systemd's native journal protocol: KEY=VALUE lines, or KEY, a 64-bit
    little-endian length and the value (values with a newline)."""
    fields, at = {}, 0
    while at < len(datagram):
        end = datagram.index(b"\n", at)
        line = datagram[at:end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            at = end + 1
        else:
            key, (size,) = line, struct.unpack("<Q", datagram[end + 1:end + 9])
            value = datagram[end + 9:end + 9 + size]
            at = end + 9 + size + 1
        fields[key.decode()] = value.decode()
    return fields


def test_logging_journald_format_record_still_hands_the_extras_as_one_pair(tmp_path: Path):
    path = tmp_path / "journal.socket"
    journal = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    journal.bind(str(path))
    journal.settimeout(10)
    handler_type = type("TestJournalHandler", (logs.JournalHandler,), {"SOCKET_PATH": str(path)})
    handler = handler_type(identifier="hostd-manager", use_message_id=False)
    handler.addFilter(logs._ModelFields("", "manager"))
    log = logging.getLogger("hostd.test.journal")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)
    try:
        log.info("reload %d of %s done", 3, "tiny",
                 extra={"hostd_model": "tiny", "hostd_operation": "3", "message_id": "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a41"})
        done = journal_fields(journal.recv(65536))
        log.warning("plain line", extra={"hostd_model": "tiny"})
        plain = journal_fields(journal.recv(65536))
    finally:
        log.removeHandler(handler)
        journal.close()
    assert done["MESSAGE"] == "reload 3 of tiny done" and done["SYSLOG_IDENTIFIER"] == "hostd-manager"
    assert (done["HOSTD_MODEL"], done["HOSTD_OPERATION"], done["HOSTD_COMPONENT"]) == ("tiny", "3", "manager")
    assert done["MESSAGE_ID"] == "4a1d9b7e2c5f4e0b8d3a6c9f1e2b7a41"
    assert not [k for k in done if k.startswith(("EXTRA_HOSTD", "EXTRA_MESSAGE_ID"))], sorted(done)
    assert plain["HOSTD_MODEL"] == "tiny" and "MESSAGE_ID" not in plain  # no hashed id per line


# ---------------------------------------------------------------- msgspec


class Engine(msgspec.Struct, forbid_unknown_fields=True):
    max_num_seqs: Annotated[int, msgspec.Meta(ge=1)] = 4

    def __post_init__(self) -> None:
        if self.max_num_seqs == 7:
            raise ValueError("max_num_seqs: 7 is refused here")


class Model(msgspec.Struct, forbid_unknown_fields=True):
    model: str
    engine: Engine = msgspec.field(default_factory=Engine)
    gpus: list[Engine] = []


def problem(data: dict) -> tuple:
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.convert(data, Model)
    return load._error_path(raised.value)


@pytest.mark.parametrize("data, expected", [
    ({"model": "m", "engine": {"max_num_sequences": 1}}, (("engine", "max_num_sequences"), "unknown key", True)),
    ({}, (("model",), "required key is missing", False)),
    ({"model": "m", "engine": {"max_num_seqs": 0}}, (("engine", "max_num_seqs"), "expected `int` >= 1", True)),
    ({"model": "m", "engine": {"max_num_seqs": "x"}},
     (("engine", "max_num_seqs"), "expected `int`, got `str`", True)),
    ({"model": "m", "gpus": [{}, {"max_num_seqs": 0}]}, (("gpus", "1", "max_num_seqs"), "expected `int` >= 1", True)),
    # A __post_init__ refusal ("key: why") reaches us as its own text, at its struct's path.
    ({"model": "m", "engine": {"max_num_seqs": 7}}, (("engine", "max_num_seqs"), "7 is refused here", True)),
])
def test_msgspec_validation_texts_still_give_the_config_loader_key_and_kind(data, expected):
    assert problem(data) == expected


class Request(msgspec.Struct):
    messages: list[str]
    max_tokens: int | None = None


@pytest.mark.parametrize("data, param", [
    ({"messages": [], "max_tokens": "many"}, "max_tokens"),
    ({}, "messages"),
])
def test_msgspec_validation_texts_still_name_the_engine_requests_parameter(data, param):
    with pytest.raises(msgspec.ValidationError) as raised:
        msgspec.convert(data, Request)
    match = openai_api._PATH_PARAM.search(str(raised.value))
    assert match and (match.group(1) or match.group(2)) == param, str(raised.value)


# ---------------------------------------------------------------- the bounds themselves


ROOT = Path(__file__).resolve().parents[2]


def project() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_each_library_whose_private_parts_hostd_uses_is_bounded_and_admits_what_is_installed():
    from importlib.metadata import version

    from packaging.requirements import Requirement

    requirements = {r.name: r for r in map(Requirement, project()["dependencies"])}
    for name in ("dbus-fast", "logging-journald", "msgspec"):
        specifier = requirements[name].specifier
        assert any(spec.operator == "<" for spec in specifier), f"{name} has no upper bound in pyproject.toml"
        assert version(name) in specifier, f"the installed {name} {version(name)} is outside {specifier}"


def test_httpx_is_a_test_dependency_only_and_hostd_never_imports_it():
    import ast

    from packaging.requirements import Requirement

    assert "httpx" not in {Requirement(d).name for d in project()["dependencies"]}
    assert "httpx" in {Requirement(d).name for d in project()["optional-dependencies"]["test"]}
    importers = []
    for path in sorted((ROOT / "hostd").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == "httpx" or n.startswith("httpx.") for n in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == [], f"hostd/ imports httpx, a test-only dependency: {importers}"
