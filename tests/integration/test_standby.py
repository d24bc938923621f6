"""The warm standby by hand: an engine in the standby slot holds a small KV
cache while it waits, grows it for the first request and gives it back when
quiet; it rebuilds itself on a new engine section in its own process (same
PID, same model object), and refuses what a start would refuse while its old
runner keeps serving; the main engine rebuilds in place the same way, on
its full KV budget, under streams; the gateway sends new requests to the
standby the moment the main engine dies, and back once the main engine
answers again. (The manager
drives the same pieces through systemd: tests/system/test_standby_units.py.)"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from hostd import paths
from harness.local import ModelTree, free_port, wait_for
from test_overlap import completion, healthy


def standby_http(tree: ModelTree, timeout: float = 120) -> httpx.Client:
    socket = tree.runtime_dir / paths.ENGINE_SOCKETS["standby"]
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=timeout)


def start_standby(tree: ModelTree):
    standby = tree.start_engine("--slot", "standby", wait=False)
    wait_for(lambda: healthy(tree.runtime_dir / paths.ENGINE_SOCKETS["standby"]), 600, "the standby", standby.proc)
    return standby


MiB = 1 << 20
SMALL_STANDBY = {"reload": {"standby_kv_mib": 1}}  # the tiny model's block is 16 tokens of 256 B: 256 blocks


def test_an_idle_standby_holds_its_small_cache_grows_for_a_request_as_the_main_engine_answers_and_shrinks_back(
        tmp_path: Path, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOSTD_STANDBY_IDLE_S", "2")  # the engines' environment (ModelTree.env)
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed=SMALL_STANDBY, max_num_seqs=4, kv_cache_mib=4)
    try:
        tree.start_weights()
        tree.start_engine()
        start_standby(tree)
        with standby_http(tree) as http, tree.http() as main:
            idle = http.get("/health").json()
            assert (idle["kv_budget"], idle["kv_cache_bytes"], idle["kv_cache_bytes_full"]) == ("idle", MiB, 4 * MiB)
            assert idle["grow_s"] is None
            assert "kv_budget" not in main.get("/health").json()  # the main slot has no idle budget
            for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 7}):
                body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "ignore_eos": True, **sampling}
                on_standby = http.post("/v1/completions", json=body)
                assert on_standby.status_code == 200, on_standby.text
                full = http.get("/health").json()
                assert (full["kv_budget"], full["kv_cache_bytes"]) == ("full", 4 * MiB)
                # grow_s once the idle runner is freed, which the request did not wait for
                full = wait_for(lambda: (lambda h: h if h["grow_s"] else None)(http.get("/health").json()), 30,
                                "the grow's phases")
                assert set(full["grow_s"]) == {"kv_alloc_and_batching_start", "warm_up", "swap", "free_old"}
                assert full["tensors_outside_shared"] == 0
                on_main = main.post("/v1/completions", json=body).json()
                assert on_standby.json()["choices"][0]["text"] == on_main["choices"][0]["text"], sampling
            wait_for(lambda: http.get("/health").json()["kv_budget"] == "idle", 30, "the standby idle again")
            assert http.get("/health").json()["kv_cache_bytes"] == MiB
    finally:
        tree.stop_all()
    assert "standby KV cache grown" in tree.root.joinpath("engine-2.log").read_text()


def test_a_standby_rebuilds_on_a_new_config_in_its_own_process_on_the_same_model(tmp_path: Path,
                                                                                tiny_checkpoint: Path):
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed=SMALL_STANDBY, max_num_seqs=4, kv_cache_mib=4)
    try:
        tree.start_weights()
        standby = start_standby(tree)
        with standby_http(tree) as http:
            before = http.get("/health").json()
            assert before["slot"] == "standby" and before["engine_config"]["max_num_seqs"] == 4
            answer = http.post("/hostd/rebuild", json={"engine": {**before["engine_config"], "max_num_seqs": 2}})
            assert answer.status_code == 200, answer.text
            # The answer's connection is the old model's, closing: a client must
            # not reuse it (CI once lost the next request to that race).
            assert answer.headers["connection"] == "close"
            after = http.get("/health").json()
            assert after["engine_config"]["max_num_seqs"] == 2 and after["max_num_seqs"] == 2
            # Nothing of the model is built again: the same object takes the new section's runner.
            assert list(answer.json()["rebuild_s"]) == ["refusals", "runner", "warm_up", "swap"]
            assert answer.json()["kv_budget"] == after["kv_budget"] == "idle"
            assert (after["kv_cache_bytes"], after["kv_cache_bytes_full"]) == (MiB, 4 * MiB)
            # Same process, same daemon allocation, nothing copied.
            assert after["pid"] == before["pid"] == standby.pid
            assert (after["weights_pid"], after["shared_ptr"]) == (before["weights_pid"], before["shared_ptr"])
            assert after["tensors_outside_shared"] == 0
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        tree.stop_all()
    assert standby.proc.returncode == 0  # a clean SIGTERM after a rebuild


def test_a_refused_rebuild_leaves_the_old_model_serving(tmp_path: Path, tiny_checkpoint: Path):
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, max_num_seqs=4)
    try:
        tree.start_weights()
        start_standby(tree)
        with standby_http(tree) as http:
            before = http.get("/health").json()
            refused = http.post("/hostd/rebuild", json={"engine": {**before["engine_config"], "max_model_len": 99999}})
            assert refused.status_code == 422 and "max_position_embeddings" in refused.json()["error"]
            bad = http.post("/hostd/rebuild", json={"engine": {"max_num_seqs": 0}})
            assert bad.status_code == 422 and "max_num_seqs" in bad.json()["error"]
            assert http.post("/hostd/rebuild", content=b"not json").status_code == 400
            after = http.get("/health").json()
            assert after["engine_config"] == before["engine_config"] and after["pid"] == before["pid"]
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200
    finally:
        tree.stop_all()


def test_the_main_engine_rebuilds_in_place_under_streams_on_its_full_budget_and_refuses_as_a_start(
        tmp_path: Path, tiny_checkpoint: Path):
    """The in-place strategy's engine half: the main engine takes a new
    engine section in its own process while three streams run through the
    gateway; they finish on the old runner, new requests go to the new one,
    none is refused; its KV cache is the main engine's full budget (no idle
    one); a section a start would refuse leaves the old runner serving. The
    overlap's second engine serves one reload and has no rebuild verb."""
    port = free_port()
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=4, kv_cache_mib=4)
    base_url = f"http://127.0.0.1:{port}"
    try:
        tree.start_weights()
        main = tree.start_engine()
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        with tree.http() as http, ThreadPoolExecutor(4) as pool:
            before = http.get("/health").json()
            assert before["rebuilds"] is True and before["kv_cache_bytes"] == 4 * MiB
            running = [pool.submit(completion, base_url, 200) for _ in range(3)]
            wait_for(lambda: tree.control("status")["in_flight"] >= 3, 120, "3 streams in flight")
            section = {**before["engine_config"], "max_num_seqs": 8, "kv_cache_mib": 2}
            answer = http.post("/hostd/rebuild", json={"engine": section})
            assert answer.status_code == 200, answer.text
            assert completion(base_url, 4) == "length"  # a new request, on the new runner
            assert [f.result() for f in running] == ["length"] * 3  # the old runner finished them
        with tree.http() as http:
            after = http.get("/health").json()
            assert (after["engine_config"], after["max_num_seqs"]) == (section, 8)
            assert "kv_budget" not in after and after["kv_cache_bytes"] == 2 * MiB
            assert (after["pid"], after["shared_ptr"]) == (before["pid"], before["shared_ptr"]) and main.pid == after["pid"]
            refused = http.post("/hostd/rebuild", json={"engine": {**section, "max_model_len": 99999}})
            assert refused.status_code == 422 and "max_position_embeddings" in refused.json()["error"]
            assert http.get("/health").json()["engine_config"] == section
        # Rebuilds under back-to-back short requests: the old runner's idle
        # keep-alive connections close under the gateway's feet, and none of
        # its requests may be answered 503 for it (the gateway sends once more
        # on a new connection before calling the engine lost).
        outcomes: list[str] = []
        stop = threading.Event()

        def short_requests() -> None:
            api = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
            while not stop.is_set():
                try:
                    api.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)
                    outcomes.append("ok")
                except openai.APIError as exc:
                    outcomes.append(repr(exc)[:200])

        with tree.http() as http, ThreadPoolExecutor(4) as pool:
            workers = [pool.submit(short_requests) for _ in range(4)]
            try:
                wait_for(lambda: len(outcomes) >= 20, 120, "short requests flowing")
                for n in (6, 8, 6, 8):
                    answer = http.post("/hostd/rebuild", json={"engine": {**section, "max_num_seqs": n}})
                    assert answer.status_code == 200, answer.text
                    time.sleep(0.3)
            finally:
                stop.set()
            for worker in workers:
                worker.result(120)
        assert [o for o in outcomes if o != "ok"] == [] and len(outcomes) > 20
        assert sum(tree.control("status").get("rejected", {}).values()) == 0
        nxt = tree.start_engine("--slot", "next", wait=False)
        wait_for(lambda: healthy(tree.runtime_dir / paths.ENGINE_SOCKETS["next"]), 600, "the next engine", nxt.proc)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(tree.runtime_dir / paths.ENGINE_SOCKETS["next"])),
                          base_url="http://engine", timeout=60) as http:
            assert http.get("/health").json()["rebuilds"] is False
            assert http.post("/hostd/rebuild", json={"engine": section}).status_code == 404
    finally:
        tree.stop_all()
    assert main.proc.returncode == 0


