"""Model names under a real systemd 252 (issue 22, items 6 and 16): a model
named `admin` never gets a user in the admin group, a model named
`checkpoints` never takes the shared checkpoint directory, and two names
that once mapped to one user (`Tiny`, `tiny-37616f64`) get two; a model whose
user someone else made, or whose state directory is another account's, is
not started and takes neither (item 6, at the socket's start). One container
for the module; only sockets are started (they create the model's user)."""

from __future__ import annotations

import pytest

from container import SystemdContainer
from ports import reserved_port
from test_model_units import prepare_model, stat

NAMES = ("admin", "checkpoints", "Tiny", "tiny-37616f64", "squat", "stale")


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    prepare_model(c, reserved_port())  # installs hostd (sysusers: the group hostd-admin) and a checkpoint
    for name in NAMES:
        c.write_file(f"/etc/hostd/models/{name}.yaml", "backend: builtin\nmodel: /var/lib/hostd/checkpoints/tiny\n"
                     f"listen: 127.0.0.1:{reserved_port()}\n")
    c.systemctl("daemon-reload")
    return c


def test_a_model_named_admin_is_not_started_and_no_user_joins_the_admin_group(host):
    started = host.systemctl("start", "model@admin.socket", check=False, timeout=60)
    assert started.returncode != 0
    assert host.run(["getent", "passwd", "hostd-admin"], check=False).stdout == ""
    assert host.run(["getent", "group", "hostd-admin"]).stdout.strip().endswith(":")  # hostd's group, no members
    shown = host.systemctl("show", "-p", "Description", "model@admin.socket").stdout
    assert "INVALID CONFIG /etc/hostd/models/admin.yaml" in shown


def test_a_model_named_checkpoints_does_not_take_the_checkpoint_directory(host):
    started = host.systemctl("start", "model@checkpoints.socket", check=False, timeout=60)
    assert started.returncode != 0
    assert host.run(["getent", "passwd", "hostd-checkpoints"], check=False).stdout == ""
    assert stat(host, "/var/lib/hostd/checkpoints")["owner"] == "root"


def test_two_names_that_shared_a_user_now_get_two(host):
    host.systemctl("start", "model@Tiny.socket", "model@tiny-37616f64.socket", timeout=120)
    owners = {name: stat(host, f"/run/hostd/{name}")["owner"] for name in ("Tiny", "tiny-37616f64")}
    assert owners["Tiny"] != owners["tiny-37616f64"], owners
    uids = {host.run(["id", "-u", user]).stdout for user in owners.values()}
    assert len(uids) == 2


def socket_journal(host: SystemdContainer, name: str, since: str) -> str:
    return host.run(["journalctl", "--no-pager", "-o", "cat", "--since", since, "-u", f"model@{name}.socket"]).stdout


def test_a_user_someone_else_made_stops_the_models_socket_and_keeps_its_powers_off_the_model(host):
    host.run(["useradd", "--system", "--no-create-home", "--comment", "a neighbour's service", "hostd-squat"])
    uid = host.run(["id", "-u", "hostd-squat"]).stdout.strip()
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    started = host.systemctl("start", "model@squat.socket", check=False, timeout=60)
    assert started.returncode != 0
    journal = socket_journal(host, "squat", since)
    assert (f"hostd: model squat is not started: the user hostd-squat (uid {uid}) exists and was not created "
            "by hostd for model 'squat'") in journal, journal[-3000:]
    assert host.run(["getent", "passwd", "hostd-squat"]).stdout.split(":")[4] == "a neighbour's service"
    assert host.run(["test", "-e", "/var/lib/hostd/squat"], check=False).returncode != 0  # nothing made for it


def test_a_state_directory_of_another_account_stops_the_socket_and_is_left_alone(host):
    host.run(["install", "-d", "-o", "nobody", "-g", "nogroup", "/var/lib/hostd/stale"])
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    started = host.systemctl("start", "model@stale.socket", check=False, timeout=60)
    assert started.returncode != 0
    journal = socket_journal(host, "stale", since)
    assert "/var/lib/hostd/stale is owned by nobody (uid 65534), not by root or model 'stale''s user hostd-stale" \
        in journal, journal[-3000:]
    assert stat(host, "/var/lib/hostd/stale")["owner"] == "nobody"
    assert host.run(["getent", "passwd", "hostd-stale"], check=False).stdout == ""  # sysusers never ran
