"""The main engine's start from the pre-imported spare (`spare: true`).

One job: before `hostd engine NAME` imports anything heavy, get a process
with the imports done from model-engine-spare@NAME (spare.py), make it this
unit's main process and step aside. Each step that fails leaves a normal
start: this process imports and serves itself, the reason in the journal.

1. Connect to engine-spare.sock (the spare's uid must be ours) and send our
   argv and start clock; the spare forks the engine's process.
2. Read its pid, uid, environment and code stamp. Refuse a process of
   another uid, one whose environment, resource limits or nice level
   differ from ours apart from systemd's per-process variables (an
   Environment=, Limit*= or Nice= set on one unit and not the other: the
   forked process keeps the spare's), and one that runs other code than is
   installed (hostd, torch, transformers or the interpreter upgraded since
   the spare started; a restart of the model starts a new spare).
   Namespaces are the spare's too (its own private /tmp and network): the
   units' sandbox lines are the same, and a drop-in that changes them on
   the engine alone is not seen (docs/builtin.md says so).
3. Under systemd: AttachProcessesToUnit(our unit, pid). systemd 252 moves a
   process into a unit for a caller of the process's and the unit's uid
   when the unit is delegated (src/core/dbus-unit.c,
   bus_unit_method_attach_processes; the generator gives model-engine@NAME
   Delegate=yes with `spare: true`). Check it is in our cgroup now, send
   MAINPID=pid, wait on BARRIER=1 until systemd has read it and ask for the
   unit's MainPID: from then on the engine is the unit's main process
   (KillMode=, Restart=, the journal's _PID, `systemctl status`), and
   READY=1 is its to send. Not taken, this process says MAINPID= of its
   own again and starts alone.
4. Send "go" with our per-invocation variables and exit 0. systemd ignores
   the exit of a process that is no longer the main one.

By hand (no NOTIFY_SOCKET: the benchmarks) step 3 is skipped: the engine's
process serves on, reparented, and this one exits.

Trusts: the spare's socket only when its peer is of our uid, and a process
only when it is of our uid and, under systemd, in the spare's unit; systemd
checks the uids again. Delegate=yes lets any process of the model's uid
move itself into the engine unit, and with it to the engine's GPUs
(DeviceAllow=) and limits: the only such process without them, the
network-facing gateway, has no system bus to ask with (model@.service).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import hostd
from hostd import paths, sockets, systemd, units

log = logging.getLogger("hostd.engine")

# What systemd sets for one process alone, or for one unit's run: left out
# when the spare's environment is compared with ours, and ours handed over.
PER_INVOCATION = frozenset({
    "INVOCATION_ID", "JOURNAL_STREAM", "NOTIFY_SOCKET", "SYSTEMD_EXEC_PID", "MAINPID", "MANAGERPID",
    "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_PID", "WATCHDOG_USEC",
    # systemd 254+: each unit's own cgroup's memory.pressure
    "MEMORY_PRESSURE_WATCH", "MEMORY_PRESSURE_WRITE",
})
PER_INVOCATION_PREFIXES = ("MONITOR_", "EXIT_", "SERVICE_RESULT", "TRIGGER_")


def per_invocation(key: str) -> bool:
    return key in PER_INVOCATION or key.startswith(PER_INVOCATION_PREFIXES)
HANDSHAKE_WAIT = 10.0  # seconds for the spare to fork and answer


class Refused(Exception):
    """Why this start does not take the spare's process."""


def take(name: str) -> bool:
    """Make a process forked from the spare this unit's engine (True: this
    process should exit 0), or say why not and return False."""
    path = paths.spare_socket(name)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(HANDSHAKE_WAIT)
    try:
        conn.connect(str(path))
    except OSError as exc:
        conn.close()
        log.info("starting without the spare: %s has no spare listening (%s)", path, exc.strerror or exc)
        return False
    with conn:
        try:
            if sockets.peer_credentials(conn)[1] != os.getuid():
                raise Refused(f"{path} is served by another uid")
            argv = sys.argv[1:]  # `hostd engine NAME ...` as systemd ran it, --config-dir included
            conn.sendall(json.dumps({"argv": argv, "started": hostd.STARTED}).encode() + b"\n")
            forked = read_line(conn, 1 << 20)
            pid = check(forked)
            if os.environ.get("NOTIFY_SOCKET"):  # a unit's main process (Type=notify)
                make_main(pid, name)
            env = {k: v for k, v in os.environ.items() if per_invocation(k)}
            conn.sendall(json.dumps({"go": True, "env": env}).encode() + b"\n")
        except (OSError, ValueError, Refused) as exc:
            log.warning("starting without the spare: %s", exc)
            return False
        except Exception:  # a timeout, the bus library's own errors, deep JSON: still a normal start
            log.exception("starting without the spare, after an unexpected error")
            return False
    log.info("the engine is process %d, forked from the spare in %.2f s since this start",
             pid, time.monotonic() - hostd.STARTED)
    return True


