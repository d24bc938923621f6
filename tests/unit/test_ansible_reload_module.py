"""packaging/ansible's hostd_reload module: what each end of a reload makes of
the task, with a stand-in hostctl that answers as the real one does (its
--json=short output and exit codes, hostd/hostctl.py) and logs its calls.

The module runs as Ansible runs it on a host: its own process, the arguments
in a JSON file, the result as JSON on stdout. The playbooks against real
hosts are tests/system/test_ansible.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "packaging/ansible/roles/hostd/library/hostd_reload.py"

FAKE_HOSTCTL = """#!/bin/sh
echo "$*" >> {log}
case "$1 $2" in
"status "*) cat {status}; exit $(cat {status_rc}) ;;
"reload --check") cat {verdict}; exit $(cat {verdict_rc}) ;;
"reload "*) cat {reload} ; cat {reload_err} >&2; exit $(cat {reload_rc}) ;;
esac
exit 2
"""


def document(command: str, ok: bool, data: dict) -> str:
    """hostctl's --json document (hostd/hostctl_output.py, JSON_VERSION 1)."""
    return json.dumps({"version": 1, "command": command, "ok": ok, "data": data})


@pytest.fixture
def hostctl(tmp_path: Path):
    """A stand-in hostctl; .answer(...) sets what status and reload print."""
    files = {k: tmp_path / k for k in ("log", "status", "status_rc", "reload", "reload_err", "reload_rc",
                                                "verdict", "verdict_rc")}
    script = tmp_path / "hostctl"
    script.write_text(FAKE_HOSTCTL.format(**files))
    script.chmod(0o755)
    files["log"].write_text("")

    class Hostctl:
        path = str(script)

        def answer(self, *, state="serving", status_rc=0, reload=None, reload_rc=0, reload_err="",
                   verdict=None, verdict_rc=0):
            files["status"].write_text(document("status", status_rc == 0,
                                                {"state": state, "engine": {"max_model_len": None}}))
            files["verdict"].write_text(document("reload", verdict_rc == 0, verdict) if verdict is not None else "")
            files["verdict_rc"].write_text(str(verdict_rc))
            files["status_rc"].write_text(str(status_rc))
            files["reload"].write_text(document("reload", reload_rc == 0, reload) if reload is not None else "")
            files["reload_rc"].write_text(str(reload_rc))
            files["reload_err"].write_text(reload_err)

        def calls(self) -> list[str]:
            return files["log"].read_text().splitlines()

    return Hostctl()


def run_module(tmp_path: Path, hostctl, *, check: bool = False, **args) -> dict:
    params = {"name": "tiny", "set": {"max_model_len": 384}, "hostctl": hostctl.path, **args}
    if check:
        params["_ansible_check_mode"] = True
    (tmp_path / "args.json").write_text(json.dumps({"ANSIBLE_MODULE_ARGS": params}))
    proc = subprocess.run([sys.executable, str(MODULE), str(tmp_path / "args.json")],
                          capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout)


def test_a_reload_that_ends_done_is_changed_and_passes_typed_values(tmp_path, hostctl):
    hostctl.answer(reload={"state": "done", "strategy": "overlap", "error": "", "notes": []})
    result = run_module(tmp_path, hostctl)
    assert result["changed"] is True and not result.get("failed"), result
    assert result["msg"] == "tiny: reload done (strategy overlap)"
    assert hostctl.calls() == ["status tiny --json=short", "reload tiny max_model_len=384 --json=short"]


def test_a_reload_the_manager_finds_unchanged_is_ok_not_changed(tmp_path, hostctl):
    hostctl.answer(reload={"state": "unchanged", "strategy": "", "error": "", "notes": []})
    result = run_module(tmp_path, hostctl)
    assert result["changed"] is False and not result.get("failed"), result
    assert result["msg"] == "tiny: reload unchanged"


@pytest.mark.parametrize("state", ["rolled-back", "failed", "cancelled"])
def test_a_reload_that_does_not_end_done_or_unchanged_fails_the_task_with_its_error(tmp_path, hostctl, state):
    hostctl.answer(reload={"state": state, "strategy": "overlap", "error": "engine refused"}, reload_rc=1)
    result = run_module(tmp_path, hostctl)
    assert result["failed"] is True and result["state"] == state, result
    assert result["msg"] == f"tiny: reload {state} (strategy overlap): engine refused"


