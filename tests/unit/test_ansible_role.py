"""packaging/ansible as an operator runs it against real hosts: the settings
ansible-playbook reads from the folder docs/fleet.md starts in, and what the
role does with the names and files of hostd_models before anything lands.

The playbooks against three real systemd hosts are tests/system/test_ansible.py;
these read the same files with Ansible's own tools, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ANSIBLE = Path(__file__).resolve().parents[2] / "packaging/ansible"


def effective_settings() -> dict:
    """ansible-config's view of the folder's ansible.cfg, as `cd
    packaging/ansible && ansible-playbook ...` reads it (nothing from this
    process's environment)."""
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": os.environ.get("HOME", "/root"),
           "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg")}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-config"), "dump", "--format", "json"],
                          cwd=ANSIBLE, env=env, capture_output=True, text=True, check=True, timeout=120)
    return {entry["name"]: entry for entry in json.loads(done.stdout) if "name" in entry}


def test_real_fleet_runs_check_host_keys():
    """A fleet run from packaging/ansible reaches its hosts over ssh: with host
    key checking off, whoever answers for gpu-01 gets the model's secrets."""
    setting = effective_settings()["HOST_KEY_CHECKING"]
    assert setting["value"] is True, setting
