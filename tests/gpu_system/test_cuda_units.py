"""hostd as an administrator runs it, on a GPU: `hostd install`, the
generated units with packaging/hardening.conf, the weights and the engine as
two sandboxed services of the model's own user sharing one CUDA allocation,
the manager's NVML preflight, reloads, recovery and stop, under a real
systemd 252 (Debian 12's, in systemd-nspawn: debian_container.py).

One container for the module, one model (`qwen`: a random checkpoint in
Qwen2.5-7B's shape, `hostd make-checkpoint --size 7b`, builtin backend,
device cuda). Tests run in file order and each leaves the model serving for
the next, except the last (stop). They observe what an administrator would:
systemctl, busctl, hostctl and journalctl inside, the openai client on the
public address, NVML on the host. What they measure goes to
$HOSTD_GPU_TIER_RESULTS/results.json (docs/benchmarks.md, "under systemd on
the H200").
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import threading
import time
from argparse import Namespace
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from container import SystemdContainer, processes_in_pid_namespace, wait_for
from debian_container import CHECKOUT, DEBS, DebianSystemdContainer, unpack
from ports import reserved_port
import tier_configs
from test_manager import busctl, hostctl, last_operation, op_property, read_file, wait_operation

sys.path.insert(0, str(CHECKOUT / "benchmarks"))
import availability  # noqa: E402  (its load, memory sampler and table: the hand-run figures' own code)

MODEL = "qwen"
UMBRELLA, ENGINE, NEXT, WEIGHTS = (f"model@{MODEL}.service", f"model-engine@{MODEL}.service",
                                   f"model-engine-next@{MODEL}.service", f"model-weights@{MODEL}.service")
STANDBY = f"model-engine-standby@{MODEL}.service"
SPARE = f"model-engine-spare@{MODEL}.service"
DROPINS = f"/etc/hostd/models/{MODEL}.d"
INTENT = f"/var/lib/hostd/.manager/{MODEL}/reload-intent.json"
#: Where packaging/run-gpu-tier.sh writes the 7B checkpoint on the host
#: (NAME, then NAME.done when complete), bound read-only onto /srv/hostd.
CHECKPOINTS_ENV = "HOSTD_GPU_TIER_CHECKPOINTS"
MiB = 1 << 20


# ---------------------------------------------------------------- the host


class Gpu:
    """NVML on the host, which sees every process of the container (by host PID)."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def used(self) -> float:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used / MiB

    def of_process(self, host_pid: int) -> float | None:
        for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == host_pid:
                return (proc.usedGpuMemory or 0) / MiB
        return None

    def minor(self) -> int:
        return self.nvml.nvmlDeviceGetMinorNumber(self.handle)

    def count(self) -> int:
        return self.nvml.nvmlDeviceGetCount()

    def uuid(self) -> str:
        uuid = self.nvml.nvmlDeviceGetUUID(self.handle)
        return uuid.decode() if isinstance(uuid, bytes) else uuid


def host_pid(c: SystemdContainer, pid: int) -> int:
    """The host's PID of the container's process PID (NSpid's last field)."""
    for candidate in processes_in_pid_namespace(c.pid_namespace):
        try:
            status = Path(f"/proc/{candidate}/status").read_text()
        except OSError:
            continue
        nspid = next((l.split()[1:] for l in status.splitlines() if l.startswith("NSpid:")), [])
        if nspid and int(nspid[-1]) == pid:
            return candidate
    raise LookupError(f"no host process for container PID {pid}")


def main_pid(c: SystemdContainer, unit: str) -> int:
    return int(c.systemctl("show", "-p", "MainPID", "--value", unit).stdout.strip())


def active(c: SystemdContainer, unit: str) -> str:
    return c.systemctl("is-active", unit, check=False).stdout.strip()


def engine_health(c: SystemdContainer, slot: str = "engine") -> dict:
    """The engine's /health over its Unix socket, reached from the host through
    the container's root (/proc/PID1/root)."""
    path = f"/proc/{c.pid1}/root/run/hostd/{MODEL}/{slot}.sock"
    with httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=30) as http:
        return http.get("http://engine/health").json()


def model_state(c: SystemdContainer) -> str:
    result = busctl(c, "get-property", "org.hostd1", f"/org/hostd1/model/{MODEL}", "org.hostd1.Model", "State",
                    check=False)
    return result.stdout.split('"')[1] if result.returncode == 0 else ""


