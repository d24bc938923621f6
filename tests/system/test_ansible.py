"""The Ansible role (packaging/ansible) against three real systemd 252 hosts.

Three systemd-nspawn containers stand for three hosts of a fleet; Ansible
reaches them through the test-only connection plugin hostd_nsenter (nsenter
into the container's PID 1, as the harness does; real hosts use ssh). Each
host gets the tiny builtin model from the role: `hostd install`, the model's
YAML and a drop-in, both validated by `hostctl config --check --file F --as
TARGET` before they land, and model@tiny.service started. host-b's checkpoint
has 256 positions where the others have 512 (a host a generation behind), so
a fleet-wide `max_model_len: 384` is what its engine refuses: its reload rolls
back, and the roll must stop there, leaving host-c untouched, every host
serving. The same holds for a new checkpoint (rolling-restart.yml, a
checkpoint swap on each host): host-b's is cut short, its swap rolls back.

Last, host-c is reached as a deploy user with sudo (as real hosts are, over
ssh): the plugin runs every command and copy as that user, so root's work is
done through become or not at all.

What a user of the playbooks observes is asserted: ansible-playbook's exit
code and its per-host lines, the files on each host, the limits each engine
runs (hostctl status --json) and HTTP 200 from each model's public address.
The outputs are printed (pytest -s) for docs/fleet.md, which quotes them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import CHECKOUT, _Containers, require_container_support
from container import Bind, SystemdContainer
from ports import reserved_port

ANSIBLE = CHECKOUT / "packaging" / "ansible"
HOSTS = ("host-a", "host-b", "host-c")
REFUSING = "host-b"  # its checkpoint has 256 positions, the others 512
CHECKPOINT = "/var/lib/hostd/checkpoints/tiny"
# The roll to a new checkpoint (rolling-restart.yml, a checkpoint swap on
# each host): a second directory on each host; host-b's weight file was
# copied in part (cut short), which `hostctl config --check` does not read
# and the new weights daemon refuses when it loads it: its swap rolls back.
CHECKPOINT_V2 = "/var/lib/hostd/checkpoints/tiny-v2"
BROKEN = "host-b"
NEW_LIMITS = {"max_model_len": 384}


def playbook_command() -> str:
    """ansible-playbook of this interpreter's environment (the test extra
    installs ansible-core): missing, the test fails, it does not skip."""
    command = Path(sys.executable).parent / "ansible-playbook"
    assert command.is_file(), f"{command} missing: pip install -e '.[test]' installs ansible-core"
    return str(command)


def models(max_num_seqs: int = 4, *, checkpoint: str = CHECKPOINT, dropins: dict | None = None) -> list[dict]:
    """hostd_models: the YAML and one drop-in, as an operator writes them."""
    return [{
        "name": "tiny",
        "config": {"backend": "builtin", "model": checkpoint, "listen": "127.0.0.1:{{ hostd_port }}"},
        "dropins": dropins if dropins is not None else {"50-limits.yaml": {"engine": {"max_num_seqs": max_num_seqs}}},
    }]


class Fleet:
    def __init__(self, hosts: dict[str, SystemdContainer], ports: dict[str, int], workdir: Path) -> None:
        self.hosts, self.ports, self.workdir = hosts, ports, workdir
        self.inventory = workdir / "inventory.yml"
        self.inventory.write_text(json.dumps({"hostd_hosts": {
            "hosts": {name: {"ansible_host": str(c.pid1), "hostd_port": ports[name]} for name, c in hosts.items()},
            "vars": {"ansible_connection": "hostd_nsenter", "hostd_python": next(iter(hosts.values())).python},
        }}, indent=2))

    def play(self, playbook: str, *args: str, extra: dict | None = None) -> subprocess.CompletedProcess[str]:
        argv = [playbook_command(), "-i", str(self.inventory), playbook, *args]
        if extra is not None:
            (self.workdir / "extra.json").write_text(json.dumps(extra))
            argv += ["-e", f"@{self.workdir / 'extra.json'}"]
        # ansible-core refuses a locale that is not UTF-8: CI's may be unset.
        env = {**os.environ, "LANG": "C.UTF-8", "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
               "ANSIBLE_HOME": str(self.workdir / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(self.workdir / "tmp")}
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=ANSIBLE, env=env, capture_output=True, text=True, timeout=600)
        print(f"\n$ ansible-playbook {playbook} {' '.join(args)}   # exit {proc.returncode}, "
              f"{time.monotonic() - started:.0f} s\n{proc.stdout}{proc.stderr}")
        return proc

    def status(self, name: str) -> dict:
        return json.loads(self.hosts[name].run(["hostctl", "status", "tiny", "--json=short"], check=False).stdout)["data"]

    def http_status(self, name: str) -> int:
        return httpx.get(f"http://127.0.0.1:{self.ports[name]}/v1/models", timeout=30).status_code

    def dropin(self, name: str) -> str:
        return self.hosts[name].read_file("/etc/hostd/models/tiny.d/50-limits.yaml")

    def files(self, name: str) -> list[str]:
        return self.hosts[name].sh("cd /etc/hostd/models && find tiny.yaml tiny.d -type f 2>/dev/null | sort || true",
                                   check=False).stdout.split()

    def gateway_pid(self, name: str) -> int:
        """model@tiny.service's main process: the gateway, which only a restart of the model replaces."""
        return int(self.hosts[name].systemctl("show", "-p", "MainPID", "--value", "model@tiny.service").stdout)

    def is_active(self, name: str) -> int:
        return self.hosts[name].run(["hostctl", "is-active", "tiny"], check=False).returncode


def recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP's counters per host."""
    hosts = {}
    for line in output.split("PLAY RECAP")[-1].splitlines():
        match = re.match(r"^(\S+)\s+:\s+(.*)$", line.strip())
        if match:
            hosts[match[1]] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match[2])}
    return hosts


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    require_container_support()
    workdir = tmp_path_factory.mktemp("fleet")
    python = [sys.executable, "-m", "hostd.main", "make-checkpoint"]
    makers = [subprocess.Popen([*python, str(workdir / "ckpt-512")], stdout=subprocess.DEVNULL),
              subprocess.Popen([*python, "--size", "tiny-vllm", str(workdir / "ckpt-256")], stdout=subprocess.DEVNULL)]
    assert [maker.wait(timeout=300) for maker in makers] == [0, 0]
    shutil.copytree(workdir / "ckpt-512", workdir / "ckpt-v2")
    shutil.copytree(workdir / "ckpt-512", workdir / "ckpt-v2-broken")
    shard = workdir / "ckpt-v2-broken" / "model.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    containers = _Containers(tmp_path_factory)
    try:
        hosts = {}
        for name in HOSTS:
            checkpoint = workdir / ("ckpt-256" if name == REFUSING else "ckpt-512")
            v2 = workdir / ("ckpt-v2-broken" if name == BROKEN else "ckpt-v2")
            hosts[name] = containers(binds=[Bind(checkpoint, Path(CHECKPOINT)), Bind(v2, Path(CHECKPOINT_V2))])
            hosts[name].sh("chmod o+x /root")  # the bound Python installation, for the models' users
        yield Fleet(hosts, {name: reserved_port() for name in HOSTS}, workdir)
    finally:
        containers.stop_all()


def test_site_installs_and_starts_every_host_and_a_second_run_changes_nothing(fleet):
    first = fleet.play("site.yml", extra={"hostd_models": models()})
    assert first.returncode == 0, first.stdout + first.stderr
    assert all(recap(first.stdout)[name]["changed"] > 0 for name in HOSTS)
    for name in HOSTS:
        assert fleet.http_status(name) == 200, name
        assert fleet.status(name)["engine"]["max_num_seqs"] == 4
        # The files may hold secrets: root and the model's user read them, nobody else.
        modes = fleet.hosts[name].run(["stat", "-c", "%a %U %G", "/etc/hostd/models/tiny.yaml",
                                       "/etc/hostd/models/tiny.d/50-limits.yaml"]).stdout.split("\n")
        assert modes[:2] == ["640 root hostd-tiny"] * 2, (name, modes)

    again = fleet.play("site.yml", extra={"hostd_models": models()})
    assert again.returncode == 0, again.stdout + again.stderr
    assert {name: recap(again.stdout)[name]["changed"] for name in HOSTS} == {name: 0 for name in HOSTS}


def test_site_check_mode_reports_the_drop_in_change_and_changes_nothing(fleet):
    before = {name: fleet.dropin(name) for name in HOSTS}
    check = fleet.play("site.yml", "--check", "--diff", extra={"hostd_models": models(max_num_seqs=6)})
    assert check.returncode == 0, check.stdout + check.stderr
    assert "-  max_num_seqs: 4\n+  max_num_seqs: 6" in check.stdout
    assert all(recap(check.stdout)[name]["changed"] > 0 for name in HOSTS)
    for name in HOSTS:
        assert fleet.dropin(name) == before[name]
        status = fleet.status(name)
        assert status["engine"]["max_num_seqs"] == 4 and status["last_operation"] is None, status


def test_a_drop_in_hostctl_refuses_is_not_written(fleet):
    before = fleet.dropin("host-a")
    bad = fleet.play("site.yml", "--limit", "host-a", extra={"hostd_models": models(max_num_seqs=0)})
    assert bad.returncode != 0
    assert "failed to validate" in bad.stdout and "engine.max_num_seqs: expected `int` >= 1" in bad.stdout, bad.stdout
    assert fleet.dropin("host-a") == before
    assert fleet.http_status("host-a") == 200


