"""The warm standby (standby: true, issue 25) under a real systemd 252: a
reload under streaming load refuses nothing, loses nothing and serves the new
config from the rebuilt standby while the main engine restarts; a standby
that refuses the new config costs nothing and the main engine is never
touched; kill -9 of the serving engine answers no new request 503; a
completion it was running and had not answered is answered by the standby,
a stream it had started gets the engine_down error event (issue 34); a
manager killed mid-way leaves the main engine serving one config and the
standby on it.

One container for the module (model tiny with standby: true, hostd.service),
its reloads under reload.strategy: overlap, which runs the standby strategy
when the standby answers (the default, in-place, keeps the main engine's
process and the standby follows: test_in_place_units.py).
Clients are the official openai client without retries, streaming the whole
time (test_overlap_units.under_load).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_manager import DROPINS, hostctl, kill_manager_and_await_recovery, last_operation, model_state, \
    op_property, read_file
from test_model_units import main_pid, prepare_model, status_code
from test_overlap_units import MAIN, NEXT, active, another_max_num_seqs, gateway_metrics, running_limits, \
    under_load

STANDBY = "model-engine-standby@tiny.service"
TAKE = 0.3  # seconds for a request to reach the engine (a local hop); 240 tokens take about a second


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    """Model tiny with standby: true in its YAML before the daemon-reload (the
    generator's Wants= comes from it), started with hostd.service."""
    host, port = systemd_container, reserved_port()
    prepare_model(host, port, timeouts="{start: 120, stop: 60}", standby="true")
    host.write_file(f"{DROPINS}/40-strategy.yaml", "reload:\n  strategy: overlap\n")
    host.base_url = f"http://127.0.0.1:{port}"
    host.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: model_state(host) == "serving", timeout=120, what="serving per the manager")
    wait_for(lambda: standby_health(host) is not None, timeout=300, what="the standby warm")
    return host


def standby_health(host: SystemdContainer) -> dict | None:
    out = host.run(["curl", "-sf", "--unix-socket", "/run/hostd/tiny/engine-standby.sock", "http://engine/health"],
                   check=False).stdout
    return json.loads(out) if out.strip() else None


def gateway_status(host: SystemdContainer) -> dict:
    """The gateway's control status (the manager's view of it), as root in the container."""
    code = ("import json, msgspec; from hostd import paths; from hostd.gateway import control; "
            "print(json.dumps(msgspec.to_builtins(control.call(paths.control_socket('tiny'), control.Status()))))")
    return json.loads(host.run([host.python, "-c", code]).stdout)


