"""The pre-imported spare (`spare: true`, issue 51) under a real systemd 252:
each start of the main engine forks its process from
model-engine-spare@tiny, and systemd takes that process as
model-engine@tiny's own: its cgroup, its MainPID (kill -9 of it is a crash
that Restart= answers, again from the spare), `systemctl restart` and
stopping the model (nothing left behind), the engine's journal lines under
the engine's unit. A spare whose environment or limits differ from the engine
unit's is refused, and the engine starts on its own, saying why.

One container for the module: model tiny with spare: true, started with
its umbrella unit; clients are the official openai client.
"""

from __future__ import annotations

import json

import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import main_pid, prepare_model, status_code

ENGINE = "model-engine@tiny.service"
SPARE = "model-engine-spare@tiny.service"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    host, port = systemd_container, reserved_port()
    prepare_model(host, port, timeouts="{start: 120, stop: 60}", spare="true")
    host.base_url = f"http://127.0.0.1:{port}"
    host.systemctl("start", "model@tiny.service", timeout=300)
    wait_for(lambda: active(host, SPARE) == "active", timeout=120, what="the spare ready")
    return host


def active(host: SystemdContainer, unit: str) -> str:
    return host.systemctl("is-active", unit, check=False).stdout.strip()


def answers(host: SystemdContainer) -> str:
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    return reply.choices[0].text


def cgroup(host: SystemdContainer, pid: int) -> str:
    return host.read_file(f"/proc/{pid}/cgroup")


def engine_health(host: SystemdContainer) -> dict:
    out = host.run(["curl", "-sf", "--unix-socket", "/run/hostd/tiny/engine.sock", "http://engine/health"],
                   check=False).stdout
    return json.loads(out) if out.strip() else {}


def engine_lines(host: SystemdContainer, since: str) -> list[str]:
    return [e.get("MESSAGE", "") for e in host.journal(ENGINE, "--since", since)]


def from_the_spare(host: SystemdContainer) -> int:
    """Wait for the engine to serve; its MainPID, checked to be a process forked from the spare."""
    wait_for(lambda: active(host, ENGINE) == "active", timeout=120, what="the engine active")
    pid = main_pid(host, ENGINE)
    assert engine_health(host)["pid"] == pid
    assert cgroup(host, pid).rstrip().endswith(f"/system.slice/system-model\\x2dengine.slice/{ENGINE}")
    assert host.run(["ps", "-o", "ppid=", "-p", str(pid)]).stdout.strip() == "1"  # systemd's child: it reaps it
    spare = main_pid(host, SPARE)
    assert host.read_file(f"/proc/{pid}/cmdline") == host.read_file(f"/proc/{spare}/cmdline"), "\n".join(
        [e.get("MESSAGE") for e in host.journal(ENGINE)][-30:] + [e.get("MESSAGE") for e in host.journal(SPARE)][-30:])
    # The gateway's watch sees the new engine's socket within its retry (hostd/gateway/watch.py).
    wait_for(lambda: status_code(host) == 200, timeout=30, what="the gateway serving again")
    return pid


def test_the_engine_is_a_process_of_the_spare_and_its_unit_takes_it_as_its_own(host: SystemdContainer):
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    host.systemctl("restart", ENGINE, timeout=180)
    pid = from_the_spare(host)
    assert answers(host)
    lines = engine_lines(host, since)
    assert any(f"the engine is process {pid}, forked from the spare" in line for line in lines), lines
    # The engine's own lines, native and stderr alike, are the engine unit's.
    assert any(line.startswith("ready; start-up phases") for line in lines), lines
    assert host.journal(SPARE, "--since", since, f"_PID={pid}") == []
    assert int(host.systemctl("show", "-p", "NRestarts", "--value", ENGINE).stdout) == 0