def test_rolling_reload_check_mode_reports_each_host_and_reloads_nothing(fleet):
    extra = {"hostd_reload_model": "tiny", "hostd_reload_set": NEW_LIMITS}
    check = fleet.play("rolling-reload.yml", "--check", "--diff", extra=extra)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count("tiny: would reload max_model_len None -> 384") == len(HOSTS)
    for name in HOSTS:
        status = fleet.status(name)
        assert status["engine"]["max_model_len"] is None and status["last_operation"] is None, status


def test_rolling_reload_stops_at_the_host_that_rolls_back_and_every_host_keeps_serving(fleet):
    extra = {"hostd_reload_model": "tiny", "hostd_reload_set": NEW_LIMITS}
    roll = fleet.play("rolling-reload.yml", extra=extra)
    assert roll.returncode != 0
    counts = recap(roll.stdout)
    assert counts["host-a"]["changed"] == 1 and counts["host-a"]["failed"] == 0, counts
    assert counts[REFUSING]["failed"] == 1, counts
    assert "host-c" not in counts and "host-c" not in roll.stdout, roll.stdout  # never reached
    assert "tiny: reload done" in roll.stdout and "tiny: reload rolled-back" in roll.stdout

    a, b, c = (fleet.status(name) for name in HOSTS)
    assert a["engine"]["max_model_len"] == 384 and a["last_operation"]["state"] == "done", a
    assert b["engine"]["max_model_len"] is None and b["last_operation"]["state"] == "rolled-back", b
    assert "max_position_embeddings" in b["last_operation"]["error"], b
    assert c["engine"]["max_model_len"] is None and c["last_operation"] is None, c
    for name in HOSTS:
        assert fleet.http_status(name) == 200, name
        assert fleet.status(name)["state"] == "serving", name


def test_site_prunes_the_roles_drop_in_no_longer_listed_and_keeps_an_admins_own(fleet):
    host = fleet.hosts["host-a"]
    host.write_file("/etc/hostd/models/tiny.d/40-admin.yaml", "engine:\n  max_num_seqs: 3\n")  # no marker line
    play = fleet.play("site.yml", "--limit", "host-a",
                      extra={"hostd_models": models(dropins={"60-seqs.yaml": {"engine": {"max_num_seqs": 5}}})})
    assert play.returncode == 0, play.stdout + play.stderr + host.run(["journalctl", "-n", "60", "--no-pager"]).stdout
    assert "tiny.d/50-limits.yaml" in play.stdout, play.stdout  # the prune's line
    # 50-limits.yaml was the role's (its marker line): gone; the admin's and the manager's stay.
    assert fleet.files("host-a") == ["tiny.d/40-admin.yaml", "tiny.d/60-seqs.yaml", "tiny.d/90-reload.yaml", "tiny.yaml"], \
        fleet.files("host-a")
    status = fleet.status("host-a")
    assert status["engine"]["max_num_seqs"] == 5 and status["last_operation"]["state"] == "done", status


def test_site_refuses_a_fixed_key_change_on_a_serving_host_and_writes_nothing(fleet):
    before = fleet.hosts["host-c"].read_file("/etc/hostd/models/tiny.yaml")
    play = fleet.play("site.yml", "--limit", "host-c", extra={"hostd_models": models(checkpoint=CHECKPOINT_V2)})
    assert play.returncode != 0
    assert "tiny: fixed key(s) model of /etc/hostd/models/tiny.yaml change" in play.stdout, play.stdout
    assert "a reload swaps the checkpoint under traffic, one host at a time" in play.stdout
    assert "rolling-restart.yml" in play.stdout
    assert fleet.hosts["host-c"].read_file("/etc/hostd/models/tiny.yaml") == before
    assert fleet.http_status("host-c") == 200