def standby_answered(host: SystemdContainer) -> float:
    """Generation requests the standby answered 200 (its own /metrics)."""
    text = host.run(["curl", "-s", "--unix-socket", "/run/hostd/tiny/engine-standby.sock",
                     "http://engine/metrics"]).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hostd_engine_requests_total{") and 'status="200"' in line)


def main_back(host: SystemdContainer, killed_pid: int) -> None:
    """Wait until systemd restarted the main engine and new requests went back to it."""
    wait_for(lambda: main_pid(host, MAIN) not in (0, killed_pid) and active(host, MAIN) == "active",
             timeout=180, what="the main engine restarted by systemd")
    wait_for(lambda: gateway_status(host)["slot"] == "main", timeout=60, what="new requests on the main engine")


def kill_main_while_it_runs(host: SystemdContainer, request, started=None):
    """REQUEST() in a thread; kill -9 of the main engine once it runs it
    (STARTED(), or else after TAKE seconds: a status call through the
    container would take longer than the request itself); what
    REQUEST() returned or raised, once main is back and serving new requests."""
    engine_pid = main_pid(host, MAIN)
    assert gateway_status(host)["slot"] == "main"
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(request)
        if started:
            wait_for(lambda: started() or future.done(), timeout=60, what="the request started")
        else:
            time.sleep(TAKE)
        assert not future.done(), "the request ended before the main engine could be killed under it"
        host.run(["kill", "-9", str(engine_pid)])
        outcome = future.exception(timeout=300) or future.result()
    main_back(host, engine_pid)
    return outcome


def client(host: SystemdContainer) -> openai.OpenAI:
    return openai.OpenAI(base_url=host.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_standby_is_a_unit_of_the_model_on_the_same_weights_and_hostctl_shows_it(host):
    assert active(host, STANDBY) == "active"
    health = standby_health(host)
    assert health["slot"] == "standby" and health["engine_config"] == running_limits(host)
    assert health["weights_pid"] == main_pid(host, "model-weights@tiny.service")
    assert health["tensors_outside_shared"] == 0  # attached, nothing copied
    cgroup = host.systemctl("show", "-p", "ControlGroup", "--value", STANDBY).stdout.strip()
    assert cgroup.endswith("/model-engine-standby@tiny.service")
    shown = host.systemctl("show", "-p", "BindsTo", "-p", "PartOf", "-p", "User", STANDBY).stdout
    assert "BindsTo=model-weights@tiny.service" in shown and "PartOf=model@tiny.service" in shown
    assert "User=hostd-tiny" in shown
    status = hostctl(host, "status", "tiny", check=True).stdout
    assert f"Standby: active (PID {main_pid(host, STANDBY)})" in status


def test_a_standby_reload_under_streaming_load_refuses_nothing_loses_nothing_and_serves_the_new_config(host):
    engine_pid, standby_pid = main_pid(host, MAIN), main_pid(host, STANDBY)
    weights_pid = main_pid(host, "model-weights@tiny.service")
    target = another_max_num_seqs(host)
    served_before = standby_answered(host)
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", f"max_num_seqs={target}"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reload of tiny: done (strategy standby, weights reused)" in result.stdout
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    path = last_operation(host)
    assert op_property(host, path, "Strategy") == "standby"
    assert any(note.startswith("standby rebuilt in") for note in op_property(host, path, "Notes"))
    # The standby rebuilt in its own process and served meanwhile; main restarted.
    assert main_pid(host, STANDBY) == standby_pid and standby_answered(host) > served_before
    assert main_pid(host, MAIN) != engine_pid and main_pid(host, "model-weights@tiny.service") == weights_pid
    assert running_limits(host)["max_num_seqs"] == target
    assert standby_health(host)["engine_config"] == running_limits(host)  # standby on the committed config
    assert active(host, NEXT) == "inactive"  # no overlap engine was started


def test_a_failing_standby_rebuild_rolls_back_refuses_nothing_and_never_touches_main(host):
    engine_pid, standby_pid = main_pid(host, MAIN), main_pid(host, STANDBY)
    limits = running_limits(host)
    before = read_file(host, f"{DROPINS}/90-reload.yaml")
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", "max_model_len=99999"))
    assert result.returncode == 1
    assert counts["refused"] == 0 and counts["lost"] == 0, counts
    path = last_operation(host)
    assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "standby")
    assert "max_position_embeddings" in op_property(host, path, "Error")  # the standby's own words
    assert (main_pid(host, MAIN), main_pid(host, STANDBY)) == (engine_pid, standby_pid)
    assert running_limits(host) == limits and standby_health(host)["engine_config"] == limits
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == before
    assert active(host, NEXT) == "inactive"


def test_kill_9_of_the_serving_engine_answers_no_new_request_503_and_the_main_engine_comes_back(host):
    engine_pid = main_pid(host, MAIN)
    failovers = gateway_metrics(host).get('hostd_gateway_failovers_total{model="tiny"}', 0.0)
    served_before = standby_answered(host)
    assert gateway_status(host)["slot"] == "main"

    def kill():
        host.run(["kill", "-9", str(engine_pid)])
        wait_for(lambda: standby_answered(host) > served_before, timeout=60, what="the standby serving")

    _, counts = under_load(host, kill)
    assert gateway_status(host)["failed_over"] in ("main", "")  # "" once main is back already
    # Streams running on the killed engine were cut (as without a standby);
    # no new request was answered 503.
    assert counts["refused"] == 0 and counts["completed"] > 0, counts
    assert gateway_metrics(host)['hostd_gateway_failovers_total{model="tiny"}'] == failovers + 1
    main_back(host, engine_pid)  # once main answers again, new requests go back to it
    assert gateway_status(host)["failed_over"] == "" and status_code(host) == 200
    assert hostctl(host, "status", "tiny", check=True).stdout.startswith("● tiny - builtin model, serving")


def test_a_completion_the_killed_engine_had_not_answered_is_answered_by_the_standby(host):
    served_before = standby_answered(host)
    answer = kill_main_while_it_runs(host, lambda: client(host).completions.create(
        model="tiny", prompt="Once", max_tokens=240, temperature=0, extra_body={"ignore_eos": True}))
    assert isinstance(answer, openai.types.Completion), answer
    assert answer.usage.completion_tokens == 240 and answer.choices[0].finish_reason == "length"
    assert standby_answered(host) == served_before + 1  # the standby ran it, once


def test_a_stream_the_killed_engine_had_started_gets_the_engine_down_error_event(host):
    chunks: list[str] = []

    def stream():
        for chunk in client(host).completions.create(model="tiny", prompt="Once", max_tokens=240, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True}):
            chunks.append(chunk.choices[0].text if chunk.choices else "")
        return "finished"

    raised = kill_main_while_it_runs(host, stream, started=lambda: bool(chunks))
    assert isinstance(raised, openai.APIError) and "stopped mid-stream" in str(raised), raised
    assert chunks  # it had started


def test_manager_killed_during_a_standby_reload_leaves_main_serving_one_config_and_the_standby_on_it(host):
    path = hostctl(host, "reload", "tiny", f"max_num_seqs={another_max_num_seqs(host)}", "--no-wait",
                   check=True).stdout.strip()
    wait_for(lambda: op_property(host, path, "Stage") in ("switch", "settle", "restart"), timeout=120,
             what="the standby reload under way")
    kill_manager_and_await_recovery(host)
    assert active(host, MAIN) == "active" and active(host, STANDBY) == "active"
    running = running_limits(host)
    on_disk = json.loads(hostctl(host, "config", "tiny", "--json", check=True).stdout)["data"]
    assert running["max_num_seqs"] == on_disk["engine.max_num_seqs"]["value"]  # committed or rolled back
    wait_for(lambda: (standby_health(host) or {}).get("engine_config") == running, timeout=120,
             what="the standby on the serving config")
