"""Issue 22 under a real systemd 252: what a neighbour on the host, a hostile
client's URLs and an administrator's typo can no longer do to a model.

One container for the module, set up as an administrator would: `hostd
install`, a tiny builtin model with API keys and an SGLang model on the
upstream test doubles (tests/doubles/: it speaks SGLang's flags and serves
HTTP on the loopback port hostd's supervisor gives it). Each test asserts
what a user observes: HTTP answers, connections refused, files absent,
unit states.
"""

from __future__ import annotations

import json

import httpx
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import main_pid, prepare_model
from test_upstream_units import CHECKPOINT, yaml_for

KEY = "sk-hostile-neighbours-test-key"
SG = "sg"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    c.write_file("/etc/hostd/keys/tiny", KEY + "\n", mode=0o600)
    port = reserved_port()
    prepare_model(c, port, gateway="{api_keys: /etc/hostd/keys/tiny}")
    c.base_url = f"http://127.0.0.1:{port}"
    c.port = port
    c.run(["mkdir", "-p", CHECKPOINT])
    c.write_file(f"{CHECKPOINT}/config.json", json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    c.write_file(f"{CHECKPOINT}/model.safetensors", "not really weights")
    c.ports = {"sglang": reserved_port()}
    c.write_model_yaml(SG, yaml_for(c, "sglang", c.ports["sglang"]))  # env: kept to root and the model
    c.systemctl("daemon-reload")
    c.systemctl("start", "model@tiny.service", timeout=300)
    return c


def completion_status(host: SystemdContainer, url: str | None = None, model: str = "tiny", key: str = KEY) -> int:
    try:
        return httpx.post(
            (url or host.base_url) + "/v1/completions", timeout=30,
            headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "prompt": "Once upon a time", "max_tokens": 4},
        ).status_code
    except httpx.HTTPError:
        return 0


def serving(host: SystemdContainer) -> SystemdContainer:
    host.systemctl("start", "model@tiny.service", timeout=300)
    wait_for(lambda: completion_status(host) == 200, timeout=60, what="model tiny serving")
    return host


def netns(host: SystemdContainer, pid: int) -> str:
    return host.run(["readlink", f"/proc/{pid}/ns/net"]).stdout.strip()


def connects(host: SystemdContainer, port: int, *, in_netns_of: int | None = None) -> bool:
    """Can a process (in the container's network, or in PID's) open a TCP connection to 127.0.0.1:PORT?"""
    script = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5).close()"
    prefix = ["nsenter", "-t", str(in_netns_of), "-n"] if in_netns_of else []
    return host.run([*prefix, host.python, "-c", script], check=False).returncode == 0


# --- A: a broken drop-in and a daemon-reload ----------------------------------------


def test_a_broken_dropin_reloaded_and_removed_leaves_the_socket_able_to_start_the_next_gateway(host):
    serving(host)
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    host.write_file("/etc/hostd/models/tiny.d/70-broken.yaml", "engine: {max_num_seqs: [\n")
    try:
        host.systemctl("daemon-reload")
        assert completion_status(host) == 200  # a typo takes nothing down
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/tiny.d/70-broken.yaml"])
    host.systemctl("daemon-reload")
    host.run(["kill", "-9", str(main_pid(host, "model@tiny.service"))])
    # The next connections start a new gateway through the socket.
    wait_for(lambda: completion_status(host) == 200, timeout=60, what="a new gateway answering")
    socket_log = host.run(["journalctl", "--no-pager", "-o", "cat", "--since", since, "-u", "model@tiny.socket"]).stdout
    assert "Socket unit configuration has changed" not in socket_log


# --- 8 and 9: no network for engines and weights ---------------------------------


def test_engine_and_weights_have_a_network_of_their_own_that_reaches_nothing_on_the_host(host):
    serving(host)
    engine, weights = main_pid(host, "model-engine@tiny.service"), main_pid(host, "model-weights@tiny.service")
    host_net = netns(host, 1)
    assert netns(host, engine) != host_net and netns(host, weights) != host_net
    assert netns(host, engine) != netns(host, weights)
    # A media URL naming anything on the host (here: the model's own public
    # port on 127.0.0.1, which the host's processes reach) is unreachable.
    assert connects(host, host.port)
    assert not connects(host, host.port, in_netns_of=engine)
    assert not connects(host, host.port, in_netns_of=weights)
    assert completion_status(host) == 200  # the gateway reaches the engine over engine.sock


def _sglang_port(host: SystemdContainer) -> int:
    lines = host.run(["pgrep", "-a", "-u", "hostd-sg"]).stdout.splitlines()
    for line in lines:
        words = line.split()
        if "--port" in words and "--host" in words:
            return int(words[words.index("--port") + 1])
    raise AssertionError(f"no SGLang server with --port among hostd-sg's processes: {lines}")


def test_sglangs_loopback_port_serves_its_supervisor_and_no_local_user(host):
    host.systemctl("start", f"model@{SG}.service", timeout=180)
    try:
        url = f"http://127.0.0.1:{host.ports['sglang']}"
        wait_for(lambda: completion_status(host, url, SG) == 200, timeout=60, what="model sg serving")
        port = _sglang_port(host)
        engine = main_pid(host, f"model-engine@{SG}.service")
        assert connects(host, port, in_netns_of=engine)  # the supervisor's own loopback
        assert not connects(host, port)  # every other user and model on the host
    finally:
        host.systemctl("stop", f"model@{SG}.service", timeout=120)


