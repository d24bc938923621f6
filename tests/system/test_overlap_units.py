"""The overlap reload (reload.strategy: overlap, a drop-in) under a real systemd 252: no
request is refused while the engine is replaced, a new engine that fails
costs nothing, a manager killed mid-way leaves one engine, and a preflight
that finds no room falls back to restart and says so.

One container for the module (model tiny, hostd.service). Clients are the
official openai client without retries, streaming the whole time.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_manager import DROPINS, hostctl, kill_manager_and_await_recovery, last_operation, model_state, \
    op_property, read_file
from test_model_units import main_pid, prepare_model

MAIN = "model-engine@tiny.service"
NEXT = "model-engine-next@tiny.service"


def serving_tiny(container: SystemdContainer, dropins: dict[str, str] | None = None) -> SystemdContainer:
    """Model tiny and hostd.service started, its reloads under the overlap
    strategy (the default, in-place, would take these limit changes in the
    engine's own process: test_in_place_units.py), with DROPINS (file name ->
    YAML) in tiny.d first; serving per the manager."""
    port = reserved_port()
    prepare_model(container, port, timeouts="{start: 120, stop: 60}")
    container.write_file(f"{DROPINS}/40-strategy.yaml", "reload:\n  strategy: overlap\n")
    for name, text in (dropins or {}).items():
        container.write_file(f"{DROPINS}/{name}", text)
    container.base_url = f"http://127.0.0.1:{port}"
    container.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: model_state(container) == "serving", timeout=120, what="serving per the manager")
    return container


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    return serving_tiny(systemd_container)


def under_load(host: SystemdContainer, action, clients: int = 4, model: str = "tiny"):
    """Run ACTION() while CLIENTS stream completions of MODEL back to back;
    returns (what ACTION returned, {completed, refused, lost})."""
    client = openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
    counts = {"completed": 0, "refused": 0, "lost": 0}
    lock, done = threading.Lock(), threading.Event()

    def one() -> None:
        while not done.is_set():
            admitted, outcome = False, "lost"
            try:
                stream = client.completions.create(model=model, prompt="x", max_tokens=32, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True})
                admitted = True
                if any(c.choices and c.choices[0].finish_reason for c in stream):
                    outcome = "completed"
            except openai.APIStatusError as exc:
                outcome = "refused" if exc.status_code == 503 and not admitted else "lost"
                time.sleep(0.1)
            except openai.APIError:
                outcome = "lost"
            with lock:
                counts[outcome] += 1

    with ThreadPoolExecutor(clients) as pool:
        workers = [pool.submit(one) for _ in range(clients)]
        wait_for(lambda: counts["completed"] >= clients, timeout=120, what="load running")
        try:
            result = action()
            time.sleep(1.0)
        finally:
            done.set()
        for worker in workers:
            worker.result(300)
    return result, counts


def active(host: SystemdContainer, unit: str) -> str:
    return host.systemctl("is-active", unit, check=False).stdout.strip()


def running_limits(host: SystemdContainer) -> dict:
    return json.loads(host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine.sock",
                                "http://engine/health"]).stdout)["engine_config"]


def another_max_num_seqs(host: SystemdContainer) -> int:
    """A max_num_seqs the engine does not run now, whatever ran before this
    test: a reload to the running value ends 'unchanged' and proves nothing."""
    current = running_limits(host)["max_num_seqs"]
    return next(n for n in (3, 2, 5) if n != current)


def gateway_metrics(host: SystemdContainer) -> dict[str, float]:
    """The gateway's metric lines, 'name{labels}' -> value."""
    text = httpx.get(host.base_url + "/metrics", timeout=30).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_overlap_reload_under_streaming_load_refuses_nothing_and_loses_nothing(host):
    engine_pid, weights_pid = main_pid(host, MAIN), main_pid(host, "model-weights@tiny.service")
    target = another_max_num_seqs(host)
    metrics_before = gateway_metrics(host)
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", f"max_num_seqs={target}"))
    assert result.returncode == 0, result.stderr
    assert "reload of tiny: done (strategy overlap, weights reused)" in result.stdout
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    path = last_operation(host)
    assert op_property(host, path, "Strategy") == "overlap"
    assert main_pid(host, MAIN) != engine_pid and main_pid(host, "model-weights@tiny.service") == weights_pid
    assert active(host, NEXT) == "inactive"  # one engine at rest
    assert running_limits(host)["max_num_seqs"] == target
    journal = host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout
    assert "(strategy overlap: room for a second engine" in journal
    # The gateway measured one more reload, one that never answered 503
    # (counted from before it, whatever this module ran first).
    after = gateway_metrics(host)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - metrics_before.get(name, 0.0)

    assert grew('hostd_gateway_reload_duration_seconds_count{model="tiny",outcome="done"}') == 1
    assert grew('hostd_gateway_reload_unavailable_seconds_count{model="tiny"}') == 1
    assert grew('hostd_gateway_reload_unavailable_seconds_sum{model="tiny"}') == 0


def test_a_failing_overlap_reload_refuses_nothing_and_the_old_engine_keeps_serving(host):
    engine_pid = main_pid(host, MAIN)
    before = read_file(host, f"{DROPINS}/90-reload.yaml")
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", "max_model_len=99999"))
    assert result.returncode == 1
    assert counts["refused"] == 0 and counts["lost"] == 0, counts
    path = last_operation(host)
    assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "overlap")
    assert "max_position_embeddings" in op_property(host, path, "Error")  # the new engine's own words
    assert main_pid(host, MAIN) == engine_pid  # never stopped
    assert active(host, NEXT) in ("inactive", "failed")
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == before


def test_manager_killed_during_the_overlap_ends_with_exactly_one_engine(host):
    path = hostctl(host, "reload", "tiny", f"max_num_seqs={another_max_num_seqs(host)}", "--no-wait",
                   check=True).stdout.strip()
    wait_for(lambda: op_property(host, path, "Stage") in ("start-next", "switch", "restart"), timeout=120,
             what="the overlap under way")
    kill_manager_and_await_recovery(host)
    wait_for(lambda: active(host, NEXT) in ("inactive", "failed"), timeout=120, what="the second engine stopped")
    assert active(host, MAIN) == "active"
    running = running_limits(host)
    on_disk = json.loads(hostctl(host, "config", "tiny", "--json", check=True).stdout)["data"]
    assert running["max_num_seqs"] == on_disk["engine.max_num_seqs"]["value"]  # committed or rolled back


def test_no_room_for_a_second_engine_falls_back_to_restart_and_says_so(host):
    # More than any machine has must stay free beside a second engine.
    host.write_file(f"{DROPINS}/40-reserve.yaml", "reload:\n  overlap_reserve_mib: 100000000\n")
    try:
        # A value the engine does not run yet (the model starts with 4): alone,
        # a reload to 4 ended 'unchanged' without choosing a strategy.
        result = hostctl(host, "reload", "tiny", f"max_num_seqs={another_max_num_seqs(host)}")
        assert result.returncode == 0, result.stderr
        assert "reload of tiny: done (strategy restart, weights reused)" in result.stdout
        assert op_property(host, last_operation(host), "Strategy") == "restart"
        journal = host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout
        assert "overlap does not fit, falling back to restart" in journal and "overlap_reserve_mib" in journal
    finally:
        host.run(["rm", "-f", f"{DROPINS}/40-reserve.yaml"])
