"""One user per model, under a real systemd 252: model b serves, and from
model a's own user (created by model@a.socket, as every model's is) nothing
of b can be reached: not its sockets, not its weights, not its processes,
not its state. One container for the module.
"""

from __future__ import annotations

import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import main_pid, prepare_model, stat, status_code


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    port = reserved_port()
    prepare_model(c, port, timeouts="{start: 120, stop: 60}")  # model "tiny": b, the victim
    c.write_file("/etc/hostd/models/a.yaml", "backend: builtin\nmodel: /var/lib/hostd/checkpoints/tiny\n"
                 f"listen: 127.0.0.1:{reserved_port()}\n")
    c.systemctl("daemon-reload")
    c.base_url = f"http://127.0.0.1:{port}"
    c.systemctl("start", "model@tiny.service", "model@a.socket", timeout=300)
    wait_for(lambda: status_code(c) == 200, timeout=120, what="model tiny serving")
    return c


def as_user(host: SystemdContainer, user: str, *argv: str):
    return host.run(["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv], check=False)


def as_model_a(host: SystemdContainer, *argv: str):
    return as_user(host, "hostd-a", *argv)


def as_model_b(host: SystemdContainer, *argv: str):
    """The positive control: the same command as b's own user succeeds, so a
    refusal to a is the isolation, not a broken command."""
    return as_user(host, "hostd-tiny", *argv)


def test_each_model_runs_as_its_own_user(host):
    users = {unit: host.run(["ps", "-o", "user=", "-p", str(main_pid(host, unit))]).stdout.strip()
             for unit in ("model@tiny.service", "model-engine@tiny.service", "model-weights@tiny.service")}
    assert set(users.values()) == {"hostd-tiny"}, users
    assert stat(host, "/run/hostd/tiny")["owner"] == "hostd-tiny"
    assert stat(host, "/run/hostd/a")["owner"] == "hostd-a"
    assert host.run(["id", "-u", "hostd-a"]).stdout != host.run(["id", "-u", "hostd-tiny"]).stdout


def test_model_a_cannot_connect_to_model_bs_sockets(host):
    connect = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
    for name in ("control.sock", "engine.sock", "weights.sock"):
        result = as_model_a(host, host.python, "-c", connect, f"/run/hostd/tiny/{name}")
        assert result.returncode != 0 and "PermissionError" in result.stderr, (name, result.stderr)
        control = as_model_b(host, host.python, "-c", connect, f"/run/hostd/tiny/{name}")
        assert control.returncode == 0, (name, control.stderr)
    # Its own directory it may use.
    assert as_model_a(host, "ls", "/run/hostd/a").returncode == 0


def test_model_a_cannot_map_model_bs_weights(host):
    # The weights are handed over weights.sock only (a memfd passed to a
    # checked peer): a gets neither the socket nor b's processes' files.
    weights = main_pid(host, "model-weights@tiny.service")
    result = as_model_a(host, "ls", f"/proc/{weights}/fd/")
    assert result.returncode != 0 and "Permission denied" in result.stderr, (result.stdout, result.stderr)
    result = as_model_a(host, "cat", f"/proc/{weights}/maps")
    assert result.returncode != 0 and result.stdout == "" and "Permission denied" in result.stderr, result.stderr
    # b's own user reads both: the daemon's sockets and its mapped weights.
    control = as_model_b(host, "ls", "-l", f"/proc/{weights}/fd/")
    assert control.returncode == 0 and "socket:" in control.stdout, control.stderr
    control = as_model_b(host, "cat", f"/proc/{weights}/maps")
    assert control.returncode == 0 and control.stdout, control.stderr


def test_model_a_cannot_signal_model_bs_processes(host):
    for unit in ("model@tiny.service", "model-engine@tiny.service", "model-weights@tiny.service"):
        result = as_model_a(host, "kill", "-0", str(main_pid(host, unit)))
        assert result.returncode != 0 and "not permitted" in result.stderr, (unit, result.stderr)
        control = as_model_b(host, "kill", "-0", str(main_pid(host, unit)))  # signal 0: nothing is sent
        assert control.returncode == 0, (unit, control.stderr)
    assert status_code(host) == 200


def test_model_a_cannot_write_model_bs_state(host):
    for directory in ("/var/lib/hostd/tiny", "/var/cache/hostd/tiny"):
        assert stat(host, directory)["owner"] == "hostd-tiny"
        result = as_model_a(host, "touch", f"{directory}/planted")
        assert result.returncode != 0 and "Permission denied" in result.stderr, (directory, result.stderr)
        control = as_model_b(host, "touch", f"{directory}/control")
        assert control.returncode == 0, (directory, control.stderr)
        host.run(["rm", "-f", f"{directory}/control"])
        assert host.run(["test", "-e", f"{directory}/planted"], check=False).returncode == 1
