"""`hostctl reload --check NAME KEY=VALUE...` against a fake client: the
arguments become the patch the manager's CheckReloadJSON is asked about and
never a reload; the answer prints as old -> new and the strategy with its
reason (or unchanged), and --json prints it whole; a refusal exits as the
reload's would (1, 3 not running, 4 no such model) with its one line, and
with --json also as JSON on stdout, for Ansible's and Salt's check modes."""

from __future__ import annotations

import json

import pytest
from dbus_fast.errors import DBusError

from hostd import hostctl, hostctl_bus

WOULD = {"model": "tiny", "outcome": "reload", "patch": {"max_num_seqs": 8, "max_model_len": None},
         "changes": {"max_model_len": {"old": 256, "new": None}, "max_num_seqs": {"old": 4, "new": 8}},
         "strategy": "restart", "reason": "overlap does not fit, falling back to restart: no room",
         "notes": ["strategy restart: overlap does not fit, falling back to restart: no room"],
         "weights_not_retained": ""}
UNCHANGED = {**WOULD, "outcome": "unchanged", "changes": {}, "strategy": "", "notes": [],
             "reason": "the engine runs this config already: a reload would restart nothing"}


class CheckClient:
    """hostd.client.Client as `reload --check` uses it: only check_reload."""

    def __init__(self, answer=None, refusal: DBusError | None = None):
        self.answer, self.refusal = answer, refusal
        self.calls: list[tuple[str, dict]] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def check_reload(self, name: str, patch: dict) -> dict:
        self.calls.append((name, patch))
        if self.refusal is not None:
            raise self.refusal
        return self.answer

    def __getattr__(self, name):  # reload, wait, ...: a check must call none of them
        raise AssertionError(f"reload --check called {name}")


@pytest.fixture
def client(monkeypatch):
    def install(**kwargs) -> CheckClient:
        fake = CheckClient(**kwargs)
        monkeypatch.setattr(hostctl_bus, "_client", lambda: fake)
        return fake
    return install


def test_a_check_prints_old_to_new_and_the_strategy_and_why(client, capsys):
    fake = client(answer=WOULD)
    assert hostctl.main(["reload", "--check", "tiny", "max_num_seqs=8", "max_model_len=null"]) == 0
    assert fake.calls == [("tiny", {"max_num_seqs": 8, "max_model_len": None})]  # YAML scalars, as reload's
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out == (
        "reload of tiny would apply 2 changes (strategy restart: overlap does not fit, falling back to restart: "
        "no room)\n"
        "  max_model_len: 256 -> null\n"
        "  max_num_seqs: 4 -> 8\n"
        "  note: strategy restart: overlap does not fit, falling back to restart: no room\n")


def test_a_check_says_when_the_weights_would_load_from_disk(client, capsys):
    client(answer={**WOULD, "weights_not_retained": "device: cpu; the weight cache holds CUDA tensors only"})
    assert hostctl.main(["reload", "tiny", "max_num_seqs=8", "--check"]) == 0
    assert ("  weights: not retained (device: cpu; the weight cache holds CUDA tensors only): "
            "the engine would load them from disk\n") in capsys.readouterr().out


def test_an_unchanged_check_says_unchanged_and_exits_0(client, capsys):
    client(answer=UNCHANGED)
    assert hostctl.main(["reload", "--check", "tiny", "max_num_seqs=4"]) == 0
    assert capsys.readouterr().out == ("reload of tiny would be unchanged: the engine runs this config already: "
                                       "a reload would restart nothing\n")


@pytest.mark.parametrize("mode", ["short", "pretty"])
def test_json_is_the_managers_answer_in_hostctls_document(client, capsys, mode):
    client(answer=WOULD)
    assert hostctl.main([f"--json={mode}", "reload", "--check", "tiny", "max_num_seqs=8"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == {"version": 1, "command": "reload", "ok": True, "data": WOULD}
    assert (out.count("\n") == 1) == (mode == "short")


@pytest.mark.parametrize("error, code", [
    ("org.hostd1.Error.InvalidValue", 1), ("org.hostd1.Error.NotEditable", 1), ("org.hostd1.Error.Busy", 1),
    ("org.hostd1.Error.InsufficientMemory", 1), ("org.hostd1.Error.NotRunning", 3),
    ("org.hostd1.Error.NoSuchModel", 4),
])
def test_a_refusal_exits_as_the_reload_would_with_its_message(client, capsys, error, code):
    message = "engine.max_num_seqs: expected `int` >= 1"
    client(refusal=DBusError(error, message))
    assert hostctl.main(["reload", "--check", "tiny", "max_num_seqs=0"]) == code
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"hostctl: {error.rsplit('.', 1)[1]}: {message}\n"
    assert hostctl.main(["reload", "--check", "tiny", "max_num_seqs=0", "--json=short"]) == code
    out = capsys.readouterr()
    assert json.loads(out.out) == {"version": 1, "command": "reload", "ok": False, "data": {
        "model": "tiny", "outcome": "refused", "patch": {"max_num_seqs": 0}, "error": error, "message": message}}
    assert out.err == f"hostctl: {error.rsplit('.', 1)[1]}: {message}\n"  # the one line as well


def test_check_and_no_wait_is_a_usage_error_and_asks_nothing(client, capsys):
    fake = client(answer=WOULD)
    assert hostctl.main(["reload", "--check", "--no-wait", "tiny", "max_num_seqs=8"]) == 2
    assert "--check changes nothing" in capsys.readouterr().err
    assert fake.calls == []


def test_a_word_that_is_no_assignment_is_refused_before_asking(client, capsys):
    fake = client(answer=WOULD)
    with pytest.raises(SystemExit) as refused:
        hostctl.main(["reload", "--check", "tiny", "max_num_seqs"])
    assert str(refused.value) == "hostctl: 'max_num_seqs' is not KEY=VALUE"
    assert fake.calls == []


def test_the_man_page_documents_check():
    from hostd import manpages

    page = manpages.hostctl_page()
    assert "\\-\\-check" in page and "strategy that would run" in page
