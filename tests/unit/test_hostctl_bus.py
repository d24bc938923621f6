"""hostctl's commands that talk to the manager, against a fake client: `list`
shows the manager's word on a config (it reads files a user cannot), and ^C
while waiting for a reload says the reload goes on and how to cancel it."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import msgspec
import pytest

from hostd import hostctl, hostctl_bus


class FakeClient:
    """hostd.client.Client as hostctl uses it; INTERRUPT_WAIT: wait raises ^C."""

    def __init__(self, interrupt_wait: bool = False, changes: tuple = ()):
        self.interrupt_wait = interrupt_wait
        self.changes = changes  # the Operation's properties, as wait shows them before it ends (or ^C)
        self.calls: list[str] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def list_models(self) -> list[dict]:
        return [{"name": "bad", "state": "stopped", "path": "/org/hostd1/model/bad"},
                {"name": "tiny", "state": "serving", "path": "/org/hostd1/model/tiny"}]

    def gpu_memory(self, name: str):
        return []  # a model on no GPU (Model.GpuMemory)

    def config_problem(self, path: str) -> str:
        self.calls.append(f"config_problem {path}")
        if path.endswith("/bad"):
            return ("/etc/hostd/models/bad.yaml:4: engine.max_num_seqs: expected `int`, got `str`\n"
                    "/etc/hostd/models/bad.yaml:5: engine.max_model_len: expected `int`")
        return ""

    def reload(self, name: str, patch: dict, wait: bool = True, on_change=None) -> dict:
        self.calls.append(f"reload {name} {patch} wait={wait}")
        return {"path": "/org/hostd1/operation/7"}

    def wait(self, path: str, on_change=None) -> dict:
        self.calls.append(f"wait {path}")
        for change in self.changes:
            on_change(dict(change))
        if self.interrupt_wait:
            raise KeyboardInterrupt
        return {"State": "done", "Id": 7}

    def cancel(self, op_id: int) -> None:
        self.calls.append(f"cancel {op_id}")

    def set_log_level(self, name: str, role: str, level: str) -> list[dict]:
        self.calls.append(f"set_log_level {name} {role!r} {level}")
        if role == "weights":
            from dbus_fast.errors import DBusError

            raise DBusError("org.hostd1.Error.NotRunning", "model tiny has no weights process running")
        rows = [{"role": "gateway", "unit": "model@tiny.service", "pid": 101},
                {"role": "engine", "unit": "model-engine@tiny.service", "pid": 102}]
        return [r for r in rows if role in ("", r["role"])]


def test_list_shows_the_managers_config_problem_and_reads_no_file(tmp_path: Path, monkeypatch, capsys):
    client = FakeClient()
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    unreadable = tmp_path / "etc"  # nothing there: hostctl must not look
    assert hostctl.main(["--config-dir", str(unreadable), "list", "--no-legend"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["bad", "stopped", "invalid:"]
    assert lines[0].endswith("/etc/hostd/models/bad.yaml:4: engine.max_num_seqs: expected `int`, got `str`")
    assert lines[1].split() == ["tiny", "serving", "ok"]
    assert client.calls == ["config_problem /org/hostd1/model/bad", "config_problem /org/hostd1/model/tiny"]


def test_ctrl_c_while_waiting_says_the_reload_goes_on_and_how_to_cancel_it(monkeypatch, capsys):
    client = FakeClient(interrupt_wait=True)
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["reload", "tiny", "max_num_seqs=4", "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err == ("hostctl: reload 7 of tiny continues in the background; `hostctl cancel 7` cancels it "
                   "while its Cancellable property is true, `hostctl status tiny` shows how it ends\n")
    assert client.calls == ["reload tiny {'max_num_seqs': 4} wait=False", "wait /org/hostd1/operation/7"]  # no cancel


STAGES = ["validate", "preflight", "record", "rebuild", "switch", "settle", "restart", "verify", "resume",
          "commit", "finished"]


@pytest.mark.parametrize("cancellable, said", [
    (True, "`hostctl cancel 7` cancels it now"), (False, "it is past what `hostctl cancel 7` may end")])
def test_ctrl_c_says_whether_a_cancel_would_be_honoured_as_the_manager_said_last(
        cancellable, said, monkeypatch, capsys):
    """The Operation's Cancellable, not a table of hostctl's: the standby's
    rebuild is cancellable, which no "while it drains" covered."""
    stage = "rebuild" if cancellable else "settle"
    client = FakeClient(interrupt_wait=True, changes=[
        {"Id": 7, "State": "running", "Stage": stage, "Strategy": "standby", "Stages": STAGES,
         "Cancellable": cancellable}])
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["reload", "tiny", "max_num_seqs=4", "--quiet"]) == 130
    assert capsys.readouterr().err == (f"hostctl: reload 7 of tiny continues in the background; {said}, "
                                       "`hostctl status tiny` shows how it ends\n")


def test_the_progress_line_shows_the_stage_on_the_strategys_path_and_whether_it_is_cancellable():
    props = {"Id": 7, "State": "running", "Strategy": "standby", "Stages": STAGES}
    assert hostctl_bus.stage_facts({**props, "Stage": "rebuild", "Cancellable": True}) == ["4 of 11", "cancellable"]
    assert hostctl_bus.stage_facts({**props, "Stage": "settle", "Cancellable": False}) == ["6 of 11"]
    assert hostctl_bus.stage_facts({**props, "Stage": "rollback", "Cancellable": False}) == []  # off the path
    assert hostctl_bus.stage_facts({"Stage": "drain"}) == []  # an older manager, without either property
    line = hostctl_bus.Progress("tiny", stream=io.StringIO())
    line.props = {**props, "Stage": "rebuild", "Cancellable": True, "StageUSec": 0}
    assert line.line().startswith("reload 7 of tiny (strategy standby): rebuild (0.0 s, 4 of 11, cancellable)")
    assert hostctl_bus.describe_operation({"Kind": "reload", "Id": 7, **line.props}) == \
        "reload 7 running (strategy standby) (stage rebuild, 4 of 11, cancellable)"


def test_a_reload_waited_for_reports_its_end(monkeypatch, capsys):
    client = FakeClient()
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["reload", "tiny", "max_num_seqs=4", "--quiet"]) == 0
    assert capsys.readouterr().out == "reload of tiny: done\n"


def test_the_managers_words_reach_the_terminal_without_control_characters(monkeypatch, capsys):
    """Issue 52: an operation's Error (a model's own words, an engine's
    refusal) printed raw could carry escape sequences to the reader's
    terminal; hostctl writes each control character but tab and newline as
    U+FFFD."""
    client = FakeClient()
    client.wait = lambda path, on_change=None: {"State": "failed", "Id": 7,
                                                "Error": "engine refused \x1b]0;pwned\x07 \x1b[2J\x9b31m"}
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["reload", "tiny", "max_num_seqs=4", "--quiet"]) != 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "engine refused" in text and not any(c in text for c in "\x1b\x07\x9b"), repr(text)
    assert "\ufffd]0;pwned\ufffd \ufffd[2J\ufffd31m" in text


class StateClient(FakeClient):
    """A manager that answers STATE for every model."""

    def __init__(self, state: str):
        super().__init__()
        self.state = state

    def model(self, name: str) -> dict:
        return {"Name": name, "State": self.state, "Backend": "builtin", "InFlight": 0, "Config": {},
                "EditableFields": [], "LastOperation": "/"}


@pytest.mark.parametrize("state, code", [
    ("serving", 0), ("reloading", 0),
    ("engine-down", 3), ("degraded", 3), ("paused", 3), ("starting", 3), ("stopping", 3), ("stopped", 3), ("failed", 3),
    ("unknown", 3),
])
def test_is_active_and_status_exit_3_unless_the_model_serves(state, code, monkeypatch, capsys):
    """systemctl's convention, which scripts test (`hostctl is-active -q m ||
    alert`): before, `status NAME` exited 0 with the engine down or degraded."""
    monkeypatch.setattr(hostctl_bus, "_client", lambda: StateClient(state))
    assert hostctl.main(["is-active", "m"]) == code
    assert capsys.readouterr().out == f"{state}\n"
    assert hostctl.main(["is-active", "--quiet", "m"]) == code
    assert capsys.readouterr().out == ""
    assert hostctl.main(["status", "m", "--json"]) == code


def test_status_shows_why_the_socket_refuses_to_start_the_model(monkeypatch, capsys):
    """Model.StartProblem (a secrets file others can read) is the first line
    of `hostctl status NAME`, with the fix it names."""
    problem = ("/etc/hostd/models/m.yaml holds env: values or secret flags' values that are secrets and is readable by every user "
               "(mode 0644); keep it to root and the model's user: chown root:hostd-m /etc/hostd/models/m.yaml "
               "&& chmod 0640 /etc/hostd/models/m.yaml")

    class Refused(StateClient):
        def model(self, name: str) -> dict:
            return {**super().model(name), "StartProblem": problem}

    monkeypatch.setattr(hostctl_bus, "_client", lambda: Refused("stopped"))
    assert hostctl.main(["status", "m"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"   Refused: {problem}"
    monkeypatch.setattr(hostctl_bus, "_client", lambda: StateClient("stopped"))
    hostctl.main(["status", "m"])
    assert "Refused" not in capsys.readouterr().out


def test_log_level_without_a_role_goes_to_all_of_the_models_processes_and_lists_them(monkeypatch, capsys):
    client = FakeClient()
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["log-level", "tiny", "debug"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "ROLE     UNIT                       PID  LEVEL",
        "gateway  model@tiny.service         101  debug",
        "engine   model-engine@tiny.service  102  debug",
        "",
        "2 listed.",
    ]
    assert client.calls == ["set_log_level tiny '' debug"]


def test_log_level_with_a_role_goes_to_it_alone_and_prints_json(monkeypatch, capsys):
    client = FakeClient()
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["log-level", "tiny", "engine", "warning", "--json=short"]) == 0
    assert capsys.readouterr().out == ('{"command":"log-level","data":[{"level":"warning","pid":102,"role":"engine",'
                                       '"unit":"model-engine@tiny.service"}],"ok":true,"version":1}\n')
    assert client.calls == ["set_log_level tiny 'engine' warning"]


@pytest.mark.parametrize("argv", [["tiny", "loud"], ["tiny", "proxy", "debug"], ["tiny"], ["tiny", "engine"],
                                  ["tiny", "engine", "debug", "extra"]])
def test_log_level_refuses_a_level_or_role_of_its_own_before_asking_the_manager(argv, monkeypatch, capsys):
    client = FakeClient()
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    with pytest.raises(SystemExit) as usage:
        hostctl.main(["log-level", *argv])
    assert usage.value.code == 2 and client.calls == []
    assert "error:" in capsys.readouterr().err


def test_log_level_of_a_role_with_nothing_running_exits_3_with_the_managers_line(monkeypatch, capsys):
    monkeypatch.setattr(hostctl_bus, "_client", lambda: FakeClient())
    assert hostctl.main(["log-level", "tiny", "weights", "info"]) == 3
    assert capsys.readouterr().err == "hostctl: NotRunning: model tiny has no weights process running\n"


def test_the_man_page_documents_log_level_and_that_a_restart_reads_hostd_yaml_again():
    from hostd import manpages

    page = manpages.hostctl_page().replace("\\-", "-")
    assert "COMMAND 'hostctl log-level'" in page.replace("\\fI\\,", "").replace("\\/\\fR", "")
    assert "NAME [ROLE] LEVEL" in page and "gateway, engine (every engine slot), weights or manager" in page
    assert "hostd.yaml's log_level" in page.replace("\n", " ")


# ---------------------------------------------------------------- systemctl's verbs (issue 55, item 2)


@pytest.mark.parametrize("state, code", [("failed", 0), ("serving", 1), ("engine-down", 1), ("stopped", 1)])
def test_is_failed_prints_the_state_and_exits_0_only_when_the_model_failed(state, code, monkeypatch, capsys):
    monkeypatch.setattr(hostctl_bus, "_client", lambda: StateClient(state))
    assert hostctl.main(["is-failed", "m"]) == code
    assert capsys.readouterr().out == f"{state}\n"
    assert hostctl.main(["is-failed", "-q", "m"]) == code
    assert capsys.readouterr().out == ""


class PropertiesClient(StateClient):
    def model_properties(self, name: str) -> dict:
        return {"Name": name, "State": "serving", "InFlight": 3, "WeightsRetained": True, "Standby": False,
                "Units": ["model@m.service", "model-engine@m.service"], "Config": '{"engine": {"max_num_seqs": 4}}',
                "GpuMemory": [[0, 100, 200]], "EngineStatus": "serving: 0 running"}


def test_show_prints_the_models_properties_as_systemctl_show_does(monkeypatch, capsys):
    monkeypatch.setattr(hostctl_bus, "_client", lambda: PropertiesClient("serving"))
    assert hostctl.main(["show", "m"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        'Config={"engine": {"max_num_seqs": 4}}', "EngineStatus=serving: 0 running", "GpuMemory=[[0,100,200]]",
        "InFlight=3", "Name=m", "Standby=no", "State=serving", "Units=model@m.service model-engine@m.service",
        "WeightsRetained=yes"]
    assert hostctl.main(["show", "m", "-p", "State", "--value"]) == 0
    assert capsys.readouterr().out == "serving\n"
    # Repeated or comma-separated; a property the model lacks prints nothing (systemctl's way).
    assert hostctl.main(["show", "m", "-p", "InFlight,Bogus", "-p", "Standby"]) == 0
    assert capsys.readouterr().out == "InFlight=3\nStandby=no\n"
    assert hostctl.main(["show", "m", "-p", "Units", "--json=short"]) == 0
    assert json.loads(capsys.readouterr().out) == {"version": 1, "command": "show", "ok": True,
                                                   "data": {"units": ["model@m.service", "model-engine@m.service"]}}


class VerbClient(StateClient):
    def __init__(self, state: str, ends: str = "done"):
        super().__init__(state)
        self.ends, self.calls, self.statuses = ends, [], []

    def _verb(self, verb: str, name: str, wait: bool, on_change=None) -> dict:
        self.calls.append(f"{verb} {name} wait={wait}")
        for status in (self.statuses if wait else ()):
            on_change({"EngineStatus": status})
        path = {"path": "/org/hostd1/operation/9"}
        return path if not wait else {**path, "State": self.ends, "Error": "" if self.ends == "done" else "it broke",
                                      "Notes": ["revert removed /etc/hostd/models/m.d/99-rollback.yaml"]}

    def start(self, name: str, wait: bool = True, on_change=None) -> dict:
        return self._verb("start", name, wait, on_change)

    def revert(self, name: str, wait: bool = True, on_change=None) -> dict:
        return self._verb("revert", name, wait, on_change)


def test_no_block_asks_and_returns_and_revert_says_what_it_removed(monkeypatch, capsys):
    client = VerbClient("stopped")
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["start", "--no-block", "m"]) == 0
    assert capsys.readouterr().out == ""  # as systemctl --no-block: nothing to say
    assert hostctl.main(["revert", "m"]) == 0
    assert capsys.readouterr().out == "revert m: done; revert removed /etc/hostd/models/m.d/99-rollback.yaml\n"
    assert client.calls == ["start m wait=False", "revert m wait=True"]
    client.ends = "rolled-back"
    assert hostctl.main(["revert", "m"]) == 1
    assert capsys.readouterr().err.startswith("revert m: rolled-back: it broke")


# ---------------------------------------------------------------- one JSON shape (issue 55, item 2)


class EveryVerbClient(VerbClient):
    """Answers every call a --json command makes."""

    def operations(self) -> list[dict]:
        return [{"id": 9, "model": "m", "kind": "reload", "state": "done", "stage": "finished",
                 "path": "/org/hostd1/operation/9"}]

    def check_reload(self, name: str, patch: dict) -> dict:
        return {"model": name, "outcome": "reload", "strategy": "restart", "reason": "reload.strategy is restart",
                "changes": {"max_num_seqs": {"old": 4, "new": 5}}, "notes": []}

    def reload(self, name: str, patch: dict, wait: bool = True, on_change=None) -> dict:
        return {"path": "/org/hostd1/operation/9"}

    def wait(self, path: str, on_change=None) -> dict:
        return {"State": "done", "Id": 9, "Strategy": "restart", "WeightsReused": True, "CreatedUSec": 1,
                "FinishedUSec": 2, "Error": "", "Notes": []}

    def stop(self, name: str, wait: bool = True, on_change=None) -> dict:
        return self._verb("stop", name, wait, on_change)

    def restart(self, name: str, wait: bool = True, on_change=None) -> dict:
        return self._verb("restart", name, wait, on_change)

    def operation(self, path: str) -> dict:
        return {"Id": 9, "Kind": "reload", "State": "done", "Stage": "finished", "Strategy": "restart",
                "Error": "", "WeightsReused": True, "CreatedUSec": 1, "FinishedUSec": 2, "Stages": [],
                "Cancellable": False}

    def model(self, name: str) -> dict:
        return {**super().model(name), "LastOperation": "/org/hostd1/operation/9", "EnginePID": 102}


SNAKE = re.compile(r"[a-z][a-z0-9_.]*")  # config's keys are dotted YAML paths


@pytest.mark.parametrize("argv", [
    ["list"], ["status"], ["status", "m"], ["operations"], ["reload", "m", "max_num_seqs=5"],
    ["reload", "--check", "m", "max_num_seqs=5"], ["start", "m"], ["stop", "--no-block", "m"], ["restart", "m"],
    ["revert", "m"], ["log-level", "m", "debug"], ["show", "m"], ["show", "m", "-p", "State"],
    ["config", "tiny"], ["config", "--check"],
])
@pytest.mark.parametrize("mode", ["short", "pretty"])
def test_every_json_output_is_one_versioned_document_with_snake_case_keys(argv, mode, tmp_path, monkeypatch, capsys):
    """Every `--json` command prints hostctl_output.JsonDocument (version 1:
    version, command, ok, data), and the keys of its data (and of each item
    of a list) are snake_case; `logs --json` is journalctl's own and not here."""
    from hostd.hostctl_output import JSON_VERSION, JsonDocument

    (tmp_path / "models/tiny.d").mkdir(parents=True)
    (tmp_path / "models/tiny.yaml").write_text("backend: builtin\nmodel: /srv/tiny\nengine: {max_num_seqs: 3}\n")
    monkeypatch.setattr(hostctl_bus, "_client", lambda: PropertiesClient("serving") if argv[0] == "show"
                        else EveryVerbClient("serving"))
    code = hostctl.main([f"--json={mode}", "--config-dir", str(tmp_path), *argv])
    out = capsys.readouterr().out
    document = msgspec.json.decode(out.encode(), type=JsonDocument)
    assert (document.version, document.command, document.ok) == (JSON_VERSION, argv[0], code == 0), out
    rows = document.data if isinstance(document.data, list) else [document.data]
    for row in rows:
        assert isinstance(row, dict) and all(SNAKE.fullmatch(key) for key in row), (argv, row)
    if argv == ["status", "m"]:
        assert all(SNAKE.fullmatch(key) for key in document.data["last_operation"]), document.data


def test_start_shows_the_engines_status_lines_while_it_waits(monkeypatch, capsys):
    """Issue 55, item 4: `hostctl start` prints each new STATUS= of the engine
    it waits on (upstream's start phases, relayed by the supervisor), once."""
    client = VerbClient("stopped")
    client.statuses = ["vllm engine starting on weights pid 7", "vllm starting: Loading safetensors checkpoint shards: 1/2",
                       "vllm starting: Loading safetensors checkpoint shards: 1/2", "serving tiny (vllm)"]
    monkeypatch.setattr(hostctl_bus, "_client", lambda: client)
    assert hostctl.main(["start", "m"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["start m: engine: vllm engine starting on weights pid 7",
                   "start m: engine: vllm starting: Loading safetensors checkpoint shards: 1/2",
                   "start m: engine: serving tiny (vllm)"]
    assert hostctl.main(["start", "m", "--json=short"]) == 0
    assert capsys.readouterr().err == ""


def test_status_names_each_gpu_by_its_uuid_as_dcgm_exporter_does(monkeypatch, capsys):
    """Issue 55, item 3: status's GPUs row and --json carry Model.GpuMemory's
    index, UUID and MIG UUID (the slice's, when the model is on one)."""
    gib = 1 << 30
    gpus = [{"index": 1, "uuid": "GPU-8f3e0000-0000-4000-8000-000000000001",
             "mig_uuid": "MIG-5a1b2c3d-0000-4000-8000-00000000abcd",
             "total": 20 * gib, "free": 5 * gib, "engine": 3 * gib, "weights": 2 * gib}]

    class OnMig(StateClient):
        def gpu_memory(self, name: str):
            return gpus

    monkeypatch.setattr(hostctl_bus, "_client", lambda: OnMig("serving"))
    assert hostctl.main(["status", "m"]) == 0
    out = capsys.readouterr().out
    assert "      GPUs: 1 MIG-5a1b2c3d-0000-4000-8000-00000000abcd: engine 3072 MiB, weights 2048 MiB, " \
           "free 5120 of 20480 MiB" in out, out
    assert hostctl.main(["status", "m", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["data"]["gpus"] == gpus
