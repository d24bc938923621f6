"""System tests proving the systemd-nspawn harness (container.py) itself:
the container boots a real systemd that runs Type=notify template units,
answers on the system bus, records their output in the journal, and leaves
no process behind when it is stopped."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

from container import SystemdContainer, processes_in_pid_namespace, wait_for

PROBE_UNIT = "hostd-harness-probe@.service"
PROBE_SCRIPT = "/run/hostd-harness-probe.py"

# Prints a log line, waits a moment (so that `systemctl start` returning
# late proves it waited for READY=1), then notifies readiness and idles.
PROBE_SOURCE = """\
import os, socket, sys, time

print(f"hostd-harness-probe {{sys.argv[1]}} {token}", flush=True)
time.sleep({ready_delay})
address = os.environ["NOTIFY_SOCKET"]
if address.startswith("@"):  # abstract socket
    address = "\\0" + address[1:]
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
    sock.connect(address)
    sock.sendall(b"READY=1")
while True:
    time.sleep(3600)
"""

PROBE_UNIT_TEMPLATE = """\
[Unit]
Description=hostd harness probe %i

[Service]
Type=notify
ExecStart={python} {script} %i
"""


def test_boots_systemd_on_a_volatile_root(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    assert c.system_state == "running"  # a degraded boot is a ContainerError
    assert c.read_file("/proc/1/comm").strip() == "systemd"
    assert c.run(["findmnt", "-no", "FSTYPE", "/"]).stdout.strip() == "tmpfs"
    assert c.systemctl("is-active", "hostd-test.target").stdout.strip() == "active"
    # The checkout and the interpreter are visible at their host paths.
    assert c.run([c.python, "-c", "import sys; print(sys.prefix)"]).stdout.strip()
    assert c.run(["test", "-f", str(c.checkout / "tests/system/container.py")]).returncode == 0


def test_container_tmp_is_not_the_hosts(systemd_container: SystemdContainer) -> None:
    marker = f"/tmp/hostd-harness-{secrets.token_hex(8)}"
    systemd_container.write_file(marker, "inside\n")
    assert systemd_container.read_file(marker) == "inside\n"
    assert not Path(marker).exists()


def test_notify_template_unit(systemd_container: SystemdContainer) -> None:
    c = systemd_container
    token = secrets.token_hex(8)
    ready_delay = 1.0
    c.write_file(PROBE_SCRIPT, PROBE_SOURCE.format(token=token, ready_delay=ready_delay))
    c.install_unit(PROBE_UNIT, PROBE_UNIT_TEMPLATE.format(python=c.python, script=PROBE_SCRIPT))
    unit = "hostd-harness-probe@foo.service"

    started = time.monotonic()
    c.systemctl("start", unit)
    # Type=notify: start only returns once READY=1 has arrived.
    assert time.monotonic() - started >= ready_delay
    assert c.systemctl("is-active", unit).stdout.strip() == "active"

    # The manager's D-Bus API knows the unit.
    reply = c.busctl_json(
        "call",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "GetUnit",
        "s",
        unit,
    )
    assert reply["type"] == "o"
    (object_path,) = reply["data"]
    assert object_path.startswith("/org/freedesktop/systemd1/unit/")

    def unit_property(name: str) -> object:
        args = ("get-property", "org.freedesktop.systemd1", object_path, "org.freedesktop.systemd1.Unit", name)
        return c.busctl_json(*args)["data"]

    assert unit_property("Id") == unit
    assert unit_property("ActiveState") == "active"

    # Its stdout reached the journal.
    expected = f"hostd-harness-probe foo {token}"
    entry = wait_for(
        lambda: next((e for e in c.journal(unit) if e.get("MESSAGE") == expected), None),
        timeout=15,
        what=f"{expected!r} in the journal of {unit}",
    )
    assert entry["_SYSTEMD_UNIT"] == unit

    c.systemctl("stop", unit)
    assert c.systemctl("is-active", unit, check=False).stdout.strip() == "inactive"
    assert unit_property("ActiveState") == "inactive"


def test_stop_leaves_no_process(make_systemd_container) -> None:
    c = make_systemd_container()
    c.systemctl("start", "dbus.service")
    # A stray process outside any unit, reparented to the container's PID 1.
    c.sh("setsid sleep 1000 >/dev/null 2>&1 < /dev/null &")
    namespace, pid1, nspawn = c.pid_namespace, c.pid1, c.nspawn
    assert namespace and pid1 and nspawn
    assert len(processes_in_pid_namespace(namespace)) >= 3  # systemd, journald, sleep, ...

    c.stop()

    assert nspawn.returncode is not None, "systemd-nspawn is still running"
    assert processes_in_pid_namespace(namespace) == []
    assert not c.running