def test_kill_9_of_the_engine_is_a_crash_restarted_from_the_spare(host: SystemdContainer):
    killed = from_the_spare(host)
    restarts = int(host.systemctl("show", "-p", "NRestarts", "--value", ENGINE).stdout)
    spare = main_pid(host, SPARE)
    host.run(["kill", "-9", str(killed)])
    wait_for(lambda: main_pid(host, ENGINE) not in (0, killed), timeout=120, what="the engine restarted")
    pid = from_the_spare(host)
    assert int(host.systemctl("show", "-p", "NRestarts", "--value", ENGINE).stdout) == restarts + 1
    crash = [e["MESSAGE"] for e in host.journal(ENGINE) if f"{killed}" in e.get("MESSAGE", "")
             or "status=9/KILL" in e.get("MESSAGE", "")]
    assert any("status=9/KILL" in line for line in crash), crash
    assert main_pid(host, SPARE) == spare  # one spare, forking each engine
    assert answers(host) and pid != killed


@pytest.mark.parametrize("line, words", [
    ("Environment=HOSTD_TEST_ONLY_HERE=1", "the spare's environment differs from this unit's in HOSTD_TEST_ONLY_HERE"),
    ("LimitNOFILE=4096", "the spare's resource limits differ from this unit's"),
])
def test_an_execution_setting_only_the_engine_unit_has_refuses_the_spare_and_it_starts_alone(
        host: SystemdContainer, line: str, words: str):
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    host.write_file(f"/run/systemd/system/{ENGINE}.d/60-test.conf", f"[Service]\n{line}\n")
    host.systemctl("daemon-reload")
    try:
        host.systemctl("restart", ENGINE, timeout=180)
        wait_for(lambda: active(host, ENGINE) == "active", timeout=180, what="the engine active")
        pid = main_pid(host, ENGINE)
        assert "engine-spare" not in host.read_file(f"/proc/{pid}/cmdline")  # its own process
        lines = engine_lines(host, since)
        assert any(f"starting without the spare: {words}" in line for line in lines), lines
        wait_for(lambda: status_code(host) == 200, timeout=30, what="the gateway serving again")
        assert answers(host)
    finally:
        host.run(["rm", "-f", f"/run/systemd/system/{ENGINE}.d/60-test.conf"])
        host.systemctl("daemon-reload")
        host.systemctl("restart", ENGINE, timeout=180)
    from_the_spare(host)


def test_stopping_the_model_stops_engine_and_spare_leaving_no_process_and_the_next_start_forks_again(
        host: SystemdContainer):
    pid = from_the_spare(host)
    host.systemctl("stop", "model@tiny.service", timeout=180)
    wait_for(lambda: active(host, SPARE) == active(host, ENGINE) == "inactive", timeout=120,
             what="engine and spare stopped with the model (PartOf=)")
    assert host.run(["kill", "-0", str(pid)], check=False).returncode != 0
    left = host.run(["pgrep", "-f", "hostd.main engine"], check=False).stdout.split()  # engine-spare too
    assert left == [], host.run(["ps", "-o", "pid,ppid,cgroup,cmd", "-p", ",".join(left)], check=False).stdout
    host.systemctl("start", "model@tiny.service", timeout=300)
    wait_for(lambda: active(host, SPARE) == "active", timeout=120, what="the spare ready again")
    host.systemctl("restart", ENGINE, timeout=180)  # the model's first start may have run before its spare was ready
    assert from_the_spare(host) != pid
    assert answers(host)


def test_the_gateway_cannot_reach_the_system_bus_to_move_itself_into_the_delegated_engine(host: SystemdContainer):
    """Delegate=yes lets a process of the model's user ask systemd to move it
    into the engine unit (and to its GPUs and limits); the gateway, the one
    such process facing the network, sees the bus socket as nothing it may open."""
    gateway = main_pid(host, "model@tiny.service")
    seen = host.run(["nsenter", "-t", str(gateway), "-m", "--", "stat", "-L", "-c", "%a %F",
                     "/run/dbus/system_bus_socket"]).stdout.split()
    assert seen[0] == "0", seen  # InaccessiblePaths=: mode 000, whatever its type
    assert host.run(["stat", "-c", "%F", "/run/dbus/system_bus_socket"]).stdout.strip() == "socket"
