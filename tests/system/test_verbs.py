"""What each systemctl verb does to a client, under a real systemd 252.

A client polls the model's public address every 20 ms, each request on a new
connection (as a load balancer's health check does), while an administrator
types one verb. What the client may see is pinned per verb, as
docs/operations.md promises it: during restarts connections wait at the
public socket or get 503 + Retry-After, never a reset or a refusal; only a
full stop closes the socket. Also here: the manager is started on demand
(D-Bus activation), so `systemctl reload` and hostctl work right after
install with nothing started by hand.

One container for the module, set up as test_model_units does.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter

import httpx
import pytest

from container import SystemdContainer, wait_for
from test_model_units import greedy, host, main_pid, status_code  # noqa: F401 (host: the module's container, set up alike)

POLL_S = 0.02


class Poller:
    """GET /v1/models every 20 ms on a fresh connection; records what came back:
    the status code, or 'refused' / 'reset' / 'timeout' / the error's name."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _once(self, http: httpx.Client) -> str:
        try:
            return str(http.get(self.url).status_code)
        except httpx.ConnectError as exc:
            return "refused" if "refused" in str(exc).lower() else "reset" if "reset" in str(exc).lower() else f"connect-error: {exc}"
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            return "reset" if "reset" in str(exc).lower() or isinstance(exc, httpx.RemoteProtocolError) else f"error: {exc!r}"
        except httpx.TimeoutException:
            return "timeout"

    def _run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=120, limits=limits) as http:
            while not self._stop.is_set():
                self.seen.append((time.monotonic(), self._once(http)))
                time.sleep(POLL_S)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=150)

    @property
    def outcomes(self) -> Counter:
        return Counter(outcome for _, outcome in self.seen)

    def last(self) -> str:
        return self.seen[-1][1] if self.seen else ""


