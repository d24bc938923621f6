"""hostd's weights and engine supervisors around the vllm and sglang test
doubles (tests/doubles/), run by hand: start, the /health contract the manager
relies on, an engine restart that keeps the weights supervisor and upstream's
sockets, upstream death, and hostd's bound on SGLang's unbounded drain."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from harness.local import ModelTree, wait_for
from hostd.weights import client as weights_client

DOUBLES = Path(__file__).resolve().parents[1] / "doubles"
UUID = "GPU-12345678-1234-1234-1234-123456789abc"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"not really weights")
    return path


@pytest.fixture
def short_root():
    """Upstream socket paths are long (GPU UUIDs); pytest's tmp_path is too deep for sun_path."""
    root = Path(tempfile.mkdtemp(prefix="hostd-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def tree_for(tmp_path: Path, checkpoint: Path, backend: str, **keys) -> ModelTree:
    tree = ModelTree(tmp_path, name="m")
    env = {"HOSTD_VLLM": str(DOUBLES / "vllm"), "PYTHONPATH": str(DOUBLES / "sglang_double"),
           "HOSTD_TEST_GPU_UUID": UUID, **keys.pop("env", {})}
    data = {"backend": backend, "model": str(checkpoint), "env": env, **keys}
    path = tree.config_dir / "models" / "m.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return tree


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_engine_restart_keeps_weights_supervisor_and_upstream_sockets(backend, short_root, checkpoint, trees):
    limits = {"max_num_seqs": 4} if backend == "vllm" else {"max_running_requests": 4, "context_length": 512}
    tree = tree_for(short_root, checkpoint, backend, tensor_parallel_size=2, gpus=[0, 1], engine=limits)
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    before = weights_client.status(tree.weights_socket)
    assert before.pid == weights.pid
    assert len(before.upstream_socket_inodes) == 2
    assert before.upstream_pids and weights.pid not in before.upstream_pids
    assert before.fingerprint.backend == backend
    uuids = [f"{UUID[:-4]}{index:04x}" for index in (0, 1)]
    if backend == "vllm":  # sockets named after md5(UUID): hostd reads the GPUs from them
        digests = sorted(hashlib.md5(u.encode()).hexdigest() for u in uuids)
        assert before.fingerprint.device == "cuda:" + ",".join(f"md5:{d}" for d in digests)
    else:
        assert before.fingerprint.device == "cuda:" + ",".join(uuids)

    engine = tree.start_engine(timeout=60)
    health = tree.health()
    assert "limits" not in health  # engine_config is the contract
    assert health["engine_config"] == {**health["engine_config"], **limits}
    assert (health["weights_pid"], health["weights_socket_inode"]) == (before.pid, before.socket_inode)
    # hostd_build_info's upstream_version (the gateway's /metrics): what upstream says it is
    assert health["upstream_version"] == {"vllm": "0.32.0", "sglang": "0.5.23"}[backend]
    with tree.http() as http:
        answer = http.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        assert http.get("/v1/models").json()["data"][0]["id"] == "m"
        # Issue 33, M3: the proxy never inflates a body; upstream gets the bytes as sent, undecodable.
        gzipped = gzip.compress(json.dumps({"model": "m", "prompt": "Hello", "max_tokens": 1}).encode())
        encoded = http.post("/v1/completions", content=gzipped,
                            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        assert encoded.status_code == 400, encoded.text

    assert engine.stop() == 0
    tree.start_engine(timeout=60)
    after = weights_client.status(tree.weights_socket)
    assert (after.pid, after.socket_inode) == (before.pid, before.socket_inode)
    assert after.upstream_socket_inodes == before.upstream_socket_inodes
    assert after.upstream_pids == before.upstream_pids
    assert tree.health()["weights_pid"] == before.pid


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_upstream_daemon_death_ends_the_weights_supervisor_with_failure(backend, short_root, checkpoint, trees):
    tree = tree_for(short_root, checkpoint, backend)
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    status = weights_client.status(tree.weights_socket)
    os.kill(status.upstream_pids[0], signal.SIGKILL)
    assert weights.proc.wait(30) != 0


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_stopping_the_weights_supervisor_stops_upstream_and_clears_its_sockets(backend, short_root, checkpoint, trees):
    tree = tree_for(short_root, checkpoint, backend)
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    status = weights_client.status(tree.weights_socket)
    assert weights.stop() == 0, weights.log()
    for pid in status.upstream_pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    upstream_dir = tree.runtime_dir / backend
    assert not [p for p in upstream_dir.iterdir() if p.suffix == ".sock"]


def test_refused_config_never_starts_upstream(short_root, checkpoint, trees):
    tree = tree_for(short_root, checkpoint, "vllm", extra_args=["--enable-lora"])
    trees.append(tree)
    daemon = tree._spawn("weights")
    assert daemon.proc.wait(60) == 1
    assert "extra_args: --enable-lora is refused" in daemon.log()
    assert not (tree.runtime_dir / "vllm").exists()


def test_sglang_drain_is_cut_at_hostds_deadline(short_root, checkpoint, trees):
    """SGLang drains without a limit on SIGTERM; hostd kills it after the
    backend's drain_seconds (here 1 s, from timeouts.stop: 3)."""
    tree = tree_for(short_root, checkpoint, "sglang", timeouts={"stop": 3},
                    env={"HOSTD_TEST_COMPLETION_SECONDS": "60"})
    trees.append(tree)
    tree.start_weights(timeout=60)
    engine = tree.start_engine(timeout=60)

    def slow_request():
        try:
            with tree.http(timeout=90) as http:
                http.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1})
        except httpx.HTTPError:
            pass

    threading.Thread(target=slow_request, daemon=True).start()
    time.sleep(0.5)
    # The request lasts 60 s: an engine that ends inside the 30 s wait was cut,
    # and hostd's log says it did the cutting.
    assert engine.stop(timeout=30) == 0
    assert "still running after" in engine.log()


def test_vllm_engine_failure_exits_non_zero(short_root, checkpoint, trees):
    tree = tree_for(short_root, checkpoint, "vllm", env={"HOSTD_TEST_FAIL_MAX_NUM_SEQS": "13"},
                    engine={"max_num_seqs": 13})
    trees.append(tree)
    tree.start_weights(timeout=60)
    engine = tree.start_engine(wait=False)
    assert engine.proc.wait(60) == 1
    wait_for(lambda: "exited with" in engine.log(), 10, "the engine's error in its log")


def test_sglang_engine_is_ready_while_its_generating_health_is_slow(short_root, checkpoint, trees):
    """SGLang's /health runs a one-token generation that may take up to 20 s;
    hostd probes /ready, so a slow /health never holds back (or fails) the start."""
    tree = tree_for(short_root, checkpoint, "sglang", env={"HOSTD_TEST_HEALTH_SECONDS": "15"})
    trees.append(tree)
    tree.start_weights(timeout=60)
    # A /health that takes 15 s never answers inside hostd's 10 s probe
    # timeout (UpstreamBackend.health_timeout): a start that probed it would
    # never become ready.
    tree.start_engine(timeout=40)
    with tree.http(timeout=30) as http:
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_without_the_weight_cache_no_daemon_runs_and_an_engine_restart_loads_from_disk(
        backend, short_root, checkpoint, trees):
    """device: cpu: upstream's weight cache cannot run (CUDA IPC only), so the
    weights unit starts no upstream daemon and says why; the engine loads from
    disk, and an engine restart keeps the weights unit (what a reload relies on)."""
    tree = tree_for(short_root, checkpoint, backend, device="cpu")
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    status = weights_client.status(tree.weights_socket)
    assert status.upstream_pids == [] and status.upstream_socket_inodes == {}
    assert status.not_retained.startswith("device: cpu") and status.fingerprint.device == "cpu"
    assert "not retained" in weights.log()
    engine = tree.start_engine(timeout=60)
    health = tree.health()
    assert health["weights"] == "disk" and health["weights_not_retained"].startswith("device: cpu")
    argv = Path(f"/proc/{health['upstream_pid']}/cmdline").read_bytes().split(b"\0")
    assert b"--uds" in argv or b"--port" in argv
    assert b"ipc_cache" not in argv and b"--weight-cache-mode" not in argv
    assert "not retained" in engine.log()
    with tree.http() as http:
        assert http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert engine.stop() == 0
    tree.start_engine(timeout=60)
    assert weights_client.status(tree.weights_socket).pid == weights.pid == tree.health()["weights_pid"]


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_gateways_metrics_name_upstreams_version_and_weights_loaded_from_disk(
        backend, short_root, checkpoint, trees):
    """hostd_build_info carries the version upstream reports, hostd_weights_retained
    is 0 for an engine that loads from disk (the HostdWeightsNotRetained alert's
    input), and hostd_limit the engine's limits as it runs them."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    limits = {"max_num_seqs": 5} if backend == "vllm" else {"max_running_requests": 5}
    tree = tree_for(short_root, checkpoint, backend, device="cpu", listen=f"127.0.0.1:{port}", engine=limits)
    trees.append(tree)
    tree.start_weights(timeout=60)
    tree.start_engine(timeout=60)
    tree.start_gateway()
    wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    version = {"vllm": "0.32.0", "sglang": "0.5.23"}[backend]
    assert (f'hostd_build_info{{backend="{backend}",model="m",upstream="{backend}",upstream_version="{version}",'
            in text)
    assert 'hostd_weights_retained{model="m"} 0.0' in text.splitlines()
    key = next(iter(limits))
    assert f'hostd_limit{{key="engine.{key}",model="m"}} 5.0' in text.splitlines()


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_gateway_sends_vllms_requests_to_its_socket_and_sglangs_through_the_supervisor(
        backend, short_root, checkpoint, trees):
    """Issue 55, item 7: one proxy per token on the vLLM path. With the engine
    supervisor stopped (SIGSTOP), a completion through the gateway still
    reaches vLLM on its own socket; SGLang's loopback port is the
    supervisor's to know, so its requests wait for the supervisor."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tree = tree_for(short_root, checkpoint, backend, device="cpu", listen=f"127.0.0.1:{port}")
    trees.append(tree)
    tree.start_weights(timeout=60)
    engine = tree.start_engine(timeout=60)
    tree.start_gateway()
    wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
    body = {"model": "m", "prompt": "Hello", "max_tokens": 1}
    engine.proc.send_signal(signal.SIGSTOP)
    try:
        if backend == "vllm":
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == " from the test double"
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=3)
    finally:
        engine.proc.send_signal(signal.SIGCONT)
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text


