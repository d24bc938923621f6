"""One user per model, under a real systemd 252: model b serves, and from
model a's own user (created by model@a.socket, as every model's is) nothing
of b can be reached: not its sockets, not its weights, not its processes,
not its state. One container for the module.
"""

from __future__ import annotations

import pytest

from container import SystemdContainer, wait_for
from test_model_units import free_port, main_pid, prepare_model, stat, status_code


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    port = free_port()
    prepare_model(c, port, timeouts="{start: 120, stop: 60}")  # model "tiny": b, the victim
    c.write_file("/etc/hostd/models/a.yaml", "backend: builtin\nmodel: /var/lib/hostd/checkpoints/tiny\n"
                 f"listen: 127.0.0.1:{free_port()}\n")
    c.systemctl("daemon-reload")
    c.base_url = f"http://127.0.0.1:{port}"
    c.systemctl("start", "model@tiny.service", "model@a.socket", timeout=300)
    wait_for(lambda: status_code(c) == 200, timeout=120, what="model tiny serving")
    return c


def as_model_a(host: SystemdContainer, *argv: str):
    return host.run(["setpriv", "--reuid=hostd-a", "--regid=hostd-a", "--clear-groups", *argv], check=False)


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
    # Its own directory it may use.
    assert as_model_a(host, "ls", "/run/hostd/a").returncode == 0


def test_model_a_cannot_map_model_bs_weights(host):
    # The weights are handed over weights.sock only (a memfd passed to a
    # checked peer): a gets neither the socket nor b's processes' files.
    weights = main_pid(host, "model-weights@tiny.service")
    result = as_model_a(host, "ls", f"/proc/{weights}/fd/")
    assert result.returncode != 0, result.stdout
    result = as_model_a(host, "cat", f"/proc/{weights}/maps")
    assert result.returncode != 0 and result.stdout == ""


def test_model_a_cannot_signal_model_bs_processes(host):
    for unit in ("model@tiny.service", "model-engine@tiny.service", "model-weights@tiny.service"):
        result = as_model_a(host, "kill", "-0", str(main_pid(host, unit)))
        assert result.returncode != 0 and "not permitted" in result.stderr, (unit, result.stderr)
    assert status_code(host) == 200


def test_model_a_cannot_write_model_bs_state(host):
    for directory in ("/var/lib/hostd/tiny", "/var/cache/hostd/tiny"):
        assert stat(host, directory)["owner"] == "hostd-tiny"
        result = as_model_a(host, "touch", f"{directory}/planted")
        assert result.returncode != 0 and "Permission denied" in result.stderr, (directory, result.stderr)
