"""A model's units under a real systemd 252: start order, restarts, crash
recovery, stop, the private runtime directory and the journal.

One container for the module: `hostd install`, a tiny random checkpoint and
/etc/hostd/models/tiny.yaml, exactly as an administrator sets up a host. Each
test starts the model if it is not running and asserts what a user observes:
unit states and PIDs through systemctl, files through stat, answers through
the openai client on the public address.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port

MODEL = "tiny"
UNITS = ("model-weights@tiny.service", "model-engine@tiny.service", "model@tiny.service")
PROMPT = "Once upon a time there was a model"


# Ports held for the test process (ports.py: no bind-then-release race with
# other runs on the shared host network). free_port: the old name, for
# branches that still import it.
free_port = reserved_port


def prepare_model(container: SystemdContainer, port: int, **yaml_extra: str) -> None:
    """What an administrator does: install hostd, write a checkpoint and the YAML."""
    # The throwaway container's /root holds the bound Python installation; let
    # the hostd service user reach it (only inside the container).
    container.sh("chmod o+x /root")
    py = container.python
    container.run([py, "-m", "hostd.main", "install"], timeout=120)
    container.run([py, "-m", "hostd.main", "make-checkpoint", "/var/lib/hostd/checkpoints/tiny"], timeout=120)
    extra = "".join(f"{k}: {v}\n" for k, v in yaml_extra.items())
    container.write_file(
        "/etc/hostd/models/tiny.yaml",
        "backend: builtin\nmodel: /var/lib/hostd/checkpoints/tiny\n"
        f"listen: 127.0.0.1:{port}\nengine:\n  max_num_seqs: 4\n{extra}",
    )
    container.systemctl("daemon-reload")


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    port = reserved_port()
    prepare_model(systemd_container, port)
    systemd_container.base_url = f"http://127.0.0.1:{port}"
    return systemd_container


def main_pid(host: SystemdContainer, unit: str) -> int:
    return int(host.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip())


def pids(host: SystemdContainer) -> dict[str, int]:
    return {unit: main_pid(host, unit) for unit in UNITS}


def active(host: SystemdContainer, *units: str) -> list[str]:
    return host.systemctl("is-active", *units, check=False).stdout.split()


def stat(host: SystemdContainer, path: str) -> dict:
    inode, mode, owner = host.run(["stat", "-c", "%i %a %U", path]).stdout.split()
    return {"inode": int(inode), "mode": mode, "owner": owner}


def client(host: SystemdContainer) -> openai.OpenAI:
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(host: SystemdContainer) -> str:
    answer = client(host).completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    return answer.choices[0].text


def status_code(host: SystemdContainer) -> int:
    try:
        return httpx.get(host.base_url + "/v1/models", timeout=10).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture
def running(host: SystemdContainer) -> SystemdContainer:
    host.systemctl("start", "model@tiny.service", timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=60, what="model serving")
    return host


def test_start_brings_up_weights_engine_gateway_in_order_and_blocks_until_serving(host):
    host.systemctl("stop", "model@tiny.service", timeout=300)
    wait_for(lambda: set(active(host, *UNITS)) == {"inactive"}, timeout=120, what="all stopped")
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    time.sleep(1)

    host.systemctl("start", "model@tiny.service", timeout=300)

    # No waiting: when `systemctl start` returns, the model answers.
    assert greedy(host)
    assert active(host, *UNITS) == ["active"] * 3
    started = [
        entry["UNIT"]
        for entry in host.journal(None, "--since", since, "MESSAGE_ID=39f53479d3a045ac8e11786248231fbf")
    ]
    assert [u for u in started if u in UNITS] == list(UNITS)  # weights, then engine, then gateway


def test_engine_restart_keeps_weights_daemon_socket_and_gateway(running):
    host = running
    before, inode, output = pids(host), stat(host, "/run/hostd/tiny/weights.sock")["inode"], greedy(host)

    host.systemctl("restart", "model-engine@tiny.service", timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=60, what="serving again")

    after = pids(host)
    assert after["model-engine@tiny.service"] != before["model-engine@tiny.service"]
    assert after["model-weights@tiny.service"] == before["model-weights@tiny.service"]
    assert after["model@tiny.service"] == before["model@tiny.service"]
    assert stat(host, "/run/hostd/tiny/weights.sock")["inode"] == inode
    assert greedy(host) == output


def test_private_runtime_dir_is_0700_the_models_user_and_survives_engine_and_weights_restarts(running):
    host = running

    def check() -> None:
        assert stat(host, "/run/hostd/tiny") | {"inode": 0} == {"inode": 0, "mode": "700", "owner": "hostd-tiny"}
        assert stat(host, "/run/hostd/tiny/weights.sock") | {"inode": 0} == {"inode": 0, "mode": "600", "owner": "hostd-tiny"}
        for name in ("engine.sock", "control.sock"):
            assert stat(host, f"/run/hostd/tiny/{name}")["mode"] == "600"

    check()
    directory = stat(host, "/run/hostd/tiny")["inode"]
    host.systemctl("restart", "model-engine@tiny.service", timeout=300)
    check()
    host.systemctl("restart", "model-weights@tiny.service", timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving again")
    check()
    assert stat(host, "/run/hostd/tiny")["inode"] == directory


def test_killing_the_weights_daemon_stops_the_engine_and_both_come_back(running):
    host = running
    before = pids(host)
    output = greedy(host)

    host.run(["kill", "-9", str(before["model-weights@tiny.service"])])

    # BindsTo=: the engine goes with its weights; meanwhile the gateway answers 503.
    wait_for(lambda: status_code(host) == 503, timeout=30, what="503 while the engine is down")
    response = httpx.get(host.base_url + "/v1/models", timeout=10)
    assert response.headers["Retry-After"] == "5"
    wait_for(lambda: active(host, "model-engine@tiny.service") != ["active"] or
             main_pid(host, "model-engine@tiny.service") != before["model-engine@tiny.service"],
             timeout=30, what="engine stopped")
    # Restart= brings the weights back, Upholds= then the engine.
    wait_for(lambda: status_code(host) == 200, timeout=180, what="serving again")
    after = pids(host)
    assert after["model-weights@tiny.service"] != before["model-weights@tiny.service"]
    assert after["model-engine@tiny.service"] != before["model-engine@tiny.service"]
    assert after["model@tiny.service"] == before["model@tiny.service"]
    assert greedy(host) == output


def test_journal_follows_the_model_across_its_three_units(running):
    host = running
    entries = host.journal(None, "HOSTD_MODEL=tiny")
    units = {e.get("_SYSTEMD_UNIT") for e in entries}
    assert set(UNITS) <= units
    components = {e.get("HOSTD_COMPONENT") for e in entries}
    assert {"weights", "engine", "gateway"} <= components
    # LogExtraFields= of the units: a line hostd's logging did not write (a
    # process's stderr: vLLM's, tests/system/test_real_vllm.py) carries the
    # name too, and hostd's own lines carry it once (journald drops the
    # duplicate field; a list here would be unhashable).
    for unit in UNITS:
        shown = host.run(["systemctl", "show", "-p", "LogExtraFields", unit]).stdout.strip()
        assert shown == "LogExtraFields=HOSTD_MODEL=tiny", (unit, shown)
    assert {e["HOSTD_MODEL"] for e in entries} == {"tiny"}


def test_restart_of_the_model_restarts_all_three(running):
    host = running
    before = pids(host)
    host.systemctl("restart", "model@tiny.service", timeout=300)
    wait_for(lambda: status_code(host) == 200, timeout=120, what="serving again")
    after = pids(host)
    assert all(after[u] != before[u] for u in UNITS), (before, after)


def test_stop_stops_everything_closes_the_socket_and_removes_the_runtime_dir(running):
    host = running
    host.systemctl("stop", "model@tiny.service", timeout=300)
    everything = (*UNITS, "model@tiny.socket", "model-weights@tiny.socket")
    wait_for(lambda: set(active(host, *everything)) == {"inactive"}, timeout=120, what="all inactive")
    assert status_code(host) == 0  # nothing listens on the public address
    assert host.run(["test", "-e", "/run/hostd/tiny"], check=False).returncode == 1
    assert host.run(["pgrep", "-u", "hostd-tiny"], check=False).stdout.strip() == ""


def test_units_verify(host):
    result = host.run(
        ["systemd-analyze", "verify", "--generators=yes", "model@tiny.service", "model-engine@tiny.service",
         "model-weights@tiny.service", "model@tiny.socket", "model-weights@tiny.socket", "hostd.service"],
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_broken_model_yaml_never_fails_daemon_reload_and_its_start_names_the_file(host):
    host.write_file("/etc/hostd/models/broken.yaml", "backend: builtin\nmodel: [\n")
    try:
        host.systemctl("daemon-reload")
        generated = host.run(["ls", "/run/systemd/generator"]).stdout.split()
        assert "model@tiny.socket.d" in generated
        assert "model-engine@broken.service.d" not in generated
        logged = host.run(["journalctl", "-b", "--no-pager", "-o", "cat"]).stdout
        assert "hostd-generator: skipping model 'broken'" in logged
        # Not systemd's "Unit has no Listen setting": the file and the problem.
        start = host.systemctl("start", "model@broken.service", check=False, timeout=120)
        assert start.returncode != 0
        status = host.systemctl("status", "--no-pager", "model@broken.service", check=False).stdout
        assert "INVALID CONFIG /etc/hostd/models/broken.yaml" in status
        journal = host.run(["journalctl", "--no-pager", "-o", "cat", "-u", "model@broken.socket"]).stdout
        assert ("hostd: model broken is not started: invalid configuration: "
                "/etc/hostd/models/broken.yaml:3: malformed YAML") in journal
        source = host.systemctl("show", "-p", "SourcePath", "--value", "model@tiny.socket").stdout.strip()
        assert source == "/etc/hostd/models/tiny.yaml"
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/broken.yaml"])
        host.systemctl("reset-failed", check=False)
        host.systemctl("daemon-reload")