def test_a_refused_reload_fails_the_task_with_hostctls_line(tmp_path, hostctl):
    hostctl.answer(reload_rc=1, reload_err="hostctl: InvalidArgs: engine.max_model_len: expected `int` >= 1")
    result = run_module(tmp_path, hostctl)
    assert result["failed"] is True and result["state"] == "refused", result
    assert "InvalidArgs: engine.max_model_len" in result["msg"]


def test_a_model_that_does_not_serve_is_not_reloaded(tmp_path, hostctl):
    hostctl.answer(state="stopped", status_rc=3)
    result = run_module(tmp_path, hostctl)
    assert result["failed"] is True, result
    assert result["msg"] == "model tiny does not serve here (state stopped): not reloaded; start it first (hostctl start tiny)"
    assert hostctl.calls() == ["status tiny --json=short"]


def test_check_mode_reports_the_managers_verdict_and_calls_no_reload(tmp_path, hostctl):
    hostctl.answer(verdict={"outcome": "reload", "strategy": "overlap", "reason": "a second engine fits",
                            "changes": {"max_model_len": {"old": None, "new": 384}}, "notes": []})
    result = run_module(tmp_path, hostctl, check=True)
    assert result["changed"] is True and result["state"] == "would-reload", result
    assert result["changes"] == {"max_model_len": {"now": None, "then": 384}}
    assert result["msg"] == "tiny: would reload max_model_len None -> 384 (strategy overlap: a second engine fits)"
    assert hostctl.calls() == ["status tiny --json=short", "reload --check tiny max_model_len=384 --json=short"]


def test_check_mode_of_limits_the_engine_runs_already_is_ok(tmp_path, hostctl):
    hostctl.answer(verdict={"outcome": "unchanged", "reason": "the engine runs these limits already",
                            "changes": {}})
    result = run_module(tmp_path, hostctl, check=True)
    assert result["changed"] is False and not result.get("failed"), result


def test_check_mode_fails_on_a_reload_the_manager_would_refuse(tmp_path, hostctl):
    hostctl.answer(verdict={"outcome": "refused", "message": "engine.max_num_seqs: expected `int` >= 1"},
                   verdict_rc=1)
    result = run_module(tmp_path, hostctl, check=True)
    assert result["failed"] is True and "would be refused" in result["msg"], result
    assert "engine.max_num_seqs: expected `int` >= 1" in result["msg"]


def test_an_empty_set_is_refused(tmp_path, hostctl):
    hostctl.answer()
    result = run_module(tmp_path, hostctl, set={})
    assert result["failed"] is True and "set: give at least one engine key" in result["msg"], result
    assert hostctl.calls() == []


def test_ansible_doc_reads_the_modules_documentation_examples_and_return(tmp_path):
    """`ansible-doc -M LIBRARY hostd_reload` is how an operator reads the
    module; DOCUMENTATION, EXAMPLES and RETURN must be YAML it parses (an
    unquoted `engine:` inside a description once made it refuse the module)."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(tmp_path), "ANSIBLE_HOME": str(tmp_path / "ah")}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-doc"), "--json", "-M", str(MODULE.parent),
                           "hostd_reload"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)["hostd_reload"]
    assert set(doc["doc"]["options"]) == {"name", "set", "hostctl"}, doc["doc"]["options"]
    assert doc["doc"]["options"]["set"]["type"] == "dict" and doc["doc"]["options"]["name"]["required"] is True
    assert "hostd_reload:" in doc["examples"]
    assert {"msg", "state", "strategy", "error", "changes"} <= set(doc["return"]), doc["return"]


def test_a_hostctl_of_another_json_version_is_not_read(tmp_path, hostctl):
    """The module reads hostctl's JSON version 1 only: another version's
    document fails the task rather than being misread."""
    hostctl.answer()
    (Path(hostctl.path).parent / "status").write_text(json.dumps({"version": 2, "command": "status", "ok": True,
                                                                   "data": {"state": "serving"}}))
    result = run_module(tmp_path, hostctl)
    assert result["failed"] is True and "hostctl status tiny failed" in result["msg"], result
