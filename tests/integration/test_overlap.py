"""Two engines on one weight daemon behind one gateway, by hand: what the
overlap reload is made of (the manager drives the same steps through systemd;
tests/system covers that)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from hostd import paths
from hostd.gateway import control
from harness.local import ModelTree, free_port, wait_for


def healthy(path: Path) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://engine", timeout=5) as c:
            return c.get("/health").status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def completion(base_url: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finish = None
    for chunk in client.completions.create(model="tiny", prompt="Once", max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return finish


def test_switch_moves_new_requests_while_the_old_engine_finishes_its_streams(tmp_path: Path, tiny_checkpoint: Path):
    port = free_port()
    tree = ModelTree(tmp_path)
    tree.write_config(tiny_checkpoint, fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=8)
    base_url = f"http://127.0.0.1:{port}"
    try:
        tree.start_weights()
        old = tree.start_engine()
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")

        with pytest.raises(control.ControlError, match="slot next .* does not answer /health"):
            tree.control("switch", slot="next")  # nothing runs there yet: refused, nothing moves
        assert tree.control("status")["slot"] == "main"

        reported = tree.health()["memory"]  # what an overlap reload's preflight reads
        assert reported["anonymous"] > 0 and reported["host_available"] > 0
        new = tree.start_engine("--slot", "next", wait=False)
        wait_for(lambda: healthy(tree.runtime_dir / paths.ENGINE_SOCKETS["next"]), 600, "the next engine", new.proc)
        with ThreadPoolExecutor(4) as pool:
            running = [pool.submit(completion, base_url, 300) for _ in range(3)]  # on the old engine
            wait_for(lambda: tree.control("status")["in_flight"] >= 3, 120, "3 streams in flight")
            assert tree.control("switch", slot="next")["slot"] == "next"
            # The old engine gets SIGTERM and finishes the 3 streams it admitted;
            # new requests meanwhile go to the next engine and are never refused.
            stopping = pool.submit(old.stop, timeout=300)
            assert completion(base_url, 4) == "length"
            assert stopping.result() == 0
            assert [f.result() for f in running] == ["length"] * 3
        snapshot = tree.control("status")
        assert snapshot["slot"] == "next" and snapshot["state"] == "serving"
        assert sum(snapshot.get("rejected", {}).values()) == 0
        with pytest.raises(control.ControlError, match="slot main"):
            tree.control("switch", slot="main")  # the old engine is gone: refused
    finally:
        tree.stop_all()