def engine_client(tree: ModelTree, slot: str, timeout: float = 30) -> httpx.Client:
    from hostd import paths

    socket_path = tree.runtime_dir / paths.ENGINE_SOCKETS[slot]
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://engine", timeout=timeout)


def healthy(tree: ModelTree, slot: str) -> bool:
    try:
        with engine_client(tree, slot, 5) as http:
            return http.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_two_engines_of_one_model_serve_side_by_side_and_only_the_next_runs_on_the_bridge_budget(
        backend, short_root, checkpoint, trees):
    """The overlap reload's two slots on one weights supervisor (TP 2): each
    engine has its own upstream process and socket or port, both attach the
    same weight daemon and answer completions, and only the next slot's
    upstream command line carries the bridge's KV budget (64 MiB here)."""
    (checkpoint / "config.json").write_text(json.dumps({
        "architectures": ["FakeForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256}))
    limits = {"max_num_seqs": 4} if backend == "vllm" else {"max_running_requests": 4}
    tree = tree_for(short_root, checkpoint, backend, tensor_parallel_size=2, gpus=[0, 1], engine=limits,
                    reload={"bridge_kv_mib": 64})
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    tree.start_engine(timeout=60)
    bridge = tree._spawn("engine", "--slot", "next")
    wait_for(lambda: healthy(tree, "next"), 60, "the next slot's /health", bridge.proc)

    with engine_client(tree, "main") as main_http, engine_client(tree, "next") as next_http:
        main, nxt = main_http.get("/health").json(), next_http.get("/health").json()
        for http in (main_http, next_http):
            answer = http.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    assert (main["slot"], nxt["slot"]) == ("main", "next")
    assert main["upstream_pid"] != nxt["upstream_pid"]
    assert main["weights_pid"] == nxt["weights_pid"] == weights.pid
    assert main["weights_socket_inode"] == nxt["weights_socket_inode"]
    assert main["engine_config"] == nxt["engine_config"]  # the same editable values

    def argv(health: dict) -> list[str]:
        return Path(f"/proc/{health['upstream_pid']}/cmdline").read_bytes().decode().split("\0")

    main_argv, next_argv = argv(main), argv(nxt)
    if backend == "vllm":
        kv = ["--kv-cache-memory-bytes", str(64 << 20)]
        where = "--uds"
        assert next_argv[next_argv.index(where) + 1] == str(tree.runtime_dir / "vllm-engine-next.sock")
    else:
        # 2 layers, 1 KV head per rank, 64 dims, K and V, 4 bytes: config.json names no dtype, which
        # hostd/kv_bytes.py counts as float32 for every backend (the larger figure: fewer tokens)
        kv = ["--max-total-tokens", str((64 << 20) // (2 * 1 * 64 * 2 * 4))]
        where = "--port"
    assert main_argv[main_argv.index(where) + 1] != next_argv[next_argv.index(where) + 1]
    assert " ".join(kv) in " ".join(next_argv) and kv[0] not in main_argv
    assert nxt["bridge"].startswith(" ".join(kv)) and main["bridge"] == ""
    assert "is the bridge: " + " ".join(kv) in bridge.log()

    assert bridge.stop() == 0  # retire: the main engine serves on
    with engine_client(tree, "main") as http:
        assert http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_the_standby_is_a_third_upstream_on_the_bridge_budget_and_one_that_does_not_fit_never_starts(
        backend, short_root, checkpoint, trees):
    """standby: true (issue 35) through the test doubles (SGLang's only run:
    its server needs a GPU): the standby slot's engine attaches the same
    weight daemon as the main one, on an upstream socket or port of its own
    and the bridge's KV budget, and answers; with reload.bridge_kv_mib beyond
    the host's memory its start preflight refuses with the numbers (exit 78,
    the unit's RestartPreventExitStatus=) before any upstream runs; and when
    the main engine's upstream dies, a request sent to it gets no answer (the
    connection drops, as a dead engine's: the gateway then sends it to the
    standby) and the supervisor exits non-zero."""
    (checkpoint / "config.json").write_text(json.dumps({
        "architectures": ["FakeForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256}))
    limits = {"max_num_seqs": 4} if backend == "vllm" else {"max_running_requests": 4}
    tree = tree_for(short_root, checkpoint, backend, engine=limits, standby=True, reload={"bridge_kv_mib": 64})
    trees.append(tree)
    weights = tree.start_weights(timeout=60)
    main_engine = tree.start_engine(timeout=60)
    standby = tree._spawn("engine", "--slot", "standby")
    wait_for(lambda: healthy(tree, "standby"), 60, "the standby slot's /health", standby.proc)
    with engine_client(tree, "main") as main_http, engine_client(tree, "standby") as standby_http:
        main, spare = main_http.get("/health").json(), standby_http.get("/health").json()
        answer = standby_http.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
    assert (main["slot"], spare["slot"]) == ("main", "standby")
    assert spare["weights_pid"] == main["weights_pid"] == weights.pid and spare["upstream_pid"] != main["upstream_pid"]
    argv = Path(f"/proc/{spare['upstream_pid']}/cmdline").read_bytes().decode().split("\0")
    main_argv = Path(f"/proc/{main['upstream_pid']}/cmdline").read_bytes().decode().split("\0")
    if backend == "vllm":
        assert argv[argv.index("--uds") + 1] == str(tree.runtime_dir / "vllm-engine-standby.sock")
        assert "--kv-cache-memory-bytes" in argv and argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    else:
        assert argv[argv.index("--port") + 1] != main_argv[main_argv.index("--port") + 1]
        assert "--max-total-tokens" in argv and "--max-total-tokens" not in main_argv
    assert spare["bridge"] and main["bridge"] == ""
    assert standby.stop() == 0

    # Beyond the host's memory (MemAvailable, on CPU; NVML's free memory on
    # GPUs, which this machine has none of): refused before upstream runs.
    path = tree.config_dir / "models" / "m.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "device": "cpu",
                                    "reload": {"bridge_kv_mib": 1048576}}))
    refused = tree._spawn("engine", "--slot", "standby")
    assert refused.proc.wait(60) == 78
    log = refused.log()
    assert "the standby of m does not fit: the standby needs about" in log, log
    assert "reload.bridge_kv_mib=1048576" in log and "MemAvailable is" in log and "standby: false" in log, log
    assert "starting " not in log  # no upstream command ran

    # The main engine's upstream dies: a request gets no answer, the supervisor exits non-zero.
    os.kill(main["upstream_pid"], signal.SIGKILL)
    with engine_client(tree, "main") as http:
        with pytest.raises(httpx.TransportError):
            http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1})
    assert main_engine.proc.wait(30) != 0


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_a_swaps_second_upstream_daemon_keeps_its_sockets_apart_and_its_engine_attaches_it(
        backend, short_root, checkpoint, trees):
    """A checkpoint swap's pair (issue 36): the next weight slot's supervisor
    runs upstream's daemon on the new checkpoint with its sockets in
    /run/hostd/NAME/next, leaving the serving daemon's untouched (each
    daemon empties its own directory when it starts and stops); the swap's
    engine (--slot next --weights-slot next) attaches it and says which
    checkpoint it serves on /health; stopping the pair leaves main serving."""
    tree = tree_for(short_root, checkpoint, backend, tensor_parallel_size=2, gpus=[0, 1])
    trees.append(tree)
    tree.start_weights(timeout=60)
    tree.start_engine(timeout=60)
    main_before = weights_client.status(tree.weights_socket)
    new = checkpoint.parent / "ckpt-v2"
    shutil.copytree(checkpoint, new)
    (new / "model.safetensors").write_bytes(b"other weights")
    config = tree.config_dir / "models" / "m.yaml"
    config.write_text(config.read_text().replace(str(checkpoint), str(new)))  # as the swap's record writes it

    next_socket = tree.runtime_dir / "weights-next.sock"
    next_weights = tree._spawn("weights", "--slot", "next")
    wait_for(lambda: tree._connectable(next_socket), 60, str(next_socket), next_weights.proc)
    nxt = weights_client.status(next_socket)
    assert nxt.fingerprint.model_path == str(new)
    assert nxt.fingerprint.content_digest != main_before.fingerprint.content_digest
    assert sorted(p.name for p in (tree.runtime_dir / "next").iterdir() if p.suffix == ".sock") == \
        sorted(nxt.upstream_socket_inodes)
    assert weights_client.status(tree.weights_socket).upstream_socket_inodes == main_before.upstream_socket_inodes

    # The files name the new checkpoint now: an engine on the main daemon
    # (the old one) would serve another checkpoint than /health says; refused.
    stale = tree._spawn("engine", "--slot", "standby")
    assert stale.proc.wait(60) == 1
    assert f"holds {checkpoint}, but model: names {new}" in stale.log()

    swap = tree._spawn("engine", "--slot", "next", "--weights-slot", "next")
    wait_for(lambda: healthy(tree, "next"), 60, "the swap engine's /health", swap.proc)
    with engine_client(tree, "next") as http:
        health = http.get("/health").json()
        answer = http.post("/v1/completions", json={"model": "m", "prompt": "Hello", "max_tokens": 1})
        assert answer.status_code == 200
    assert (health["weights_pid"], health["weights_socket_inode"]) == (nxt.pid, nxt.socket_inode)
    assert (health["checkpoint"], health["content_digest"]) == (str(new), nxt.fingerprint.content_digest)
    argv = Path(f"/proc/{health['upstream_pid']}/cmdline").read_bytes().decode().split("\0")
    environ = Path(f"/proc/{health['upstream_pid']}/environ").read_bytes().decode().split("\0")
    if backend == "vllm":
        loader = json.loads(argv[argv.index("--model-loader-extra-config") + 1])
        assert loader["socket_dir"] == str(tree.runtime_dir / "next")
    else:
        assert f"SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE={tree.runtime_dir / 'next'}/{{device_uuid}}.sock" in environ

    assert swap.stop() == 0 and next_weights.stop() == 0  # retire: the swap's pair goes
    assert not [p for p in (tree.runtime_dir / "next").iterdir() if p.suffix == ".sock"]
    assert weights_client.status(tree.weights_socket).upstream_socket_inodes == main_before.upstream_socket_inodes
    main = tree.health()
    assert main["checkpoint"] == str(checkpoint) and main["weights_pid"] == main_before.pid
    with tree.http() as http:
        assert http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 1}).status_code == 200