def client(c: SystemdContainer, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.base_url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def completes(c: SystemdContainer) -> bool:
    """Does the model answer a one-token completion now?"""
    try:
        client(c, timeout=10).completions.create(model=MODEL, prompt="Hello", max_tokens=1, temperature=0)
        return True
    except openai.APIError:
        return False


def journal(c: SystemdContainer, unit: str) -> str:
    return c.run(["journalctl", "-u", unit, "-o", "cat", "--no-pager"]).stdout


def running_max_num_seqs(c: SystemdContainer) -> int:
    return engine_health(c)["engine_config"]["max_num_seqs"]


def another_value(c: SystemdContainer, *taken: int) -> int:
    """A max_num_seqs the engine does not run now (a reload to the running value ends 'unchanged')."""
    current = running_max_num_seqs(c)
    return next(v for v in (6, 7, 8, 5, 9) if v != current and v not in taken)


def serving(c: SystemdContainer) -> None:
    """The model and the manager up, the model serving per the manager."""
    if getattr(c, "start_failed", False):
        pytest.skip("the model's first start failed (test_start_returns_once_serving...)")
    c.systemctl("start", UMBRELLA, "hostd.service", timeout=300)
    wait_for(lambda: model_state(c) == "serving", timeout=120, what="serving per the manager")


@contextlib.contextmanager
def strategy(c: SystemdContainer, name: str):
    c.write_file(f"{DROPINS}/40-strategy.yaml", tier_configs.strategy_dropin(name))
    try:
        yield
    finally:  # back to the tier's own (tier_configs.files), not the schema's default
        c.write_file(f"{DROPINS}/40-strategy.yaml", tier_configs.strategy_dropin(tier_configs.TIER_STRATEGY))


# ---------------------------------------------------------------- the container


@pytest.fixture(scope="module")
def gpu(device):
    return Gpu() if device == "cuda" else None


@pytest.fixture(scope="module")
def host(device, results, tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu-tier")
    started = time.monotonic()
    root = unpack(DEBS, work / "debian")
    c = DebianSystemdContainer(checkout=CHECKOUT, workdir=work / "nspawn", debian_root=root, boot_timeout=180)
    checkpoints = os.environ.get(CHECKPOINTS_ENV)
    if device == "cuda":
        if not checkpoints:
            pytest.fail(f"{CHECKPOINTS_ENV} is unset: packaging/run-gpu-tier.sh writes the 7B checkpoint there")
        c.add_bind(checkpoints, "/srv/hostd")
    c.start()
    results["boot_s"] = round(time.monotonic() - started, 1)
    try:
        c.sh("chmod o+x /root")  # a Python or checkout under /root (the container's own /root)
        t0 = time.monotonic()
        c.run([c.python, "-m", "hostd.main", "install"], timeout=300)
        results["install_s"] = round(time.monotonic() - t0, 1)
        if device == "cuda":
            done = Path(checkpoints) / f"{MODEL}.done"
            wait_for(done.exists, timeout=600, interval=1, what=f"the 7B checkpoint ({done})")
            model_dir = f"/srv/hostd/{MODEL}"
            c.weights_mib = sum(f.stat().st_size for f in (Path(checkpoints) / MODEL).glob("*.safetensors")) / MiB
        else:
            model_dir = f"/var/lib/hostd/checkpoints/{MODEL}"
            c.run([c.python, "-m", "hostd.main", "make-checkpoint", model_dir], timeout=300)
            c.weights_mib = None
        port = reserved_port()
        c.base_url = f"http://127.0.0.1:{port}"
        c.write_file(f"/etc/hostd/models/{MODEL}.yaml", tier_configs.model_yaml(model_dir, device, port))
        c.systemctl("daemon-reload")
        c.systemctl("start", "hostd.service", timeout=120)
        yield c
    finally:
        results.write("journal.txt", c.run(["journalctl", "-o", "short-monotonic", "--no-pager"],
                                           check=False, timeout=120).stdout if c.running else "")
        c.stop()


# ---------------------------------------------------------------- start


def test_start_returns_once_serving_and_the_engine_maps_the_daemons_one_copy(host, gpu, results):
    baseline = gpu.used() if gpu else None
    t0 = time.monotonic()
    start = host.systemctl("start", UMBRELLA, check=False, timeout=900)
    results["start_s"] = round(time.monotonic() - t0, 1)
    if start.returncode != 0:
        host.start_failed = True
        unit_dir, generated = "/usr/local/lib/systemd/system", "/run/systemd/generator"
        error, keys = culprits(host, sandbox_of(host, f"{unit_dir}/model-weights@.service",
                                                f"{generated}/{WEIGHTS}.d/50-hostd.conf"), CUDA_INIT)
        results["weights_cuda"] = {"error": error, "works_without": keys}
        pytest.fail(f"systemctl start {UMBRELLA} failed: {start.stderr.strip()}; CUDA in the weights unit's "
                    f"sandbox: {error[-500:] or 'works'}; works without any one of: {keys}")
    assert completes(host)  # no waiting: when `systemctl start` returns, the model answers
    health = engine_health(host)
    assert health["weights"] == "daemon" and health["tensors_outside_shared"] == 0, health
    assert health["weights_pid"] == main_pid(host, WEIGHTS)
    if gpu is None:
        return
    host.gpu_baseline = baseline
    daemon = gpu.of_process(host_pid(host, main_pid(host, WEIGHTS)))
    engine = gpu.of_process(host_pid(host, main_pid(host, ENGINE)))
    used = gpu.used()
    results["memory_mib"] = {"weights": round(host.weights_mib), "baseline": round(baseline),
                             "daemon_process": daemon, "engine_process": engine, "used_serving": round(used),
                             "shared_bytes": health["shared_bytes"]}
    assert health["shared_bytes"] >= 0.99 * host.weights_mib * MiB  # the files' size less their headers
    assert daemon is not None and daemon >= host.weights_mib  # the weights are the daemon's allocation
    # The batched engine's paged KV cache (its /health reports it) is its own,
    # allocated at start; beyond it the engine holds its context, workspace and
    # one step's logits, not a copy: on the H200 (7B, max_num_seqs 8) 16312 MiB
    # with a 10752 MiB KV cache, i.e. 5560 MiB besides, against 14526 of weights.
    kv = (health.get("kv_cache_bytes") or 0) / MiB
    assert engine is not None and engine - kv < host.weights_mib / 2, (engine, kv)
    assert used - baseline - kv < host.weights_mib + 8192  # one copy on the GPU, plus two processes' own


#: Lines of a unit's [Service] that are not its sandbox (systemd-run gets the rest).
NOT_SANDBOX = ("Type", "BusName", "NotifyAccess", "ExecStart", "ExecStartPost", "ExecReload", "ExecStopPost",
               "Restart", "RestartSec", "KillMode", "TimeoutStartSec", "TimeoutStopSec", "MemoryMax", "LimitNOFILE")
#: How a drop-in turns a directive off (default "no").
OFF = {"ProcSubset": "all", "ProtectProc": "default", "DevicePolicy": "auto", "RestrictAddressFamilies": "",
       "SystemCallFilter": "", "CapabilityBoundingSet": "~", "TemporaryFileSystem": "", "ReadWritePaths": ""}
NVML_COUNT = "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())"
CUDA_INIT = "import torch; print(torch.ones(1 << 20, device='cuda').sum().item())"


def sandbox_of(c: SystemdContainer, *unit_files: str) -> list[str]:
    """The Key=value lines of the [Service] sections of UNIT_FILES (a unit and
    its drop-ins) that sandbox it, for the model's instance."""
    lines, section = [], ""
    for unit_file in unit_files:
        for line in c.read_file(unit_file).splitlines():
            if line.startswith("["):
                section = line
            elif section == "[Service]" and "=" in line and not line.startswith("#"):
                if line.split("=", 1)[0] not in NOT_SANDBOX:
                    lines.append(line.replace("%i", MODEL).replace("%C", "/var/cache"))
    return lines


def run_in(c: SystemdContainer, sandbox: list[str], code: str):
    args = ["systemd-run", "--wait", "--pipe", "--quiet", *(f"--property={l}" for l in sandbox),
            c.python, "-c", code]
    return c.run(args, check=False, timeout=120)


def culprits(c: SystemdContainer, sandbox: list[str], code: str) -> tuple[str, list[str]]:
    """('' when CODE runs in SANDBOX, else its error; the directives without
    any one of which it runs)."""
    shipped = run_in(c, sandbox, code)
    if shipped.returncode == 0:
        return "", []
    keys = sorted({l.split("=", 1)[0] for l in sandbox} - {"User", "Group", "Environment", "DeviceAllow"})
    return ((shipped.stdout + shipped.stderr).strip()[-1500:],
            [k for k in keys if run_in(c, [l for l in sandbox if not l.startswith(k + "=")], code).returncode == 0])


def test_nvml_reads_in_the_managers_sandbox(host, gpu, results):
    """The reload's preflight reads GPU memory through NVML from inside
    hostd.service's sandbox. If it cannot, the test names the directive that
    stops it and turns that one off in a drop-in for the rest of the module,
    so that the reloads are still measured (and fails)."""
    sandbox = sandbox_of(host, "/usr/local/lib/systemd/system/hostd.service")
    if gpu is None:  # the harness itself: systemd-run takes every line of the sandbox
        assert culprits(host, sandbox, "print('sandboxed')") == ("", [])
        pytest.skip("CUDA only: NVML needs the NVIDIA driver")
    error, keys = culprits(host, sandbox, NVML_COUNT)
    results["manager_nvml"] = {"error": error, "works_without": keys}
    if not error:
        return
    if keys:
        host.write_file("/etc/systemd/system/hostd.service.d/90-gpu-tier.conf",
                        "[Service]\n" + "".join(f"{k}={OFF.get(k, 'no')}\n" for k in keys[:1]))
        host.systemctl("daemon-reload")
        host.systemctl("restart", "hostd.service", timeout=120)
    pytest.fail(f"NVML fails in hostd.service's sandbox ({error[-500:]}); it works with any one of {keys or 'none'} "
                f"left out (the rest of this module runs with {keys[:1]} off)")


def test_device_allow_lines_match_the_gpus_nvml_minor(host, gpu, results):
    if gpu is None:
        pytest.skip("CUDA only: a cpu model gets no DeviceAllow=")
    minor = gpu.minor()
    for unit in (WEIGHTS, ENGINE, NEXT):
        allowed = host.systemctl("show", "-p", "DeviceAllow", "--value", unit).stdout
        env = host.systemctl("show", "-p", "Environment", "--value", unit).stdout
        assert f"/dev/nvidia{minor} rw" in allowed, (unit, allowed)
        assert "/dev/nvidiactl rw" in allowed and "/dev/nvidia-uvm rw" in allowed, (unit, allowed)
        assert "char-nvidia-frontend" not in allowed, (unit, allowed)
        assert "CUDA_VISIBLE_DEVICES=0" in env and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in env, (unit, env)
    results["device_allow"] = {"nvml_minor": minor, WEIGHTS: allowed.strip()}


def test_a_model_on_a_gpu_this_host_lacks_fails_at_once_saying_so(host, gpu, results):
    if gpu is None:
        pytest.skip("CUDA only: the GPU count comes from NVML")
    count = gpu.count()
    host.write_file("/etc/hostd/models/absent.yaml",
                    f"backend: builtin\nmodel: /srv/hostd/{MODEL}\ndevice: cuda\ngpus: [{count}]\n"
                    f"listen: 127.0.0.1:{reserved_port()}\n")
    try:
        host.systemctl("daemon-reload")
        t0 = time.monotonic()
        start = host.systemctl("start", "model@absent.service", check=False, timeout=300)
        results["absent_gpu_start_fails_s"] = round(time.monotonic() - t0, 1)
        assert start.returncode != 0
        said = journal(host, "model@absent.socket")
        assert f"gpus: [{count}]: this host has {count} GPU" in said and f"GPU {count} does not exist" in said, said
        assert active(host, "model-weights@absent.service") == "inactive"  # never started
        assert completes(host)  # the other model is untouched
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/absent.yaml"])
        host.systemctl("reset-failed", check=False)
        host.systemctl("daemon-reload")


def test_a_model_may_name_its_gpu_by_uuid_and_an_absent_uuid_fails_at_once(host, gpu, results):
    """Issue 55, item 3: `gpus: ["GPU-…"]` gets the same GPU's /dev node as
    its index and CUDA_VISIBLE_DEVICES with the UUID (CUDA takes it as it is);
    a UUID this host lacks fails the start at once, naming it. No engine
    starts: the generator's lines and the refused start are the check."""
    if gpu is None:
        pytest.skip("CUDA only: the UUID comes from NVML")
    uuid, absent = gpu.uuid(), "GPU-00000000-0000-0000-0000-000000000000"
    for name, named in (("byuuid", uuid), ("absentuuid", absent)):
        host.write_file(f"/etc/hostd/models/{name}.yaml",
                        f"backend: builtin\nmodel: /srv/hostd/{MODEL}\ndevice: cuda\ngpus: [{named}]\n"
                        f"listen: 127.0.0.1:{reserved_port()}\n")
    try:
        host.systemctl("daemon-reload")
        for unit in ("model-weights@byuuid.service", "model-engine@byuuid.service"):
            allowed = host.systemctl("show", "-p", "DeviceAllow", "--value", unit).stdout
            env = host.systemctl("show", "-p", "Environment", "--value", unit).stdout
            assert f"/dev/nvidia{gpu.minor()} rw" in allowed and "char-nvidia-frontend" not in allowed, (unit, allowed)
            assert f"CUDA_VISIBLE_DEVICES={uuid}" in env, (unit, env)
        start = host.systemctl("start", "model@absentuuid.service", check=False, timeout=300)
        assert start.returncode != 0
        said = journal(host, "model@absentuuid.socket")
        assert f"NVML knows no GPU or MIG device {absent} on this host" in said, said
        assert active(host, "model-weights@absentuuid.service") == "inactive"  # never started
        results["gpu_by_uuid"] = {"uuid": uuid, "minor": gpu.minor()}
    finally:
        host.run(["rm", "-f", "/etc/hostd/models/byuuid.yaml", "/etc/hostd/models/absentuuid.yaml"])
        host.systemctl("reset-failed", check=False)
        host.systemctl("daemon-reload")


def test_systemd_analyze_security_rates_the_units_as_run_here(host, results):
    scores = {}
    for unit in (UMBRELLA, ENGINE, NEXT, WEIGHTS, "hostd.service"):
        out = host.run(["systemd-analyze", "security", "--no-pager", unit], check=False).stdout
        match = re.search(r"Overall exposure level for \S+: (\d+\.\d) (\w+)", out)
        assert match, out[-2000:]
        scores[unit] = f"{match.group(1)} {match.group(2)}"
    results["security"] = scores
    assert all(float(s.split()[0]) <= 3.0 for s in scores.values()), scores


# ---------------------------------------------------------------- reloads


def reload_by_hostctl(c: SystemdContainer, value: int) -> str:
    result = hostctl(c, "reload", MODEL, f"max_num_seqs={value}")
    assert result.returncode == 0, result.stdout + result.stderr
    return last_operation(c)


def reload_by_busctl(c: SystemdContainer, value: int) -> str:
    out = busctl(c, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload",
                 "sa{sv}", MODEL, "1", "max_num_seqs", "u", str(value)).stdout
    path = out.split('"')[1]
    wait_operation(c, path)
    return path


def reload_by_systemctl(c: SystemdContainer, value: int) -> str:
    """An administrator's drop-in, then `systemctl reload` (the config on disk)."""
    c.run(["rm", "-f", f"{DROPINS}/90-reload.yaml"])  # the manager's own would win over it
    c.write_file(f"{DROPINS}/50-admin.yaml", f"engine:\n  max_num_seqs: {value}\n")
    c.systemctl("reload", UMBRELLA, timeout=900)
    return last_operation(c)


def gateway_metric(c: SystemdContainer, name: str) -> float:
    text = httpx.get(c.base_url + "/metrics", timeout=30).text
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name))