def check(forked: object) -> int:
    """The forked process's pid, if it is ours to take (step 2)."""
    if not (isinstance(forked, dict) and isinstance(forked.get("pid"), int) and isinstance(forked.get("env"), dict)):
        raise Refused("the spare's answer is not {pid, uid, env, code}")
    pid = forked["pid"]
    if forked.get("uid") != os.getuid() or process_uid(pid) != os.getuid():
        raise Refused(f"process {pid} is not of this uid")
    theirs = {k: v for k, v in forked["env"].items() if not per_invocation(k)}
    ours = {k: v for k, v in os.environ.items() if not per_invocation(k)}
    differ = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if differ:
        raise Refused("the spare's environment differs from this unit's in " + ", ".join(differ)
                      + " (an Environment= on one unit only?); restart the model after changing either")
    # Limits and priority a process keeps from its unit's start (LimitNOFILE=,
    # Nice=): the engine unit's must be the spare's too.
    if Path(f"/proc/{pid}/limits").read_text() != Path("/proc/self/limits").read_text():
        raise Refused("the spare's resource limits differ from this unit's (a Limit*= on one unit only?)")
    if os.getpriority(os.PRIO_PROCESS, pid) != os.getpriority(os.PRIO_PROCESS, 0):
        raise Refused("the spare's nice level differs from this unit's (a Nice= on one unit only?)")
    if forked.get("code") != code_stamp():
        raise Refused("the spare runs other code than is installed now (an upgrade since it started); "
                      "`systemctl restart model@NAME` starts a new one")
    return pid


def make_main(pid: int, name: str) -> None:
    """Step 3: PID, a process of the spare's unit, into this unit's cgroup,
    then this unit's main process; one bus connection for it all."""
    import asyncio

    if not systemd_cgroup(pid).endswith(f"/{units.spare(name)}"):
        raise Refused(f"process {pid} is not in {units.spare(name)} ({systemd_cgroup(pid) or 'no cgroup'})")
    asyncio.run(asyncio.wait_for(_make_main(pid, units.engine(name)), HANDSHAKE_WAIT))


async def _make_main(pid: int, unit: str) -> None:
    from dbus_fast import BusType
    from dbus_fast.aio import MessageBus

    bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
    try:
        await systemd1_call(bus, "org.freedesktop.systemd1.Manager", "AttachProcessesToUnit", "ssau",
                            [unit, "", [pid]], f"systemd did not move process {pid} into {unit}")
        if systemd_cgroup(pid) != systemd_cgroup("self"):
            raise Refused(f"systemd did not move process {pid} into {unit} ({systemd_cgroup(pid) or 'no cgroup'})")
        systemd.notify(f"MAINPID={pid}")
        systemd.barrier()
        # The barrier says systemd read MAINPID=, not that it took it (a
        # refusal is a debug line of its own): ask. Refused, this process is
        # the main one again (it says so too) before it starts on its own.
        [path] = await systemd1_call(bus, "org.freedesktop.systemd1.Manager", "GetUnit", "s", [unit], f"no unit {unit}")
        [main] = await systemd1_call(bus, "org.freedesktop.DBus.Properties", "Get", "ss",
                                     ["org.freedesktop.systemd1.Service", "MainPID"], f"no MainPID of {unit}", path)
        if main.value != pid:
            systemd.notify(f"MAINPID={os.getpid()}")
            systemd.barrier()
            raise Refused(f"systemd did not take process {pid} as {unit}'s main process (MainPID {main.value})")
    finally:
        bus.disconnect()


def systemd_cgroup(pid: int | str) -> str:
    """PID's cgroup in systemd's hierarchy: the name=systemd line under
    cgroup v1 (legacy or hybrid: the GPU machine's systemd runs legacy,
    where the controllers' lines come after it), else the unified "0::" line."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for marker in (":name=systemd:", "0::"):
        for line in lines:
            if marker in line and (marker != "0::" or line.startswith("0::")):
                return line.split(marker, 1)[1]
    return ""


async def systemd1_call(bus, interface: str, member: str, signature: str, body: list, failed: str,
                        path: str = "/org/freedesktop/systemd1") -> list:
    """One call to systemd's bus API on BUS; its reply's body, or Refused naming FAILED."""
    from dbus_fast import Message, MessageType

    reply = await bus.call(Message(destination="org.freedesktop.systemd1", path=path, interface=interface,
                                   member=member, signature=signature, body=body))
    if reply.message_type == MessageType.ERROR:
        raise Refused(f"{failed}: {reply.error_name}: {reply.body[0] if reply.body else ''}")
    return reply.body


def process_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # the effective uid
    raise Refused(f"process {pid} has no Uid line")


def read_line(conn: socket.socket, limit: int) -> object:
    """One JSON line from CONN, at most LIMIT bytes (ValueError otherwise)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(min(65536, limit + 1 - len(data)))
        if not chunk:
            raise ValueError("the peer closed the connection mid-line" if data else "the peer closed the connection")
        data += chunk
        if len(data) > limit:
            raise ValueError(f"a line longer than {limit} bytes")
    return json.loads(data)


def code_stamp() -> str:
    """What code a process started now would run: the interpreter, hostd's
    modules, and the installs of torch, transformers and what they load the
    model with, by path, size and mtime (stat only: no import)."""
    files = [Path(sys.executable).resolve(), *sorted(Path(hostd.__file__).parent.rglob("*.py"))]
    for name in ("torch", "transformers", "tokenizers", "safetensors", "numpy"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            files.append(Path(spec.origin))
    digest = hashlib.sha256()
    for path in files:
        st = path.stat()
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()
