"""What the overlap reload (reload.strategy: overlap) promises beyond refusing
nothing, under a real systemd 252: a failed `systemctl reload` pins the
previous values above the administrator's drop-in, as the restart strategy
does; Cancel works until the switch; and a request running on the engine being
replaced finishes, however short the engine's own shutdown timeout.

One container for the module (model tiny, hostd.service), with
engine.shutdown_timeout 0: an engine that is sent SIGTERM with a request
running ends it at once, so only the reload's own wait keeps it alive.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from container import SystemdContainer, wait_for
from test_manager import DROPINS, engine_metric, hostctl, last_operation, op_property, read_file, wait_operation
from test_model_units import main_pid, status_code
from test_overlap_units import MAIN, NEXT, active, serving_tiny

SLOW_NEXT = "/run/systemd/system/model-engine-next@tiny.service.d/50-slow-start.conf"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    return serving_tiny(systemd_container, {"10-shutdown.yaml": "engine:\n  shutdown_timeout: 0\n"})


def test_a_failed_systemctl_reload_pins_the_previous_values_and_the_next_engine_start_runs_them(host):
    engine_pid = main_pid(host, MAIN)
    before = int(engine_metric(host, "hostd_engine_max_model_len"))
    host.write_file(f"{DROPINS}/95-override.yaml", "engine:\n  max_model_len: 99999\n")
    try:
        failed = host.systemctl("reload", "model@tiny.service", check=False, timeout=300)
        assert failed.returncode != 0
        path = last_operation(host)
        assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "overlap")
        assert op_property(host, path, "Restored") is True
        assert "max_position_embeddings" in op_property(host, path, "Error")  # the new engine's own words
        assert main_pid(host, MAIN) == engine_pid  # never stopped
        assert "max_model_len" in read_file(host, f"{DROPINS}/99-rollback.yaml")
        assert "pinned" in " ".join(op_property(host, path, "Notes"))

        # The next start of the engine (here a crash) runs what was pinned,
        # not the values the new engine refused.
        host.run(["kill", "-9", str(engine_pid)])
        wait_for(lambda: main_pid(host, MAIN) not in (0, engine_pid) and active(host, MAIN) == "active",
                 timeout=120, what="the engine restarted by systemd")
        wait_for(lambda: status_code(host) == 200, timeout=120, what="serving again")
        assert int(engine_metric(host, "hostd_engine_max_model_len")) == before
    finally:
        host.run(["rm", "-f", f"{DROPINS}/95-override.yaml", f"{DROPINS}/99-rollback.yaml"])


def test_cancel_while_the_second_engine_starts_stops_it_and_restores_the_dropin(host):
    engine_pid = main_pid(host, MAIN)
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")
    # Hold the second engine's start long enough to cancel it, whatever this machine's speed.
    host.write_file(SLOW_NEXT, "[Service]\nExecStartPre=/bin/sleep 600\n")
    host.systemctl("daemon-reload")
    try:
        path = hostctl(host, "reload", "tiny", "max_num_seqs=2", "--no-wait", check=True).stdout.strip()
        wait_for(lambda: op_property(host, path, "Stage") == "start-next", timeout=60, what="start-next")
        wait_for(lambda: active(host, NEXT) == "activating", timeout=60, what="the second engine starting")
        cancel = hostctl(host, "cancel", str(op_property(host, path, "Id")))
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert wait_operation(host, path) == "cancelled"
        assert op_property(host, path, "Restored") is True
        assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
        assert active(host, NEXT) in ("inactive", "failed")
        assert main_pid(host, MAIN) == engine_pid  # the serving engine was never touched
        assert status_code(host) == 200
    finally:
        host.run(["rm", "-f", SLOW_NEXT])
        host.systemctl("daemon-reload")


def test_streams_running_on_the_replaced_engine_finish_in_full(host):
    """engine.shutdown_timeout is 0 here: an engine stopped with a stream
    running cuts it. The reload waits for the old engine's requests (up to
    reload.drain_timeout) before it restarts it, and for the second engine's
    before it retires it."""
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    outcomes: list[str] = []
    lock, done = threading.Lock(), threading.Event()

    def one() -> None:
        while not done.is_set():
            outcome = "lost"
            try:
                stream = client.completions.create(model="tiny", prompt="x", max_tokens=400, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                chunks = list(stream)
                if chunks and chunks[-1].choices and chunks[-1].choices[0].finish_reason == "length":
                    outcome = "completed"
            except openai.APIStatusError as exc:
                outcome = f"status {exc.status_code}"
            except openai.APIError as exc:
                outcome = f"lost: {exc}"
            with lock:
                outcomes.append(outcome)

    with ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(one) for _ in range(3)]
        wait_for(lambda: engine_metric(host, "hostd_engine_requests_running") >= 3, timeout=60, what="3 streaming")
        try:
            result = hostctl(host, "reload", "tiny", "max_num_seqs=3")
        finally:
            done.set()
        for worker in workers:
            worker.result(300)

    assert result.returncode == 0, result.stdout + result.stderr
    assert op_property(host, last_operation(host), "Strategy") == "overlap"
    assert outcomes and set(outcomes) == {"completed"}, outcomes
    assert active(host, NEXT) == "inactive"
