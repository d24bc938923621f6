"""Who may change models, decided by polkit under a real systemd 252, dbus
and polkitd: root is allowed, a member of the admin group is allowed (the
rules `hostd install` ships), anyone else is denied, each with the error the
user sees. One container for the module: hostd installed and hostd.service
started; no model is needed (an allowed caller gets NoSuchModel instead).
"""

from __future__ import annotations

import pytest

from container import SystemdContainer, wait_for

START_NOSUCH = ["busctl", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Start", "s", "nosuch"]
RELOAD_NOSUCH = ["busctl", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "ReloadJSON", "ss", "nosuch", ""]


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    c.sh("chmod o+x /root")  # the bound Python installation, for hostctl as other users
    c.run([c.python, "-m", "hostd.main", "install"], timeout=120)
    c.run(["useradd", "--no-create-home", "--groups", "hostd-admin", "alice"])
    c.run(["useradd", "--no-create-home", "mallory"])
    c.systemctl("start", "hostd.service", timeout=120)
    wait_for(lambda: c.run(["busctl", "status", "org.hostd1"], check=False).returncode == 0,
             timeout=60, what="org.hostd1 on the bus")
    return c


def as_user(host: SystemdContainer, user: str, argv: list[str]):
    gid = host.run(["id", "-g", user]).stdout.strip()
    return host.run(["setpriv", f"--reuid={user}", f"--regid={gid}", "--init-groups", *argv], check=False)


def test_polkit_files_are_where_polkitd_reads_them(host):
    actions = host.run(["pkaction", "--action-id", "org.hostd1.reload", "--verbose"], check=False)
    assert actions.returncode == 0 and "implicit any:" in actions.stdout, actions.stdout + actions.stderr
    assert host.run(["test", "-f", "/usr/share/polkit-1/rules.d/org.hostd1.rules"], check=False).returncode == 0


def test_root_is_allowed(host):
    result = host.run(START_NOSUCH, check=False)
    assert result.returncode != 0 and "no such model 'nosuch'" in result.stderr, result.stderr


def test_a_member_of_the_admin_group_is_allowed_by_polkit(host):
    for argv in (START_NOSUCH, RELOAD_NOSUCH):
        result = as_user(host, "alice", argv)
        assert result.returncode != 0 and "no such model 'nosuch'" in result.stderr, result.stderr


def test_another_user_is_denied_by_polkit_with_the_action_named(host):
    # busctl prints the errno of org.freedesktop.DBus.Error.AccessDenied ...
    assert "Access denied" in as_user(host, "mallory", START_NOSUCH).stderr
    # ... hostctl the manager's own message.
    result = as_user(host, "mallory", [host.python, "-m", "hostd.hostctl", "start", "nosuch"])
    assert result.returncode != 0
    assert "not authorized to start, stop or restart a model" in result.stderr, result.stderr
    assert "org.hostd1.manage" in result.stderr and "'hostd-admin'" in result.stderr
    result = as_user(host, "mallory", [host.python, "-m", "hostd.hostctl", "reload", "nosuch", "max_num_seqs=2"])
    assert "not authorized to reload a model" in result.stderr and "org.hostd1.reload" in result.stderr
    # Reading stays open to everyone.
    listed = as_user(host, "mallory", ["busctl", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager",
                                       "ListModels"])
    assert listed.returncode == 0, listed.stderr