def reloads_under_load(c: SystemdContainer, name: str, doors, gpu) -> availability.Run:
    """availability.py's load (4 streaming clients, no retries, 32 tokens each)
    while each of DOORS reloads the model once, 3 s apart; its Run."""
    run = availability.Run(name)
    stop = threading.Event()
    port = int(c.base_url.rsplit(":", 1)[1])
    sampler = availability.MemorySampler(gpu is not None)
    sampler.start()
    threads = [threading.Thread(target=availability.client_loop,
                                args=(port, MODEL, 32, stop, run.outcomes))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3.0)
        first = time.monotonic()
        value = running_max_num_seqs(c)
        for door in doors:
            value = another_value(c, value)
            t0 = time.monotonic()
            path = door(c, value)
            run.reloads.append((t0, time.monotonic()))
            state, used = op_property(c, path, "State"), op_property(c, path, "Strategy")
            if (state, used) != ("done", name) or op_property(c, path, "WeightsReused") is not True:
                run.failures.append(f"{door.__name__}: {state} (strategy {used}): {op_property(c, path, 'Error')}")
            time.sleep(3.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)
        sampler.stopping.set()
        sampler.join()
    run.memory = sampler.summary(run.reloads, first)
    return run


def test_reloads_of_both_strategies_under_streaming_load_lose_nothing(host, gpu, results):
    serving(host)
    runs, unavailable = [], {}
    for name, doors in (("restart", (reload_by_hostctl, reload_by_systemctl)),
                        ("overlap", (reload_by_busctl, reload_by_systemctl))):
        with strategy(host, name):
            before = gateway_metric(host, "hostd_gateway_reload_unavailable_seconds_sum")
            runs.append(reloads_under_load(host, name, doors, gpu))
            unavailable[name] = round(gateway_metric(host, "hostd_gateway_reload_unavailable_seconds_sum") - before, 2)
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        availability.report(runs, Namespace(backend="builtin", clients=4, max_tokens=32, seconds=0, reloads=2,
                                            device="cuda" if gpu else "cpu", size="7b" if gpu else "tiny"))
    results["availability_table"] = table.getvalue()
    results["gateway_unavailable_s"] = unavailable
    results["reload_s"] = {r.strategy: [round(b - a, 2) for a, b in r.reloads] for r in runs}
    for run in runs:
        kinds = [o.kind for o in run.outcomes]
        assert not run.failures, run.failures
        assert kinds.count("lost") == 0 and kinds.count("error") == 0, (run.strategy, sorted(
            {o.detail for o in run.outcomes if o.kind in ("lost", "error")}))
        assert kinds.count("completed") > 0
    overlap = runs[1]
    assert [o.kind for o in overlap.outcomes].count("503") == 0  # overlap: 0 s of 503
    assert unavailable["overlap"] == 0
    assert "(strategy overlap: room for a second engine" in journal(host, "hostd.service")


