"""The warm standby by hand: an engine in the standby slot rebuilds itself on
a new engine section in its own process (same PID, same mapped weights), and
refuses what a start would refuse while its old model keeps serving; the
gateway sends new requests to it the moment the main engine dies, and back
once the main engine answers again. (The manager drives the same pieces
through systemd: tests/system/test_standby_units.py.)"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from hostd import paths
from tests.local import ModelTree, wait_for
from test_overlap import completion, free_port, healthy


def standby_http(tree: ModelTree, timeout: float = 120) -> httpx.Client:
    socket = tree.runtime_dir / paths.ENGINE_SOCKETS["standby"]
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)), base_url="http://engine", timeout=timeout)


def start_standby(tree: ModelTree):
    standby = tree.start_engine("--slot", "standby", wait=False)
    wait_for(lambda: healthy(tree.runtime_dir / paths.ENGINE_SOCKETS["standby"]), 600, "the standby", standby.proc)
    return standby


def test_a_standby_rebuilds_on_a_new_config_in_its_own_process_on_the_same_weights(tmp_path: Path,
                                                                                   tiny_checkpoint: Path):
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, max_num_seqs=4)
    try:
        tree.start_weights()
        standby = start_standby(tree)
        with standby_http(tree) as http:
            before = http.get("/health").json()
            assert before["slot"] == "standby" and before["engine_config"]["max_num_seqs"] == 4
            answer = http.post("/hostd/rebuild", json={"engine": {**before["engine_config"], "max_num_seqs": 2}})
            assert answer.status_code == 200, answer.text
            after = http.get("/health").json()
            assert after["engine_config"]["max_num_seqs"] == 2 and after["max_num_seqs"] == 2
            assert set(answer.json()["rebuild_s"]) >= {"build_skeleton", "attach", "warm_up", "swap"}
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


def test_the_main_engine_has_no_rebuild_verb(tmp_path: Path, tiny_checkpoint: Path):
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, max_num_seqs=4)
    try:
        tree.start_weights()
        tree.start_engine()
        with tree.http() as http:
            assert http.post("/hostd/rebuild", json={"engine": {"max_num_seqs": 2}}).status_code == 404
    finally:
        tree.stop_all()