def test_the_gateway_fails_over_to_the_standby_at_once_and_back_when_the_engine_answers_again(
        tmp_path: Path, tiny_checkpoint: Path):
    port = free_port()
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed={"listen": f"127.0.0.1:{port}", "standby": True}, max_num_seqs=4)
    base_url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    outcomes: list[str] = []
    try:
        tree.start_weights()
        main = tree.start_engine()
        start_standby(tree)
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")

        def one(_: int) -> str:
            try:
                client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)
                return "ok"
            except openai.APIStatusError as exc:
                return f"status {exc.status_code}"
            except openai.APIError as exc:
                return f"error {exc}"

        with ThreadPoolExecutor(2) as pool:
            outcomes += pool.map(one, range(4))
            main.stop(signal.SIGKILL)
            outcomes_after = list(pool.map(one, range(6)))  # new requests, right after the kill
        assert outcomes == ["ok"] * 4 and outcomes_after == ["ok"] * 6, (outcomes, outcomes_after)
        status = tree.control("status")
        assert (status["slot"], status["failed_over"], status["state"]) == ("standby", "main", "serving")
        assert sum(status["rejected"].values()) == 0
        assert 'hostd_gateway_failovers_total{model="tiny"} 1.0' in httpx.get(base_url + "/metrics").text

        tree.start_engine()  # what systemd's Restart= does
        wait_for(lambda: tree.control("status")["slot"] == "main", 60, "new requests back on the main engine")
        assert tree.control("status")["failed_over"] == ""
        assert one(0) == "ok"
    finally:
        tree.stop_all()