# --- 18: the gateway's credential ---------------------------------------------------


def test_the_gateways_api_keys_credential_is_not_in_the_engines_or_the_weights_view(host):
    serving(host)
    # An engine started while the gateway runs (a reload, a crash) is the case
    # that matters: the credential exists when its namespace is made.
    host.systemctl("restart", "model-engine@tiny.service", timeout=180)
    wait_for(lambda: completion_status(host) == 200, timeout=60, what="model tiny serving again")
    credential = "/run/credentials/model@tiny.service/api-keys"
    assert host.run(["cat", credential]).stdout.strip() == KEY  # there, for the gateway
    uid = host.run(["id", "-u", "hostd-tiny"]).stdout.strip()
    gateway = main_pid(host, "model@tiny.service")
    via_proc = host.run(["nsenter", "-t", str(main_pid(host, "model-engine@tiny.service")), "-m", "-S", uid, "-G", uid,
                         "cat", f"/proc/{gateway}/root{credential}"], check=False)
    assert via_proc.returncode != 0 and KEY not in via_proc.stdout  # the gateway is not dumpable
    for unit in ("model-engine@tiny.service", "model-weights@tiny.service"):
        pid = main_pid(host, unit)
        seen = host.run(["nsenter", "-t", str(pid), "-m", "cat", credential], check=False)
        assert seen.returncode != 0 and KEY not in seen.stdout, unit
        listing = host.run(["nsenter", "-t", str(pid), "-m", "ls", "-A", "/run/credentials"], check=False)
        assert listing.stdout.strip() == "", (unit, listing.stdout)


def test_systemctl_reload_gives_the_running_gateway_new_keys_and_restarts_nothing(host):
    serving(host)
    pids = {unit: main_pid(host, unit) for unit in ("model@tiny.service", "model-engine@tiny.service")}
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    rotated = "sk-rotated-by-systemctl-reload"
    host.write_file("/etc/hostd/keys/tiny", f"# rotated\n{rotated}\n", mode=0o600)
    try:
        host.systemctl("reload", "model@tiny.service", timeout=180)
        assert completion_status(host, key=rotated) == 200
        assert completion_status(host) == 401  # the old key is gone
        assert {unit: main_pid(host, unit) for unit in pids} == pids  # nothing restarted
        journal = host.run(["journalctl", "--no-pager", "-o", "cat", "--since", since,
                            "-u", "model@tiny.service"]).stdout
        assert "API keys replaced from /etc/hostd/keys/tiny: 1 key(s), 1 before" in journal, journal[-3000:]
        assert rotated not in journal
    finally:
        host.write_file("/etc/hostd/keys/tiny", KEY + "\n", mode=0o600)
        host.systemctl("reload", "model@tiny.service", timeout=180)
    assert completion_status(host) == 200


# --- B: a reload refuses what the check refuses --------------------------------------


def test_a_reload_refuses_a_tree_hostctl_config_check_refuses_and_names_the_file(host):
    serving(host)
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    bad = "/etc/hostd/models/tiny.d/70-badtype.yaml"
    host.write_file(bad, "engine: {max_num_seqs: lots}\n")
    host.write_file("/etc/hostd/models/tiny.d/90-reload.yaml", "engine: {max_num_seqs: 3}\n")
    try:
        check = host.run([host.python, "-m", "hostd.hostctl", "config", "--check"], check=False)
        assert check.returncode == 1 and bad in check.stdout + check.stderr
        reload = host.systemctl("reload", "model@tiny.service", check=False, timeout=180)
        assert reload.returncode != 0
        journal = host.run(["journalctl", "--no-pager", "-o", "cat", "--since", since,
                            "-u", "model@tiny.service"]).stdout
        assert bad in journal, journal[-3000:]
        assert completion_status(host) == 200  # nothing changed
    finally:
        host.run(["rm", "-f", bad, "/etc/hostd/models/tiny.d/90-reload.yaml"])
        host.systemctl("daemon-reload")


# --- C: systemctl start returns when the model serves, or fails naming why -------------


def test_start_of_a_model_that_cannot_serve_fails_naming_the_failed_unit_and_its_error(host):
    port = reserved_port()
    host.write_model_yaml("vq", (
        f"backend: vllm\nmodel: {CHECKPOINT}\nlisten: 127.0.0.1:{port}\ntimeouts: {{start: 120, stop: 30}}\n"
        "env:\n  HOSTD_VLLM: /nonexistent/vllm\n  HOSTD_TEST_GPU_UUID: GPU-12345678-1234-1234-1234-123456789abc\n"))
    host.systemctl("daemon-reload")
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    try:
        start = host.systemctl("start", "model@vq.service", check=False, timeout=180)
        journal = host.run(["journalctl", "--no-pager", "-o", "cat", "--since", since, "-u", "model@vq.service"]).stdout
        assert start.returncode != 0
        said = [line for line in journal.splitlines() if "hostd: model vq cannot serve: model-" in line]
        assert said, journal[-3000:]
        failed = said[0].split("cannot serve: ")[1].split()[0]
        assert failed in ("model-weights@vq.service", "model-engine@vq.service")
        assert host.systemctl("is-active", "model@vq.service", check=False).stdout.strip() != "active"
    finally:
        host.systemctl("stop", "model@vq.service", check=False, timeout=120)
        host.run(["rm", "-f", "/etc/hostd/models/vq.yaml"])
        host.systemctl("reset-failed", check=False)
        host.systemctl("daemon-reload")