def serving(host: SystemdContainer) -> None:
    host.systemctl("start", "model@tiny.service", timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving")


def during(host: SystemdContainer, *command: str, settle: float = 0.5) -> Poller:
    """Run COMMAND in the container while a client polls; return once the client
    sees 200 again (or, for a stop, right after the command)."""
    with Poller(host.base_url + "/v1/models") as poller:
        time.sleep(0.3)
        started = time.monotonic()
        host.run(list(command), timeout=300)
        if command[:2] != ("systemctl", "stop"):
            wait_for(lambda: poller.last() == "200" and poller.seen[-1][0] > started, timeout=180,
                     what=f"serving again after {' '.join(command)}")
        time.sleep(settle)
    print(f"{' '.join(command)}: {dict(poller.outcomes)}")
    return poller


def test_the_manager_starts_on_demand_for_systemctl_reload_and_hostctl(host):
    serving(host)
    # Whatever ran before in this container (a module order, a -k selection),
    # the manager is not running now: only D-Bus activation can start it.
    host.systemctl("stop", "hostd.service", timeout=120)
    assert host.systemctl("is-active", "hostd.service", check=False).stdout.strip() == "inactive"
    poller = during(host, "systemctl", "reload", "model@tiny.service")
    assert set(poller.outcomes) <= {"200", "503"}, poller.outcomes
    assert host.systemctl("is-active", "hostd.service", check=False).stdout.strip() == "active"
    listed = host.run(["hostctl", "list"]).stdout  # on root's PATH after `hostd install`
    assert "tiny" in listed


@pytest.mark.parametrize("unit", ["model-engine@tiny.service", "model-weights@tiny.service", "model@tiny.service"])
def test_restart_never_resets_a_connection_at_the_public_socket(host, unit):
    serving(host)
    poller = during(host, "systemctl", "restart", unit)
    # Waiting at the socket shows up as a slow 200; 503 is the gateway's answer
    # while the engine is away; nothing else is allowed.
    assert set(poller.outcomes) <= {"200", "503"}, poller.outcomes
    assert poller.outcomes["200"] > 0


def test_stop_closes_the_public_socket_and_start_opens_it(host):
    serving(host)
    host.run(["systemctl", "stop", "model@tiny.service"], timeout=300)
    # systemctl 252 may still warn that the socket "can still be activated": it
    # looks before the socket's own stop job has run (the socket stops after the
    # engine and the weights, which need its runtime directory). It does stop:
    wait_for(lambda: host.systemctl("is-active", "model@tiny.socket", check=False).stdout.strip() == "inactive",
             timeout=120, what="the socket stopped")
    with pytest.raises(httpx.ConnectError, match="refused"):
        httpx.get(host.base_url + "/v1/models", timeout=10)
    poller = during(host, "systemctl", "start", "model@tiny.service")
    assert set(poller.outcomes) <= {"200", "503", "refused"}, poller.outcomes


def test_a_crashed_gateway_leaves_the_socket_listening_and_comes_back_on_the_next_connection(host):
    serving(host)
    listening = host.systemctl("show", "-p", "ActiveEnterTimestampMonotonic", "model@tiny.socket").stdout
    engine = host.systemctl("show", "-p", "MainPID", "--value", "model-engine@tiny.service").stdout
    gateway = host.systemctl("show", "-p", "MainPID", "--value", "model@tiny.service").stdout.strip()
    host.run(["kill", "-9", gateway])
    wait_for(lambda: host.systemctl("is-failed", "model@tiny.service", check=False).stdout.strip() == "failed",
             timeout=30, what="the gateway dead")
    # This connection waits at the socket, which starts the gateway again; the
    # new gateway may answer 503 until it has found the engine.
    assert httpx.get(host.base_url + "/v1/models", timeout=120).status_code in (200, 503)
    wait_for(lambda: status_code(host) == 200, timeout=60, what="serving again")
    assert host.systemctl("show", "-p", "ActiveEnterTimestampMonotonic", "model@tiny.socket").stdout == listening
    assert host.systemctl("show", "-p", "MainPID", "--value", "model-engine@tiny.service").stdout == engine


# ---------------------------------------------------------------- hostctl, as systemctl is used


def hostctl(host: SystemdContainer, *args: str):
    return host.run(["hostctl", *args], check=False, timeout=300)


def test_hostctl_status_overview_detail_json_and_exit_codes(host):
    serving(host)
    host.run(["hostctl", "reload", "tiny", "max_num_seqs=3"], timeout=300)  # a last operation to show

    overview = hostctl(host, "status")
    assert overview.returncode == 0, overview.stderr
    header, row = overview.stdout.splitlines()[:2]
    assert header.split()[:4] == ["MODEL", "STATE", "BACKEND", "LISTEN"]
    assert row.split()[:4] == ["tiny", "serving", "builtin", host.base_url.removeprefix("http://")]
    assert "reload" in row and "done" in row and "yes" in row.split()  # weights retained
    assert hostctl(host, "status", "--no-legend").stdout.splitlines()[0].startswith("tiny ")

    detail = hostctl(host, "status", "tiny")
    assert detail.returncode == 0 and detail.stdout.startswith("● tiny - builtin model, serving")
    weights_pid = host.systemctl("show", "-p", "MainPID", "--value", "model-weights@tiny.service").stdout.strip()
    assert f"Weights: retained by PID {weights_pid}" in detail.stdout

    document = json.loads(hostctl(host, "status", "tiny", "--json=pretty").stdout)
    assert (document["version"], document["command"], document["ok"]) == (1, "status", True)
    data = document["data"]
    assert data["weights_pid"] == int(weights_pid) and data["weights_retained"] is True
    assert data["engine"]["max_num_seqs"] == 3 and data["last_operation"]["state"] == "done"
    assert set(data["units"]) >= {"model@tiny.service", "model-engine@tiny.service", "model-weights@tiny.service"}
    short = hostctl(host, "--json=short", "list").stdout
    assert short.count("\n") == 1
    assert json.loads(short) == {"version": 1, "command": "list", "ok": True,
                                  "data": [{"name": "tiny", "state": "serving", "config_problem": ""}]}

    # The model's D-Bus object tells a script the same without hostctl.
    props = host.busctl_json("get-property", "org.hostd1", "/org/hostd1/model/tiny", "org.hostd1.Model",
                             "WeightsPID")
    assert props["data"] == int(weights_pid)

    # A model whose YAML does not load is listed with the reason.
    host.write_file("/etc/hostd/models/bad.yaml", "backend: builtin\nmodel: /m\nengine:\n  max_num_seqs: lots\n")
    try:
        listed = hostctl(host, "list").stdout
        assert re.search(r"^bad\s+\S+\s+invalid: /etc/hostd/models/bad.yaml:4: engine.max_num_seqs: expected `int`",
                         listed, re.M), listed
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/bad.yaml"])

    missing = hostctl(host, "status", "ghost")
    assert missing.returncode == 4 and missing.stderr.count("\n") == 1 and "NoSuchModel" in missing.stderr
    active = hostctl(host, "is-active", "tiny")
    assert (active.returncode, active.stdout) == (0, "serving\n"), active
    assert hostctl(host, "is-active", "ghost").returncode == 4
    host.systemctl("stop", "model@tiny.service", timeout=300)
    stopped = hostctl(host, "status", "tiny")
    assert stopped.returncode == 3 and stopped.stdout.startswith("○ tiny")
    inactive = hostctl(host, "is-active", "-q", "tiny")
    assert (inactive.returncode, inactive.stdout) == (3, ""), inactive


def test_hostctl_reload_shows_each_stage_with_elapsed_time_and_the_engine_status(host):
    serving(host)
    # The restart strategy's stages (drain, restart with the engine's status).
    host.run(["mkdir", "-p", "/etc/hostd/models/tiny.d"])
    host.write_file("/etc/hostd/models/tiny.d/40-strategy.yaml", "reload:\n  strategy: restart\n")
    result = host.run(["hostctl", "reload", "tiny", "max_num_seqs=5"], timeout=300)
    print(result.stderr + result.stdout)
    stages = [line for line in result.stderr.splitlines() if line.startswith("reload ")]
    assert any(": drain (" in line for line in stages) and any(": verify (" in line for line in stages)
    assert any(", engine: " in line for line in stages if ": restart (" in line), stages
    assert re.search(r"reload of tiny: done \((strategy restart, )?weights reused\) in \d+\.\d s", result.stdout)


def model_files(host: SystemdContainer) -> str:
    """Every file of the model's drop-ins and the manager's records, with its
    content digest and mtime: what a reload writes."""
    return host.sh("find /etc/hostd/models /var/lib/hostd/.manager -type f -printf '%p %T@ ' "
                   "-exec sha256sum {} \\; | sort").stdout


def test_hostctl_reload_check_says_what_would_change_and_changes_nothing(host):
    """`hostctl reload --check` (Ansible's and Salt's check mode): the diff and
    the strategy, for any user, and nothing written, restarted or recorded;
    a value out of range is refused naming its key, as the reload refuses it."""
    serving(host)
    host.write_file("/etc/hostd/models/tiny.d/40-strategy.yaml", "reload:\n  strategy: restart\n")
    host.systemctl("reload", "model@tiny.service", timeout=300)  # the engine runs the disk's config
    running = json.loads(hostctl(host, "status", "tiny", "--json").stdout)["data"]["engine"]["max_num_seqs"]
    files = model_files(host)
    engine_pid = host.systemctl("show", "-p", "MainPID", "--value", "model-engine@tiny.service").stdout
    operations = json.loads(hostctl(host, "operations", "--json").stdout)

    # Read-only: any user may ask (no polkit), through hostctl as through busctl.
    nobody = host.run(["setpriv", "--reuid=nobody", f"--regid={host.run(['id', '-g', 'nobody']).stdout.strip()}",
                       "--clear-groups", host.python, "-m", "hostd.hostctl", "reload", "--check", "tiny",
                       f"max_num_seqs={running + 1}"], check=False, timeout=300)
    assert nobody.returncode == 0, nobody.stderr
    assert nobody.stdout.splitlines() == [
        "reload of tiny would apply 1 change (strategy restart: reload.strategy is restart)",
        f"  max_num_seqs: {running} -> {running + 1}",
    ], nobody.stdout
    checked = json.loads(hostctl(host, "reload", "--check", "tiny", f"max_num_seqs={running + 1}",
                                 "--json=short").stdout)
    assert checked["ok"] is True
    checked = checked["data"]
    assert checked["outcome"] == "reload" and checked["strategy"] == "restart"
    assert checked["changes"] == {"max_num_seqs": {"old": running, "new": running + 1}}
    [answer] = host.busctl_json("call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "CheckReload",
                                "sa{sv}", "tiny", "1", "max_num_seqs", "u", str(running + 1))["data"]
    assert json.loads(answer) == checked

    refused = hostctl(host, "reload", "--check", "tiny", "max_num_seqs=0")
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == "hostctl: InvalidValue: engine.max_num_seqs: expected `int` >= 1\n", refused.stderr

    unchanged = hostctl(host, "reload", "--check", "tiny", f"max_num_seqs={running}")
    assert (unchanged.returncode, unchanged.stdout) == (
        0, "reload of tiny would be unchanged: the engine runs this config already: a reload would restart nothing\n")

    assert model_files(host) == files  # no drop-in written, no intent or counter recorded
    assert host.systemctl("show", "-p", "MainPID", "--value", "model-engine@tiny.service").stdout == engine_pid
    assert host.systemctl("is-active", "model-engine-next@tiny.service", check=False).stdout.strip() == "inactive"
    assert json.loads(hostctl(host, "operations", "--json").stdout) == operations  # no operation
    # And the reload then does what the check said.
    done = hostctl(host, "reload", "tiny", f"max_num_seqs={running + 1}", "--quiet")
    assert done.returncode == 0 and done.stdout.startswith("reload of tiny: done (strategy restart"), done


def test_hostctl_log_level_changes_a_running_engines_level_seen_in_the_journal_and_restarts_nothing(host):
    """`hostctl log-level` (Model.SetLogLevel: systemd's KillUnit with the
    level's signal, main process only): the running engine writes DEBUG lines
    to the journal from then on, and every unit keeps its PID: the weights
    were never reloaded. Back to info, all of the model's processes at once."""
    serving(host)
    units = ("model-weights@tiny.service", "model-engine@tiny.service", "model@tiny.service")
    before = {unit: main_pid(host, unit) for unit in units}
    engine_pid = before["model-engine@tiny.service"]
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()

    def engine_lines(priority: str) -> list[str]:  # journalctl's -p: "7" is debug alone
        return [entry["MESSAGE"] for entry in host.journal("model-engine@tiny.service", "--since", since,
                                                           "-p", f"{priority}..{priority}")
                if entry.get("_PID") == str(engine_pid)]

    greedy(host)
    assert engine_lines("7") == []  # at hostd.yaml's info: no debug line for a completion

    changed = hostctl(host, "log-level", "tiny", "engine", "debug", "--json=short")
    assert changed.returncode == 0, changed.stderr
    assert json.loads(changed.stdout)["data"] == [{"role": "engine", "unit": "model-engine@tiny.service",
                                                   "pid": engine_pid, "level": "debug"}]
    wait_for(lambda: "log level debug (was info), set by a signal (hostctl log-level)" in engine_lines("6"),
             timeout=30, what="the engine saying it logs at debug")
    greedy(host)
    wait_for(lambda: any(" prompt + " in line for line in engine_lines("7")), timeout=30,
             what="the engine's DEBUG line for a completion in the journal")
    assert {unit: main_pid(host, unit) for unit in units} == before

    back = hostctl(host, "log-level", "tiny", "info", "--no-legend")  # no role: the model's processes
    assert back.returncode == 0, back.stderr
    assert [line.split() for line in back.stdout.splitlines()] == [
        ["gateway", "model@tiny.service", str(before["model@tiny.service"]), "info"],
        ["engine", "model-engine@tiny.service", str(engine_pid), "info"],
        ["weights", "model-weights@tiny.service", str(before["model-weights@tiny.service"]), "info"]]
    wait_for(lambda: "log level info (was debug), set by a signal (hostctl log-level)" in engine_lines("6"),
             timeout=30, what="the engine back at info")
    assert {unit: main_pid(host, unit) for unit in units} == before
    assert hostctl(host, "log-level", "tiny", "loud").returncode == 2


def engine_runs(host: SystemdContainer) -> int:
    health = host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine.sock", "http://engine/health"]).stdout
    return json.loads(health)["engine_config"]["max_num_seqs"]


def test_hostctl_show_revert_no_block_and_is_failed_as_their_systemctl_namesakes(host):
    """Issue 55, item 2 (acceptance 1): `show -p State --value` prints what
    busctl reads; `revert` removes the manager's 90-reload.yaml and a rollback
    pin and reloads the administrator's files, saying what it removed;
    `restart --no-block` returns at once, printing nothing, while the restart
    runs; `is-failed` exits 0 only while the model failed (its gateway
    killed: model@tiny.service failed until the socket starts it again)."""
    serving(host)
    shown = hostctl(host, "show", "tiny", "-p", "State", "--value")
    assert (shown.returncode, shown.stdout) == (0, "serving\n"), shown.stderr
    state = host.run(["busctl", "get-property", "org.hostd1", "/org/hostd1/model/tiny", "org.hostd1.Model",
                      "State"]).stdout
    assert state.strip() == 's "serving"'
    everything = hostctl(host, "show", "tiny").stdout.splitlines()
    assert "Name=tiny" in everything and "Backend=builtin" in everything and everything == sorted(everything)

    # revert: a reload's value and a pin, then the administrator's own max_num_seqs (4) again.
    dropins = "/etc/hostd/models/tiny.d"
    host.run(["hostctl", "reload", "tiny", "max_num_seqs=3"], timeout=300)
    host.write_file(f"{dropins}/99-rollback.yaml", "# pinned by hand for this test\nengine:\n  max_num_seqs: 3\n")
    assert engine_runs(host) == 3
    reverted = hostctl(host, "revert", "tiny")
    assert reverted.returncode == 0, reverted.stderr
    assert reverted.stdout.startswith("revert tiny: done")
    assert f"revert removed {dropins}/90-reload.yaml, {dropins}/99-rollback.yaml" in reverted.stdout
    listing = host.run(["ls", dropins]).stdout.split()
    assert "90-reload.yaml" not in listing and "99-rollback.yaml" not in listing, listing
    assert engine_runs(host) == 4

    # --no-block: asked for and returned; the operation runs on.
    engine = main_pid(host, "model-engine@tiny.service")
    started = time.monotonic()
    quick = hostctl(host, "restart", "--no-block", "tiny")
    returned = time.monotonic() - started
    assert (quick.returncode, quick.stdout) == (0, ""), quick.stderr
    last = json.loads(hostctl(host, "operations", "--json").stdout)["data"][-1]
    assert last["kind"] == "restart" and last["model"] == "tiny"
    wait_for(lambda: json.loads(hostctl(host, "operations", "--json").stdout)["data"][-1]["state"] == "done",
             timeout=300, what="the restart done")
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving after the restart")
    assert main_pid(host, "model-engine@tiny.service") != engine
    print(f"restart --no-block returned after {returned:.2f} s")

    # is-failed
    alive = hostctl(host, "is-failed", "tiny")
    assert (alive.returncode, alive.stdout) == (1, "serving\n")
    host.run(["kill", "-9", str(main_pid(host, "model@tiny.service"))])
    wait_for(lambda: hostctl(host, "is-failed", "-q", "tiny").returncode == 0, timeout=60, what="is-failed")
    assert hostctl(host, "is-failed", "tiny").stdout == "failed\n"
    assert hostctl(host, "is-active", "tiny").returncode == 3
    assert httpx.get(host.base_url + "/v1/models", timeout=120).status_code in (200, 503)  # the socket starts it
    wait_for(lambda: hostctl(host, "is-failed", "-q", "tiny").returncode == 1, timeout=60, what="not failed")