def test_rolling_restart_swaps_the_checkpoint_host_by_host_and_stops_at_the_host_whose_swap_rolls_back(fleet):
    """A new `model:` alone is a checkpoint swap (issue 36): `systemctl
    reload`, no restart; host-a serves the new checkpoint, host-b's (cut
    short) does not load, so its swap rolls back, it keeps serving the old
    one (pinned in 99-rollback.yaml) and the roll stops there."""
    gateways = {name: fleet.gateway_pid(name) for name in ("host-a", BROKEN)}
    roll = fleet.play("rolling-restart.yml", extra={"hostd_models": models(checkpoint=CHECKPOINT_V2)})
    assert roll.returncode != 0
    counts = recap(roll.stdout)
    assert counts["host-a"]["failed"] == 0 and counts["host-a"]["changed"] > 0, counts
    assert counts[BROKEN]["failed"] == 1, counts
    assert "host-c" not in counts and "host-c" not in roll.stdout, roll.stdout  # never reached

    # host-a serves the new checkpoint, swapped under traffic: a reload, the
    # model (its gateway) never restarted.
    status = fleet.status("host-a")
    assert status["checkpoint"] == CHECKPOINT_V2, status
    op = json.loads(fleet.hosts["host-a"].run(["hostctl", "operations", "--json"]).stdout)["data"][-1]
    assert (op["kind"], op["state"]) == ("reload", "done"), op
    assert fleet.is_active("host-a") == 0 and fleet.http_status("host-a") == 200
    assert {name: fleet.gateway_pid(name) for name in gateways} == gateways
    # host-b: its swap rolled back; it serves the old checkpoint, pinned.
    assert fleet.is_active(BROKEN) == 0 and fleet.http_status(BROKEN) == 200
    assert fleet.status(BROKEN)["checkpoint"] == CHECKPOINT, fleet.status(BROKEN)
    assert f"model: {CHECKPOINT}" in fleet.hosts[BROKEN].read_file("/etc/hostd/models/tiny.d/99-rollback.yaml")
    # host-c: untouched, the old checkpoint, serving.
    assert f"model: {CHECKPOINT}\n" in fleet.hosts["host-c"].read_file("/etc/hostd/models/tiny.yaml")
    assert fleet.is_active("host-c") == 0 and fleet.http_status("host-c") == 200


def test_state_absent_stops_the_model_and_removes_the_roles_files(fleet):
    play = fleet.play("site.yml", "--limit", "host-c",
                      extra={"hostd_models": [{"name": "tiny", "state": "absent", "config": {}}]})
    assert play.returncode == 0, play.stdout + play.stderr
    host = fleet.hosts["host-c"]
    assert host.systemctl("is-active", "model@tiny.service", check=False).stdout.strip() == "inactive"
    assert host.systemctl("is-active", "model@tiny.socket", check=False).stdout.strip() == "inactive"
    assert fleet.files("host-c") == [], fleet.files("host-c")
    with pytest.raises(httpx.TransportError):
        fleet.http_status("host-c")


# What Debian's sudo package puts in /etc (with the PAM files /etc/pam.d/sudo
# includes and pam_limits' table): --volatile=yes boots each container with an
# /etc of its own, which has none of the host's; packaging/setup.sh installs sudo.
SUDO_ETC = ("/etc/sudoers", "/etc/pam.d/sudo", "/etc/pam.d/common-auth", "/etc/pam.d/common-account",
            "/etc/pam.d/common-session-noninteractive", "/etc/security/limits.conf")


def add_sudo_user(host: SystemdContainer, user: str) -> None:
    """USER as a real host's deploy account: a login of its own and root
    through sudo without a password (a sudoers.d file, 0440)."""
    for path in SUDO_ETC:
        assert Path(path).is_file(), f"{path} missing on this machine: packaging/setup.sh installs sudo"
        host.write_file(path, Path(path).read_text(), mode=0o440 if path == "/etc/sudoers" else 0o644)
    host.run(["useradd", "--create-home", "--shell", "/bin/sh", user])
    host.write_file(f"/etc/sudoers.d/{user}", f"{user} ALL=(root) NOPASSWD: ALL\n", mode=0o440)
    host.run(["visudo", "--check"])


def test_a_deploy_user_gets_root_through_sudo_and_without_become_writes_nothing(fleet):
    # host-c: model tiny absent (the test above), the role's files gone.
    host = fleet.hosts["host-c"]
    add_sudo_user(host, "deploy")
    as_deploy = ("--limit", "host-c", "-u", "deploy")

    refused = fleet.play("site.yml", *as_deploy, "-e", "ansible_become=false", extra={"hostd_models": models()})
    assert refused.returncode != 0
    assert "Destination /etc/hostd/models not writable" in refused.stdout, refused.stdout
    assert fleet.files("host-c") == [], fleet.files("host-c")

    play = fleet.play("site.yml", *as_deploy, extra={"hostd_models": models()})
    assert play.returncode == 0, play.stdout + play.stderr
    modes = host.run(["stat", "-c", "%a %U %G", "/etc/hostd/models/tiny.yaml",
                      "/etc/hostd/models/tiny.d/50-limits.yaml"]).stdout.split("\n")
    assert modes[:2] == ["640 root hostd-tiny"] * 2, modes
    # The copies went through deploy's own temporary directory, as over ssh and scp.
    assert host.run(["stat", "-c", "%U", "/home/deploy/.ansible"]).stdout.strip() == "deploy"
    assert fleet.http_status("host-c") == 200
