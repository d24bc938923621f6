"""packaging/ansible as an operator runs it against real hosts: the settings
ansible-playbook reads from the folder docs/fleet.md starts in, and what the
role does with the names and files of hostd_models before anything lands.

The playbooks against three real systemd hosts are tests/system/test_ansible.py;
these read the same files with Ansible's own tools, offline."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import yaml

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


def role_tasks(name: str) -> list[dict]:
    return yaml.safe_load((ANSIBLE / "roles/hostd/tasks" / name).read_text())


def test_model_files_are_written_for_root_and_the_models_user_only(monkeypatch):
    """A model's YAML and drop-ins may hold env: secrets (HF_TOKEN): the role
    writes them root:USER 0640, which hostd's own rule (the readers
    `hostctl config --check` warns about) accepts, where 0644 root:root let
    every local user read them."""
    import grp

    from hostd import host_check

    defaults = yaml.safe_load((ANSIBLE / "roles/hostd/defaults/main.yml").read_text())
    copies = [task["ansible.builtin.copy"] for task in role_tasks("model-present.yml") if "ansible.builtin.copy" in task]
    assert len(copies) == 2  # NAME.yaml and the drop-ins
    for copy in copies:
        assert (copy.get("owner"), copy.get("group"), copy.get("mode")) == \
            ("root", "{{ hostd_model_user.stdout }}", "{{ hostd_config_mode }}"), copy

    model_gid = 4243
    monkeypatch.setattr(grp, "getgrnam", lambda group: grp.struct_group((group, "x", model_gid, []))
                        if group == "hostd-tiny" else (_ for _ in ()).throw(KeyError(group)))
    mode = int(defaults["hostd_config_mode"], 8)
    written = os.stat_result((stat.S_IFREG | mode, 0, 0, 1, 0, model_gid, 0, 0, 0, 0))
    assert host_check._other_readers(written, "tiny") is None, oct(mode)


def test_the_role_refuses_a_model_name_hostd_refuses_before_using_it_in_a_path(tmp_path: Path):
    """hostd_models' names become paths (/etc/hostd/models/NAME.yaml) and unit
    names: "../../../tmp/evil" must fail the play at its first task, with
    hostd's own rule, before any path is made of it (check mode: nothing is
    written either way)."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "hosts": "localhost", "gather_facts": False,
        "tasks": [{"ansible.builtin.include_tasks": str(ANSIBLE / "roles/hostd/tasks/model.yml"),
                   "vars": {"hostd_model": {"name": "../../../tmp/evil", "config": {"backend": "builtin"}}}}],
    }]))
    extra = {"hostd_python": sys.executable, "hostd_hostctl": "/bin/false", "hostd_config_dir": str(tmp_path / "etc"),
             "hostd_config_mode": "0640", "ansible_python_interpreter": sys.executable}
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(tmp_path),
           "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOME": str(tmp_path / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-c", "local", "-i", "localhost,",
                           "--check", "-e", json.dumps(extra), str(playbook)],
                          cwd=ANSIBLE, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "model name '../../../tmp/evil' is not allowed" in out, out
    assert "is it running now" not in out and "/etc/hostd/models" not in out, out
    assert not (tmp_path / "etc").exists()


def play_locally(tmp_path: Path, tasks: list[dict], extra: dict, *, check: bool = True) -> subprocess.CompletedProcess:
    """ansible-playbook on localhost (-c local) with the folder's ansible.cfg."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}]))
    env = {"PATH": os.environ.get("PATH", ""), "LANG": "C.UTF-8", "HOME": str(tmp_path),
           "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_HOME": str(tmp_path / "ansible-home"), "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp")}
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-c", "local", "-i", "localhost,",
            "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra}), str(playbook)]
    return subprocess.run(argv + (["--check"] if check else []), cwd=ANSIBLE, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_typo_in_hostd_models_is_refused_by_the_roles_argument_spec(tmp_path: Path):
    """`dropin:` for `dropins:` (or `state: stoped`) used to be ignored, the
    drop-in never written; meta/argument_specs.yml makes Ansible refuse it
    before the role's first task."""
    model = {"name": "tiny", "config": {"backend": "builtin", "model": "/x"},
             "dropin": {"50-limits.yaml": {"engine": {"max_num_seqs": 4}}}, "state": "stoped"}
    done = play_locally(tmp_path, [{"ansible.builtin.include_role": {"name": "hostd"}}],
                        {"hostd_models": [model], "hostd_python": "/bin/false"})
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Validation of arguments failed" in out, out
    assert "hostd_models.dropin. Supported parameters include: config, dropins" in out, out
    assert "value of state must be one of: started, stopped, absent, got: stoped" in out, out
    assert "Install the hostd package" not in out, out


def test_every_role_variable_has_an_argument_spec():
    """What defaults/main.yml defines, meta/argument_specs.yml types."""
    defaults = yaml.safe_load((ANSIBLE / "roles/hostd/defaults/main.yml").read_text())
    specs = yaml.safe_load((ANSIBLE / "roles/hostd/meta/argument_specs.yml").read_text())["argument_specs"]
    specified = set(specs["main"]["options"]) | set(specs["reload"]["options"])
    assert set(defaults) <= specified, set(defaults) - specified


def test_ansible_lint_production_profile_is_clean(tmp_path: Path):
    """`ansible-lint --profile production` over the role and the playbooks,
    offline (no collection is fetched): what Ansible's own linter asks of a
    role others run on their hosts."""
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path),
           "ANSIBLE_HOME": str(tmp_path / "ansible-home"), "NO_COLOR": "1"}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-lint"), "--offline", "--nocolor",
                           "--profile", "production", "."], cwd=ANSIBLE, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