def test_an_in_place_reload_under_streaming_load_starts_no_process(host, gpu, results):
    """reload.strategy: in-place (issue 50) on CUDA, through busctl and
    `systemctl reload` under the tier's load: no request answered 503 or
    lost, the engine's and the weight daemon's MainPIDs unchanged, the new
    value served; the seconds until it serves (the engine's /health, polled)
    and the whole reload; NVML before, the peak during, and after (the old
    runner's KV cache freed: back near where it was)."""
    serving(host)
    engine, weights = main_pid(host, ENGINE), main_pid(host, WEIGHTS)
    figures: dict = {"reloads": []}
    with strategy(host, "in-place"):
        for door in (reload_by_busctl, reload_by_systemctl):
            target = another_value(host)
            served: list[float] = []
            peak = [gpu.used() if gpu is not None else 0.0]
            before = peak[0]

            def watch(started: float, done: threading.Event) -> None:
                while not done.is_set():
                    if gpu is not None:
                        peak.append(gpu.used())
                    if not served and running_max_num_seqs(host) == target:
                        served.append(round(time.monotonic() - started, 3))
                    time.sleep(0.02)

            with streaming_load(host, gpu, "in-place") as run:
                done = threading.Event()
                t0 = time.monotonic()
                watcher = threading.Thread(target=watch, args=(t0, done))
                watcher.start()
                path = door(host, target)
                reload_s = round(time.monotonic() - t0, 2)
                time.sleep(1.0)
                done.set()
                watcher.join()
            counts = outcome_counts(run)
            state, used = op_property(host, path, "State"), op_property(host, path, "Strategy")
            figures["reloads"].append({
                "door": door.__name__, "state": state, "strategy": used, "reload_s": reload_s,
                "new_config_serves_s": served[0] if served else None, "notes": op_property(host, path, "Notes"),
                "gpu_mib": {"before": round(before), "peak": round(max(peak)),
                            "after": round(gpu.used()) if gpu is not None else 0}, **counts})
            results["in_place"] = figures
            assert (state, used) == ("done", "in-place"), (state, used, op_property(host, path, "Error"))
            assert op_property(host, path, "WeightsReused") is True
            assert counts["503"] == 0 and counts["lost"] == 0 and counts["error"] == 0, (counts, sorted(
                {o.detail for o in run.outcomes if o.kind != "completed"}))
            assert counts["completed"] > 0 and running_max_num_seqs(host) == target
            assert (main_pid(host, ENGINE), main_pid(host, WEIGHTS)) == (engine, weights)  # no process started
    assert completes(host)


