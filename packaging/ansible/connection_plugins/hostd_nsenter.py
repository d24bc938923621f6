# Test-only transport: real hosts are reached over ssh (Ansible's default).
"""Run Ansible's commands inside a local container's namespaces (nsenter).

tests/system/test_ansible.py boots systemd 252 in systemd-nspawn containers
that have no sshd and no network of their own; the harness drives them with
``nsenter -t <container PID 1> -a`` (tests/system/container.py), and so does
this plugin: ``ansible_host`` is the container's PID 1 as the controller sees
it. Trusts the controller's root (nsenter needs it) and nothing else; it is
not meant for production, where `ansible_connection=ssh` reaches each host.
"""

from __future__ import annotations

DOCUMENTATION = """
name: hostd_nsenter
short_description: run commands in a local container through nsenter (hostd's tests only)
description:
  - Enters every namespace of the process named by ansible_host (the
    container's PID 1) with nsenter -t PID -a and runs the command there.
    Files are copied in and out through cat on the container's side.
  - As root unless remote_user names another user, whom every command and
    copy then runs as (setpriv), so that become is exercised as over ssh.
  - Test-only transport for hostd's system tests; real hosts use ssh.
options:
  remote_addr:
    description: PID (as the controller sees it) of the container's PID 1
    type: str
    vars:
      - name: inventory_hostname
      - name: ansible_host
  remote_user:
    description:
      - The user commands run as inside, as ssh would log in as it. root
        (the default, nsenter keeps the controller's root) runs them as
        they are, and a play's become (root) is then seen as the user
        already running, and no sudo is put in front of them.
      - Any other user (-u, ansible_user, the remote_user keyword) must
        exist in the container (getent passwd); each command, and the cat of
        each file copied in or out, runs as that user (setpriv --reuid
        --regid --init-groups, HOME its home), so files land with its rights
        as over ssh and scp, and become (sudo inside the container) is what
        makes root's work possible.
    type: str
    default: root
    ini:
      - section: defaults
        key: remote_user
    env:
      - name: ANSIBLE_REMOTE_USER
    vars:
      - name: ansible_user
    keyword:
      - name: remote_user
"""

import os
import shlex
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.connection import ConnectionBase

# What a command sees inside: no variable of the controller's (its
# virtualenv, its PATH) leaks in, as tests/system/container.py's INSIDE_ENV.
INSIDE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/root",
    "TERM": "dumb",
    "SYSTEMD_PAGER": "",
}


class Connection(ConnectionBase):
    transport = "hostd_nsenter"
    has_pipelining = True
    # One nsenter per module (its code on stdin) instead of four (make a
    # temporary directory, copy, run, remove): a task costs one process start.
    always_pipeline_modules = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._accounts: dict[str, list[str]] = {}  # remote_user -> its setpriv and env prefix

    def _pid(self) -> str:
        pid = str(self.get_option("remote_addr"))
        if not pid.isdigit() or not os.path.isdir(f"/proc/{pid}"):
            raise AnsibleConnectionFailure(f"hostd_nsenter: ansible_host {pid!r} is not a running process's PID")
        return pid

    def _enter(self, argv: list[str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        command = ["nsenter", "-t", self._pid(), "-a", "--", *argv]
        proc = subprocess.run(command, input=stdin or b"", capture_output=True, env=INSIDE_ENV)
        return proc.returncode, proc.stdout, proc.stderr

    def _as_user(self) -> list[str]:
        """What goes before a command so that it runs as remote_user: nothing
        for root; for another user, setpriv with its uid, primary gid and
        groups and env with its HOME, read from the container's passwd once."""
        user = self.get_option("remote_user") or "root"
        if user == "root":
            return []
        if user not in self._accounts:
            rc, out, err = self._enter(["getent", "passwd", user], None)
            if rc != 0:
                raise AnsibleConnectionFailure(
                    f"hostd_nsenter: remote user {user!r} has no entry in the container's passwd (getent passwd exit {rc}"
                    f"{': ' + err.decode(errors='replace').strip() if err.strip() else ''}); create it there first, "
                    "or leave ansible_user unset to run as root")
            fields = out.decode().strip().split(":")
            self._accounts[user] = [
                "setpriv", f"--reuid={fields[2]}", f"--regid={fields[3]}", "--init-groups",
                "env", f"HOME={fields[5]}", f"USER={user}", f"LOGNAME={user}",
            ]
        return self._accounts[user]

    def _inside(self, argv: list[str], stdin: bytes | None) -> tuple[int, bytes, bytes]:
        return self._enter([*self._as_user(), *argv], stdin)

    def _connect(self):
        self._pid()
        self._connected = True
        return self

    def exec_command(self, cmd, in_data=None, sudoable=True):
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        self._display.vvv(f"EXEC (nsenter -t {self._pid()} as {self.get_option('remote_user') or 'root'}) {cmd}",
                          host=self._play_context.remote_addr)
        return self._inside(["/bin/sh", "-c", cmd], in_data)

    def put_file(self, in_path, out_path):
        super().put_file(in_path, out_path)
        with open(in_path, "rb") as source:
            data = source.read()
        rc, _, err = self._inside(["/bin/sh", "-c", f"cat > {shlex.quote(out_path)}"], data)
        if rc != 0:
            raise AnsibleError(f"hostd_nsenter: cannot write {out_path}: {err.decode(errors='replace')}")

    def fetch_file(self, in_path, out_path):
        super().fetch_file(in_path, out_path)
        rc, data, err = self._inside(["cat", "--", in_path], None)
        if rc != 0:
            raise AnsibleError(f"hostd_nsenter: cannot read {in_path}: {err.decode(errors='replace')}")
        with open(out_path, "wb") as target:
            target.write(data)

    def close(self):
        self._connected = False
