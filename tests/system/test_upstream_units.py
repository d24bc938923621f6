"""The vllm and sglang backends under a real systemd 252, with the upstream
test doubles (tests/doubles/: they speak upstream's flags and files and stand
in for vLLM and SGLang, which need GPUs): start, a retained-weight
`systemctl reload`, the rollback of an engine that fails to start, and the
refusal of every unsupported setting before anything upstream starts.
"""

from __future__ import annotations

import json

import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_model_units import main_pid, prepare_model

UUID = "GPU-12345678-1234-1234-1234-123456789abc"
CHECKPOINT = "/var/lib/hostd/checkpoints/fake"
BACKENDS = {
    # backend: (model name, editable field, its flag in the engine's argv)
    "vllm": ("vl", "max_num_seqs", "--max-num-seqs"),
    "sglang": ("sg", "max_running_requests", "--max-running-requests"),
}


def yaml_for(container: SystemdContainer, backend: str, port: int, extra: str = "", env: str = "") -> str:
    doubles = f"{container.checkout}/tests/doubles"
    return (
        f"backend: {backend}\nmodel: {CHECKPOINT}\nlisten: 127.0.0.1:{port}\n"
        f"timeouts: {{start: 60, stop: 30}}\n{extra}"
        "env:\n"
        f"  HOSTD_VLLM: {doubles}/vllm\n"
        f"  PYTHONPATH: {doubles}/sglang_double\n"
        f"  HOSTD_TEST_GPU_UUID: {UUID}\n"
        "  HOSTD_TEST_FAIL_MAX_NUM_SEQS: '13'\n"
        "  HOSTD_TEST_FAIL_MAX_RUNNING_REQUESTS: '13'\n"
        f"{env}"
    )


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    c = systemd_container
    prepare_model(c, reserved_port())
    c.run(["mkdir", "-p", CHECKPOINT])
    c.write_file(f"{CHECKPOINT}/config.json", json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    c.write_file(f"{CHECKPOINT}/model.safetensors", "not really weights")
    c.ports = {}
    for backend, (name, _, _) in BACKENDS.items():
        c.ports[backend] = reserved_port()
        c.write_model_yaml(name, yaml_for(c, backend, c.ports[backend]))  # env: kept to root and the model
    c.systemctl("daemon-reload")
    c.systemctl("start", "hostd.service", timeout=120)
    return c


def weights_status(host: SystemdContainer, name: str) -> dict:
    script = (
        "import json, msgspec; from pathlib import Path; from hostd.weights import client; "
        f"print(json.dumps(msgspec.to_builtins(client.status(Path('/run/hostd/{name}/weights.sock')))))"
    )
    return json.loads(host.run([host.python, "-c", script]).stdout)


def engine_health(host: SystemdContainer, name: str) -> dict:
    out = host.run(["curl", "-s", "--unix-socket", f"/run/hostd/{name}/engine.sock", "http://engine/health"]).stdout
    return json.loads(out)


def completion(host: SystemdContainer, backend: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{host.ports[backend]}/v1", api_key="unused", max_retries=0)
    return client.completions.create(model=BACKENDS[backend][0], prompt="Hello", max_tokens=4).choices[0].text


def last_operation(host: SystemdContainer) -> dict:
    out = host.run(["busctl", "--json=short", "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager",
                    "ListOperations"]).stdout
    path = json.loads(out)["data"][0][-1][-1]
    props = {}
    for name in ("State", "WeightsReused", "Restored", "Error", "Strategy", "Notes"):
        raw = host.run(["busctl", "--json=short", "get-property", "org.hostd1", path, "org.hostd1.Operation", name]).stdout
        props[name] = json.loads(raw)["data"]
    return props


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_start_reload_keeps_upstream_weights_and_rollback_restores(host, backend):
    name, field, flag = BACKENDS[backend]
    host.systemctl("start", f"model@{name}.service", timeout=180)
    assert completion(host, backend)

    before = weights_status(host, name)
    supervisor = main_pid(host, f"model-weights@{name}.service")
    engine = main_pid(host, f"model-engine@{name}.service")
    assert before["pid"] == supervisor and before["upstream_pids"]
    assert before["upstream_socket_inodes"]

    # A retained-weight reload of the config on disk.
    host.write_file(f"/etc/hostd/models/{name}.d/50-limits.yaml", f"engine:\n  {field}: 7\n")
    host.systemctl("reload", f"model@{name}.service", timeout=180)
    op = last_operation(host)
    assert (op["State"], op["WeightsReused"]) == ("done", True), op
    # The strategy is asserted, never left to chance: the bridge (overlap)
    # where the preflight can size it, else a restart whose Notes say why
    # (in this container NVML cannot be read for a cuda model).
    if op["Strategy"] == "overlap":
        assert any(note.startswith("bridge engine ran with") for note in op["Notes"]), op
    else:
        assert op["Strategy"] == "restart", op
        assert any("overlap does not fit, falling back to restart" in note for note in op["Notes"]), op
    after = weights_status(host, name)
    assert after["pid"] == before["pid"]
    assert after["upstream_pids"] == before["upstream_pids"]
    assert after["upstream_socket_inodes"] == before["upstream_socket_inodes"]
    assert main_pid(host, f"model-engine@{name}.service") != engine
    health = engine_health(host, name)
    assert health["engine_config"][field] == 7
    assert completion(host, backend)

    # An engine that exits on start (the double fails for 13): rolled back.
    result = host.run([host.python, "-m", "hostd.hostctl", "reload", name, f"{field}=13"], check=False, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    op = last_operation(host)
    assert op["State"] == "rolled-back" and op["Restored"] is True, op
    # The new engine's own words (the double's), not hostd's: the rollback is
    # for the failure this test caused.
    assert f"failing on purpose for {flag} 13" in op["Error"], op["Error"]
    assert engine_health(host, name)["engine_config"][field] == 7
    assert weights_status(host, name)["upstream_socket_inodes"] == before["upstream_socket_inodes"]
    assert completion(host, backend)
    host.systemctl("stop", f"model@{name}.service", timeout=120)


REFUSALS = [
    # (backend, YAML keys, env lines, words the refusal must contain)
    ("vllm", "extra_args: ['--enable-lora']\n", "", "LoRA"),
    ("vllm", "extra_args: ['--speculative-config', '{}']\n", "", "speculative"),
    ("vllm", "extra_args: ['--enable-sleep-mode']\n", "", "sleep"),
    ("vllm", "extra_args: ['--cpu-offload-gb', '4']\n", "", "offload"),
    ("vllm", "pipeline_parallel_size: 2\ngpus: [0, 1]\ntensor_parallel_size: 1\n", "", "pipeline"),
    ("vllm", "", "  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n", "expandable_segments"),
    ("vllm", "", "  HOSTD_TEST_VLLM_VERSION: 0.30.0\n", "0.30.0"),
    ("sglang", "extra_args: ['--lora-paths', 'a=/x']\n", "", "LoRA"),
    ("sglang", "extra_args: ['--speculative-algorithm', 'EAGLE']\n", "", "speculative"),
    ("sglang", "extra_args: ['--enable-memory-saver']\n", "", "sleep"),
    ("sglang", "extra_args: ['--cpu-offload-gb', '4']\n", "", "offload"),
    ("sglang", "pipeline_parallel_size: 2\ngpus: [0, 1]\ntensor_parallel_size: 1\n", "", "pipeline"),
    ("sglang", "", "  PYTORCH_CUDA_ALLOC_CONF: expandable_segments:True\n", "expandable_segments"),
]


@pytest.mark.parametrize("backend, extra, env, words", REFUSALS,
                         ids=[f"{b}-{w}" for b, _, _, w in REFUSALS])
def test_unsupported_settings_are_refused_before_upstream_starts(host, backend, extra, env, words):
    name = f"bad{backend[:2]}"
    host.write_model_yaml(name, yaml_for(host, backend, reserved_port(), extra, env))
    host.systemctl("daemon-reload")
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    try:
        failed = host.systemctl("start", f"model-weights@{name}.service", check=False, timeout=120)
        assert failed.returncode != 0
        logged = host.run(["journalctl", "-u", f"model-weights@{name}.service", "--since", since,
                           "-o", "cat", "--no-pager"]).stdout
        assert words.lower() in logged.lower(), logged[-2000:]
        # Nothing upstream was started: no process of the double runs for it.
        assert host.run(["pgrep", "-f", f"/run/hostd/{name}/"], check=False).stdout.strip() == ""
    finally:
        host.systemctl("stop", f"model@{name}.service", f"model-weights@{name}.service", check=False, timeout=60)
        host.run(["rm", "-f", f"/etc/hostd/models/{name}.yaml"])
        host.systemctl("reset-failed", check=False)


def cpu_model(host: SystemdContainer, backend: str, suffix: str) -> str:
    """A device: cpu model of BACKEND named NAME-SUFFIX on a checkpoint of its
    own whose config.json sizes the bridge (2 layers, 1 KV head of 64), on
    reload.bridge_kv_mib 16, written and daemon-reloaded; its name."""
    name, checkpoint = f"{BACKENDS[backend][0]}-{suffix}", f"{CHECKPOINT}-{suffix}"
    host.run(["mkdir", "-p", checkpoint])
    host.write_file(f"{checkpoint}/config.json", json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "hidden_size": 128, "torch_dtype": "bfloat16"}))
    host.write_file(f"{checkpoint}/model.safetensors", "not really weights")
    port = reserved_port()
    host.ports[f"{backend}-{suffix}"] = port
    text = yaml_for(host, backend, port, extra="device: cpu\nreload: {bridge_kv_mib: 16}\n")
    host.write_model_yaml(name, text.replace(f"model: {CHECKPOINT}\n", f"model: {checkpoint}\n"))
    host.systemctl("daemon-reload")
    return name


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_cpu_models_reload_runs_the_bridge_engine_under_systemd(host, backend):
    """The bridge (issue 33: in this container NVML cannot be read, so a cuda
    model's overlap always fell back to restart and no bridge ever ran here;
    SGLang's never under systemd). On CPU the preflight weighs the host's
    MemAvailable, which the engine reports: the reload is an overlap whose
    second engine ran with the bridge's KV budget, in model-engine-next@,
    and the main engine restarted (weights are not retained on CPU: upstream
    shares them through CUDA IPC only)."""
    field, name = BACKENDS[backend][1], cpu_model(host, backend, "cpu")
    try:
        host.systemctl("start", f"model@{name}.service", timeout=180)
        engine = main_pid(host, f"model-engine@{name}.service")
        result = host.run([host.python, "-m", "hostd.hostctl", "reload", name, f"{field}=5"], check=False,
                          timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        op = last_operation(host)
        assert (op["State"], op["Strategy"]) == ("done", "overlap"), op
        assert any(note.startswith("bridge engine ran with") for note in op["Notes"]), op
        assert main_pid(host, f"model-engine@{name}.service") != engine
        assert engine_health(host, name)["engine_config"][field] == 5
        assert host.systemctl("is-active", f"model-engine-next@{name}.service", check=False).stdout.strip() \
            == "inactive"  # the bridge was retired
    finally:
        host.systemctl("stop", f"model@{name}.service", timeout=120, check=False)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_standby_true_after_a_committed_reload_then_a_reload_through_the_standby(host, backend):
    """standby: true (issue 35) under systemd with the doubles (SGLang's only
    run under the units: its server needs a GPU): a model that reloaded
    once (a committed record without the standby) gets standby: true and a
    restart; the standby unit starts, a third upstream server on the
    bridge's budget; the next reload is not refused as a changed fixed key,
    and runs through the standby (strategy standby: one upstream start, the
    standby kept)."""
    field, name = BACKENDS[backend][1], cpu_model(host, backend, "sb")
    hostctl = [host.python, "-m", "hostd.hostctl"]
    try:
        host.systemctl("start", f"model@{name}.service", timeout=180)
        assert host.run([*hostctl, "reload", name, f"{field}=5"], check=False, timeout=300).returncode == 0
        before = weights_status(host, name)
        host.systemctl("stop", f"model@{name}.service", timeout=120)
        # `systemctl stop` returns once model@ stopped; the units PartOf it
        # stop in jobs of their own, which a start right away would cancel
        # (the weight daemon would live on and the restart apply nothing).
        wait_for(lambda: host.systemctl("is-active", f"model-weights@{name}.service", check=False).stdout.strip()
                 == "inactive", timeout=120, interval=0.5, what="the weight daemon stopped")
        host.write_file(f"/etc/hostd/models/{name}.d/70-standby.yaml", "standby: true\n")
        host.systemctl("daemon-reload")
        host.systemctl("start", f"model@{name}.service", timeout=180)
        standby = f"model-engine-standby@{name}.service"
        wait_for(lambda: host.systemctl("is-active", standby, check=False).stdout.strip() == "active", timeout=120,
                 interval=0.5, what="the standby active")
        spare = json.loads(host.run(["curl", "-s", "--unix-socket", f"/run/hostd/{name}/engine-standby.sock",
                                     "http://engine/health"]).stdout)
        assert spare["slot"] == "standby" and spare["bridge"], spare
        standby_pid = main_pid(host, standby)
        assert weights_status(host, name)["pid"] != before["pid"]  # the units read the disk again
        result = host.run([*hostctl, "reload", name, f"{field}=6"], check=False, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        op = last_operation(host)
        assert (op["State"], op["Strategy"]) == ("done", "standby"), op
        assert any("the standby keeps the config it started with" in note for note in op["Notes"]), op
        assert engine_health(host, name)["engine_config"][field] == 6
        assert main_pid(host, standby) == standby_pid
        assert host.systemctl("is-active", f"model-engine-next@{name}.service", check=False).stdout.strip() \
            == "inactive"  # no bridge ran
    finally:
        host.systemctl("stop", f"model@{name}.service", timeout=120, check=False)


def test_a_start_that_hangs_fails_at_timeouts_start_naming_its_phase(host):
    """Issue 52: every start wrapped its wait in EXTEND_TIMEOUT_USEC sent every
    10 s whatever happened, so a `vllm preload` that never finished kept
    model-weights@ `activating` (and its memory held) for ever and Restart=
    never ran. The double's load now takes an hour; timeouts.start is 12 s:
    systemd times the start out, and the unit's journal names the phase."""
    name = "hang"
    text = yaml_for(host, "vllm", reserved_port(), env="  HOSTD_TEST_LOAD_SECONDS: '3600'\n")
    host.write_model_yaml(name, text.replace("timeouts: {start: 60, stop: 30}", "timeouts: {start: 12, stop: 10}"))
    host.systemctl("daemon-reload")
    unit = f"model-weights@{name}.service"
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    try:
        host.systemctl("start", "--no-block", unit)
        wait_for(lambda: "timeout" in host.systemctl("show", "-p", "Result", "-p", "NRestarts", unit).stdout
                 or "NRestarts=0" not in host.systemctl("show", "-p", "NRestarts", unit).stdout,
                 timeout=90, what="the hung start timed out")
        logged = host.run(["journalctl", "-u", unit, "--since", since, "-o", "cat", "--no-pager"]).stdout
        assert "the start hung in phase waiting for vllm's weight cache to load" in logged, logged[-2000:]
        assert "timeouts.start (12 s) is up" in logged
    finally:
        host.systemctl("stop", f"model@{name}.service", unit, check=False, timeout=60)
        host.run(["rm", "-f", f"/etc/hostd/models/{name}.yaml"])
        host.systemctl("reset-failed", check=False)


def test_an_engine_of_another_vllm_version_is_refused_naming_both_until_the_model_restarts(host):
    """Issue 52: vLLM keys its weight cache by its version, and hostd runs its
    engines without a fallback to disk; after `pip install -U vllm` into the
    model's environment the next engine (here a crash's restart) met a
    daemon of the old version and failed later, unclearly. The double's
    version is what its executable prints (its environment: the model's
    env:), so an upgrade in place is a changed HOSTD_TEST_VLLM_VERSION. The
    engine is refused, naming both versions; the documented recipe, a
    restart of the model (docs/vllm.md, Upgrading vLLM), serves on the new."""
    name, port = "upg", reserved_port()
    unit = f"model-engine@{name}.service"
    host.write_model_yaml(name, yaml_for(host, "vllm", port, env="  HOSTD_TEST_VLLM_VERSION: '0.32.0'\n"))
    host.systemctl("daemon-reload")
    try:
        host.systemctl("start", f"model@{name}.service", timeout=180)
        assert weights_status(host, name)["upstream_version"] == "0.32.0"
        host.write_model_yaml(name, yaml_for(host, "vllm", port, env="  HOSTD_TEST_VLLM_VERSION: '0.33.0'\n"))
        since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
        host.systemctl("restart", unit, timeout=120, check=False)
        wanted = (f"the weight daemon at /run/hostd/{name}/weights.sock runs vllm 0.32.0, this engine's vllm is "
                  "0.33.0 (upgraded in place since the daemon started?)")
        wait_for(lambda: wanted in host.run(["journalctl", "-u", unit, "--since", since, "-o", "cat", "--no-pager"])
                 .stdout, timeout=60, what="the refusal in the engine's journal")
        assert active_state(host, unit) != "active"
        host.systemctl("restart", f"model@{name}.service", timeout=180)  # the recipe's last step
        wait_for(lambda: active_state(host, unit) == "active", timeout=120, what="the engine on the new version")
        assert weights_status(host, name)["upstream_version"] == "0.33.0"
        assert engine_health(host, name)["upstream_version"] == "0.33.0"
    finally:
        host.systemctl("stop", f"model@{name}.service", check=False, timeout=60)
        host.run(["rm", "-f", f"/etc/hostd/models/{name}.yaml"])
        host.systemctl("reset-failed", check=False)


def active_state(host: SystemdContainer, unit: str) -> str:
    return host.systemctl("is-active", unit, check=False).stdout.strip()