def test_the_nvml_preflight_finding_no_room_falls_back_to_restart_and_says_why(host, gpu, results):
    serving(host)
    # More than any GPU has must stay free beside a second engine.
    host.write_file(f"{DROPINS}/40-reserve.yaml", "reload:\n  overlap_reserve_mib: 100000000\n")
    try:
        result = hostctl(host, "reload", MODEL, f"max_num_seqs={another_value(host)}")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"reload of {MODEL}: done (strategy restart, weights reused)" in result.stdout
        said = [l for l in journal(host, "hostd.service").splitlines() if "falling back to restart" in l]
        assert said and "overlap_reserve_mib=100000000" in said[-1], said
        if gpu is not None:  # NVML's numbers, not "cannot read GPU memory"
            assert re.search(r"GPU 0: a second engine needs about \d+ MiB .* but \d+ MiB are free", said[-1]), said
        results["preflight_fallback"] = said[-1]
    finally:
        host.run(["rm", "-f", f"{DROPINS}/40-reserve.yaml"])


def test_a_reload_the_engine_refuses_rolls_back_and_the_old_engine_keeps_serving(host, results):
    serving(host)
    engine = main_pid(host, ENGINE)
    before = read_file(host, f"{DROPINS}/90-reload.yaml")
    t0 = time.monotonic()
    result = hostctl(host, "reload", MODEL, "max_model_len=99999")
    results["refused_reload_rolled_back_s"] = round(time.monotonic() - t0, 1)
    assert result.returncode == 1
    path = last_operation(host)
    assert op_property(host, path, "State") == "rolled-back"
    assert "max_position_embeddings" in op_property(host, path, "Error")  # the new engine's own words
    assert main_pid(host, ENGINE) == engine
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == before
    assert completes(host)


# ---------------------------------------------------------------- recovery


def seconds_to_serve_again(c: SystemdContainer, t0: float, replaced=()) -> float:
    """Seconds from T0 until every unit of REPLACED runs a new main process
    ({unit: old PID}) and the model answers a completion."""
    # A completion first: the gateway is started again by the connection it makes.
    wait_for(lambda: completes(c) and all(main_pid(c, u) not in (0, old) for u, old in dict(replaced).items()),
             timeout=600, interval=0.2, what="serving again")
    return round(time.monotonic() - t0, 1)


@pytest.mark.parametrize("unit", [ENGINE, WEIGHTS, UMBRELLA])
def test_kill_9_of_a_model_unit_recovers(host, unit, results):
    serving(host)
    before = {u: main_pid(host, u) for u in (ENGINE, WEIGHTS, UMBRELLA)}
    t0 = time.monotonic()
    host.run(["kill", "-9", str(before[unit])])
    # The engine goes with its weights (BindsTo=): until both are new, an
    # answer may still come from the old engine on the mapping it holds.
    replaced = {ENGINE: before[ENGINE], WEIGHTS: before[WEIGHTS]} if unit == WEIGHTS else {unit: before[unit]}
    took = seconds_to_serve_again(host, t0, replaced)
    results[f"recovery_s.{unit}"] = took
    after = {u: main_pid(host, u) for u in (ENGINE, WEIGHTS)}
    if unit == UMBRELLA:  # the gateway alone: engine and weights untouched
        assert after == {u: before[u] for u in (ENGINE, WEIGHTS)}
    else:
        assert after[ENGINE] != before[ENGINE]
        assert (after[WEIGHTS] != before[WEIGHTS]) == (unit == WEIGHTS)
    assert engine_health(host)["weights_pid"] == after[WEIGHTS]


def test_manager_killed_mid_drain_recovers_leaving_the_engine_alone(host, gpu, results):
    serving(host)
    engine = main_pid(host, ENGINE)
    # Streams that hold the drain open for about 10 s (7B on the H200: ~11 tokens/s each).
    tokens = 128 if gpu else 480
    with strategy(host, "restart"), ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(lambda: sum(1 for _ in client(host, 600).completions.create(
            model=MODEL, prompt="x", max_tokens=tokens, temperature=0, stream=True, extra_body={"ignore_eos": True})))
            for _ in range(4)]
        wait_for(lambda: engine_health(host)["running"] >= 4, timeout=60, what="4 streams running")
        path = hostctl(host, "reload", MODEL, f"max_num_seqs={another_value(host)}", "--no-wait",
                       check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") == "drain", timeout=60, interval=0.05, what="draining")
        t0 = time.monotonic()
        host.run(["kill", "-9", str(main_pid(host, "hostd.service"))])
        wait_for(lambda: host.run(["test", "-e", INTENT], check=False).returncode == 1, timeout=300,
                 what="intent record resolved")
        took = seconds_to_serve_again(host, t0)
        tokens = [s.result(600) for s in streams]
    results["recovery_s.manager_mid_drain"] = took
    assert len(set(tokens)) == 1 and tokens[0] > 0, tokens  # every stream, in full
    assert main_pid(host, ENGINE) == engine
    assert "engine left alone" in journal(host, "hostd.service")


def test_manager_killed_mid_overlap_recovers_with_exactly_one_engine(host, results):
    serving(host)
    with strategy(host, "overlap"):
        path = hostctl(host, "reload", MODEL, f"max_num_seqs={another_value(host)}", "--no-wait",
                       check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") in ("start-next", "switch", "restart"), timeout=120,
                 interval=0.05, what="the overlap under way")
        t0 = time.monotonic()
        host.run(["kill", "-9", str(main_pid(host, "hostd.service"))])
        wait_for(lambda: active(host, "hostd.service") == "active", timeout=120, what="manager back")
        wait_for(lambda: host.run(["test", "-e", INTENT], check=False).returncode == 1, timeout=600,
                 what="intent record resolved")
        took = seconds_to_serve_again(host, t0)
        wait_for(lambda: active(host, NEXT) in ("inactive", "failed"), timeout=300, what="the second engine stopped")
    results["recovery_s.manager_mid_overlap"] = took
    assert active(host, ENGINE) == "active"
    on_disk = json.loads(hostctl(host, "config", MODEL, "--json", check=True).stdout)["data"]
    assert running_max_num_seqs(host) == on_disk["engine.max_num_seqs"]["value"]  # committed or rolled back


# ---------------------------------------------------------------- the warm standby


# ---------------------------------------------------------------- checkpoint swap


def test_a_checkpoint_swap_under_load_loses_nothing_and_peaks_at_two_copies(host, gpu, results):
    """Issue 36: `model:` changed by `hostctl reload` under the tier's load
    (4 streaming clients, no retries): a second weight daemon loads the
    second 7B checkpoint (packaging/run-gpu-tier.sh writes it, another seed)
    beside the serving pair, its engine serves while the main pair restarts
    on it, then both retire. No request answered 503 or lost; the main
    engine serves the new digest; NVML shows two copies of the weights at
    the peak and one after."""
    serving(host)
    checkpoints = os.environ.get(CHECKPOINTS_ENV)
    if gpu is not None:
        done = Path(checkpoints) / f"{MODEL}-v2.done"
        wait_for(done.exists, timeout=600, interval=1, what=f"the second 7B checkpoint ({done})")
        target = f"/srv/hostd/{MODEL}-v2"
    else:
        target = f"/var/lib/hostd/checkpoints/{MODEL}-v2"
        host.run([host.python, "-m", "hostd.main", "make-checkpoint", "--seed", "2", target], timeout=300)
    before = engine_health(host)
    assert before["checkpoint"] != target
    peak, sampling = [0.0], threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            peak[0] = max(peak[0], gpu.used())
            time.sleep(0.05)

    sampler = threading.Thread(target=sample) if gpu is not None else None
    with streaming_load(host, gpu, "swap") as run:
        if sampler is not None:
            sampler.start()
        t0 = time.monotonic()
        result = hostctl(host, "reload", MODEL, f"model={target}")
        swap_s = round(time.monotonic() - t0, 1)
        sampling.set()
        if sampler is not None:
            sampler.join()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"reload of {MODEL}: done (strategy swap)" in result.stdout, result.stdout
    counts = outcome_counts(run)
    figures = {"swap_s": swap_s, **counts, "notes": op_property(host, last_operation(host), "Notes")}
    after = engine_health(host)
    assert after["checkpoint"] == target and after["content_digest"] != before["content_digest"]
    assert after["weights_pid"] == main_pid(host, WEIGHTS) and after["tensors_outside_shared"] == 0
    assert active(host, f"model-weights-next@{MODEL}.service") == "inactive"
    assert active(host, f"model-engine-swap@{MODEL}.service") == "inactive"
    # The swap's engine held the bridge's KV cache (reload.bridge_kv_mib,
    # 2048 by default), not a second full one: its start line says so.
    swap_journal = host.run(["journalctl", "-u", f"model-engine-swap@{MODEL}.service", "-o", "cat",
                             "--no-pager"]).stdout
    started = [json.loads(line.split("weights from daemon: ", 1)[1].split("; phases ", 1)[0])
               for line in swap_journal.splitlines() if "weights from daemon: " in line]
    assert started, swap_journal[-2000:]
    figures["swap_engine_kv_mib"] = started[-1]["kv_cache_bytes"] / MiB
    assert started[-1]["kv_cache_bytes"] == min(2048 * MiB, after["kv_cache_bytes"])
    if gpu is not None:
        kv = (after.get("kv_cache_bytes") or 0) / MiB
        daemon = gpu.of_process(host_pid(host, main_pid(host, WEIGHTS)))
        used = gpu.used()
        figures["memory_mib"] = {"weights": round(host.weights_mib), "baseline": round(host.gpu_baseline),
                                 "peak": round(peak[0]), "after": round(used), "daemon_process": daemon}
        assert peak[0] - host.gpu_baseline >= 2 * host.weights_mib  # two copies at the peak
        assert daemon is not None and daemon >= host.weights_mib
        assert used - host.gpu_baseline - kv < host.weights_mib + 8192  # one copy after
    results["swap"] = figures
    assert counts["503"] == 0 and counts["lost"] == 0 and counts["error"] == 0, (counts, sorted(
        {o.detail for o in run.outcomes if o.kind != "completed"}))
    assert counts["completed"] > 0


def standby_answers(c: SystemdContainer) -> dict | None:
    try:
        return engine_health(c, "engine-standby")
    except (httpx.HTTPError, OSError, ValueError):
        return None


@contextlib.contextmanager
def streaming_load(c: SystemdContainer, gpu, name: str):
    """availability.py's load (4 streaming clients, no retries, 32 tokens
    each) for the with-block and 3 s either side; yields its Run."""
    run = availability.Run(name)
    stop = threading.Event()
    port = int(c.base_url.rsplit(":", 1)[1])
    threads = [threading.Thread(target=availability.client_loop, args=(port, MODEL, 32, stop, run.outcomes))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        time.sleep(3.0)
        yield run
        time.sleep(3.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(300)


def outcome_counts(run: availability.Run) -> dict:
    kinds = [o.kind for o in run.outcomes]
    return {k: kinds.count(k) for k in ("completed", "503", "lost", "error")}


def test_the_warm_standby_reloads_under_load_and_takes_over_a_killed_engine(host, gpu, results):
    """standby: true (a fixed key: a drop-in, daemon-reload and a restart of
    the model, as docs/configuration.md says): a third engine process on the
    same weights, warm. A standby reload through hostctl under the tier's load
    answers no request 503 and loses none; kill -9 of the main engine with the
    standby up answers no new request 503 while systemd restarts it; NVML
    shows one copy of the weights under three engine processes' contexts."""
    serving(host)
    host.write_file(f"{DROPINS}/30-standby.yaml", tier_configs.STANDBY_DROPIN)
    try:
        host.systemctl("daemon-reload")
        t0 = time.monotonic()
        host.systemctl("restart", UMBRELLA, timeout=900)
        wait_for(lambda: model_state(host) == "serving", timeout=300, what="serving per the manager")
        wait_for(lambda: standby_answers(host) is not None, timeout=600, interval=0.5, what="the standby warm")
        figures = {"start_with_standby_s": round(time.monotonic() - t0, 1)}
        standby = standby_answers(host)
        assert standby["slot"] == "standby" and standby["tensors_outside_shared"] == 0, standby
        assert standby["weights_pid"] == main_pid(host, WEIGHTS)
        assert standby["engine_config"] == engine_health(host)["engine_config"]
        # Idle, the standby holds reload.standby_kv_mib (256 MiB by default) of KV, not its full budget (issue 34).
        assert standby["kv_budget"] == "idle" and standby["kv_cache_bytes"] <= 256 * MiB, standby
        if gpu is not None:
            weights = gpu.of_process(host_pid(host, main_pid(host, WEIGHTS)))
            engines = {u: gpu.of_process(host_pid(host, main_pid(host, u))) for u in (ENGINE, STANDBY)}
            kv = {ENGINE: engine_health(host).get("kv_cache_bytes") or 0, STANDBY: standby.get("kv_cache_bytes") or 0}
            figures["memory_mib"] = {"weights_process": weights, **{u.split("@")[0]: m for u, m in engines.items()},
                                     "kv_mib": {u.split("@")[0]: round(b / MiB) for u, b in kv.items()},
                                     "used": round(gpu.used()), "baseline": round(host.gpu_baseline)}
            assert weights is not None and weights >= host.weights_mib  # the one copy: the daemon's
            for unit, mib in engines.items():  # each engine: its context, workspace and KV cache, no copy
                assert mib is not None and mib - kv[unit] / MiB < host.weights_mib / 2, (unit, mib, kv[unit])
            assert engines[STANDBY] < engines[ENGINE], engines  # the idle standby: no full KV budget of its own
            assert gpu.used() - host.gpu_baseline - sum(kv.values()) / MiB < host.weights_mib + 3 * 8192

        # A standby reload through hostctl, under load.
        target = another_value(host)
        rebuilt: list[float] = []

        def watch(started: float, done: threading.Event) -> None:
            while not done.is_set():
                health = standby_answers(host)
                if health and health["engine_config"]["max_num_seqs"] == target:
                    rebuilt.append(round(time.monotonic() - started, 2))
                    return
                time.sleep(0.05)

        with streaming_load(host, gpu, "standby") as run:
            done = threading.Event()
            t0 = time.monotonic()
            watcher = threading.Thread(target=watch, args=(t0, done))
            watcher.start()
            result = hostctl(host, "reload", MODEL, f"max_num_seqs={target}")
            reload_s = round(time.monotonic() - t0, 2)
            done.set()
            watcher.join()
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"reload of {MODEL}: done (strategy standby, weights reused)" in result.stdout, result.stdout
        path = last_operation(host)
        notes = op_property(host, path, "Notes")
        counts = outcome_counts(run)
        figures["reload"] = {"reload_s": reload_s, "standby_on_new_config_s": rebuilt[0] if rebuilt else None,
                             "notes": notes, **counts}
        assert counts["503"] == 0 and counts["lost"] == 0 and counts["error"] == 0, (counts, sorted(
            {o.detail for o in run.outcomes if o.kind != "completed"}))
        assert counts["completed"] > 0 and running_max_num_seqs(host) == target
        wait_for(lambda: (standby_answers(host) or {}).get("engine_config") == engine_health(host)["engine_config"],
                 timeout=120, what="the standby on the committed config")

        # kill -9 of the main engine, the standby up.
        engine = main_pid(host, ENGINE)
        with streaming_load(host, gpu, "failover") as run:
            t0 = time.monotonic()
            host.run(["kill", "-9", str(engine)])
            wait_for(lambda: completes(host), timeout=120, interval=0.05, what="answered again")
            answered_s = round(time.monotonic() - t0, 2)
            wait_for(lambda: main_pid(host, ENGINE) not in (0, engine) and active(host, ENGINE) == "active",
                     timeout=600, interval=0.5, what="the main engine restarted by systemd")
            main_back_s = round(time.monotonic() - t0, 1)
        counts = outcome_counts(run)
        figures["failover"] = {"answered_again_s": answered_s, "main_back_s": main_back_s, **counts}
        grown = standby_answers(host) or {}  # switched in (it keeps the full budget for 10 s after its last request)
        figures["failover"]["standby_kv"] = {k: grown.get(k) for k in ("kv_budget", "kv_cache_bytes", "grow_s")}
        results["standby"] = figures
        # Streams running on the killed engine were cut (as without a
        # standby); no new request was answered 503.
        assert counts["503"] == 0 and counts["completed"] > 0, counts
        wait_for(lambda: completes(host), timeout=120, what="serving")
    finally:
        host.run(["rm", "-f", f"{DROPINS}/30-standby.yaml"])
        host.systemctl("daemon-reload")


def from_the_spare(c: SystemdContainer) -> int:
    """The engine's MainPID, checked to be a process forked from the spare
    (its command line is the spare's) that systemd moved into the engine unit."""
    wait_for(lambda: active(c, ENGINE) == "active", timeout=120, what="the engine unit active")
    pid = main_pid(c, ENGINE)
    assert engine_health(c)["pid"] == pid
    assert c.read_file(f"/proc/{pid}/cmdline") == c.read_file(f"/proc/{main_pid(c, SPARE)}/cmdline")
    # systemd's own hierarchy: cgroup v1 there (legacy: "System is tainted: cgroupsv1").
    assert any(line.endswith(f"/{ENGINE}") for line in c.read_file(f"/proc/{pid}/cgroup").splitlines()
               if ":name=systemd:" in line or line.startswith("0::"))
    return pid


def test_the_pre_imported_spare_starts_the_engine_and_restarts_it_after_kill_9(host, gpu, results):
    """spare: true (issue 51): model-engine-spare@ imports torch, transformers
    and the model's code and holds nothing on the GPU; a restart of the
    engine unit and a kill -9 of its main process (Restart=) each start the
    engine from a process forked from it, which systemd takes as the engine
    unit's main process, attached to the daemon's one copy of the weights."""
    serving(host)
    # The standby left running by the test before (its drop-in gone, it stops
    # at the next restart of the model) would answer while the engine
    # restarts: the kill below measures the main engine coming back alone.
    host.systemctl("stop", STANDBY, timeout=120)
    host.write_file(f"{DROPINS}/35-spare.yaml", tier_configs.SPARE_DROPIN)
    try:
        host.systemctl("daemon-reload")
        t0 = time.monotonic()
        host.systemctl("start", SPARE, timeout=300)
        figures = {"spare_ready_s": round(time.monotonic() - t0, 1)}
        if gpu is not None:  # no CUDA context: nothing for NVML or the preflight to count
            assert gpu.of_process(host_pid(host, main_pid(host, SPARE))) is None
        old = main_pid(host, ENGINE)
        t0 = time.monotonic()
        host.systemctl("restart", ENGINE, timeout=300)
        figures["restart_s"] = seconds_to_serve_again(host, t0, {ENGINE: old})
        killed = from_the_spare(host)
        figures["restart_phases_s"] = engine_health(host)["phases_s"]
        assert engine_health(host)["tensors_outside_shared"] == 0
        t0 = time.monotonic()
        host.run(["kill", "-9", str(killed)])
        figures["kill_9_answered_again_s"] = seconds_to_serve_again(host, t0, {ENGINE: killed})
        from_the_spare(host)
        figures["kill_9_phases_s"] = engine_health(host)["phases_s"]
        assert "status=9/KILL" in journal(host, ENGINE)
        assert journal(host, ENGINE).count("forked from the spare") >= 2
        results["spare"] = figures
    finally:
        host.run(["rm", "-f", f"{DROPINS}/35-spare.yaml"])
        host.systemctl("daemon-reload")
        host.systemctl("stop", SPARE, check=False, timeout=120)


# ---------------------------------------------------------------- stop


def test_stop_returns_gpu_memory_to_its_baseline(host, gpu, results):
    serving(host)
    t0 = time.monotonic()
    host.systemctl("stop", UMBRELLA, timeout=300)
    results["stop_s"] = round(time.monotonic() - t0, 1)
    everything = (UMBRELLA, ENGINE, NEXT, STANDBY, WEIGHTS, f"model@{MODEL}.socket")
    wait_for(lambda: all(active(host, u) in ("inactive", "failed") for u in everything), timeout=300,
             what="every unit of the model stopped")
    assert host.run(["pgrep", "-u", f"hostd-{MODEL}"], check=False).stdout.strip() == ""
    if gpu is None:
        return
    baseline = host.gpu_baseline
    wait_for(lambda: gpu.used() <= baseline + 64, timeout=120, interval=0.5, what="GPU memory back at its baseline")
    results["memory_mib.after_stop"] = {"baseline": round(baseline), "used": round(gpu.used())}
