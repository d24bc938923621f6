"""The in-place reload (reload.strategy: in-place, issue 50) under a real
systemd 252: `systemctl reload model@NAME` of a limit change under three
streaming openai clients answers nothing 503, loses nothing, starts no
process (the engine's, the standby's and the weight daemon's MainPIDs stay)
and serves the new value; a change the engine refuses (a max_model_len
beyond the checkpoint's) or a KV cache that fits nowhere leaves the old
runner serving, refuses no request and leaves the files as they were; a
manager killed -9 in the middle leaves one engine serving one config, the
files matching it and the standby on it.

One container for the module: model tiny with standby: true and
reload.strategy: in-place (a drop-in), and hostd.service. Clients are the
official openai client without retries, streaming the whole time
(test_overlap_units.under_load).
"""

from __future__ import annotations

import json

import pytest

from container import SystemdContainer, wait_for
from ports import reserved_port
from test_manager import DROPINS, hostctl, kill_manager_and_await_recovery, last_operation, model_state, \
    op_property, read_file
from test_model_units import main_pid, prepare_model
from test_overlap_units import MAIN, NEXT, active, another_max_num_seqs, running_limits, under_load
from test_standby_units import STANDBY, standby_health

WEIGHTS = "model-weights@tiny.service"
ADMIN_DROPIN = f"{DROPINS}/50-admin.yaml"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    host, port = systemd_container, reserved_port()
    prepare_model(host, port, timeouts="{start: 120, stop: 60}", standby="true")
    # No strategy drop-in: in-place is the default (a builtin engine's limits).
    host.base_url = f"http://127.0.0.1:{port}"
    host.systemctl("start", "model@tiny.service", "hostd.service", timeout=300)
    wait_for(lambda: model_state(host) == "serving", timeout=120, what="serving per the manager")
    wait_for(lambda: standby_health(host) is not None, timeout=300, what="the standby warm")
    return host


def pids(host: SystemdContainer) -> tuple[int, int, int]:
    return main_pid(host, MAIN), main_pid(host, STANDBY), main_pid(host, WEIGHTS)


def test_systemctl_reload_of_a_limit_change_under_three_streams_starts_no_process(host):
    before = pids(host)
    target = another_max_num_seqs(host)
    host.write_file(ADMIN_DROPIN, f"engine:\n  max_num_seqs: {target}\n")
    result, counts = under_load(host, lambda: host.systemctl("reload", "model@tiny.service", timeout=300),
                                clients=3)
    assert result.returncode == 0, result.stdout + result.stderr
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    path = last_operation(host)
    assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("done", "in-place")
    assert op_property(host, path, "WeightsReused") is True
    notes = op_property(host, path, "Notes")
    assert any(n.startswith("the main engine rebuilt in place on the target config") for n in notes), notes
    assert "the standby rebuilt in place on the target config" in notes
    assert pids(host) == before  # no unit started, stopped or restarted
    assert running_limits(host)["max_num_seqs"] == target
    assert standby_health(host)["engine_config"] == running_limits(host)
    assert active(host, NEXT) == "inactive"
    journal = host.run(["journalctl", "-u", "hostd.service", "--no-pager", "-o", "cat"]).stdout
    assert "(strategy in-place: every changed key is the engine's limits" in journal


def test_a_change_the_engine_refuses_rolls_back_with_its_words_and_refuses_no_request(host):
    before, limits = pids(host), running_limits(host)
    reload_file = read_file(host, f"{DROPINS}/90-reload.yaml")
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", "max_model_len=99999"), clients=3)
    assert result.returncode == 1
    assert counts["refused"] == 0 and counts["lost"] == 0, counts
    path = last_operation(host)
    assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "in-place")
    assert "max_position_embeddings" in op_property(host, path, "Error")  # the engine's own words
    assert pids(host) == before and running_limits(host) == limits
    assert standby_health(host)["engine_config"] == limits
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == reload_file


def test_a_kv_cache_that_fits_nowhere_is_refused_before_anything_is_touched(host):
    before, limits = pids(host), running_limits(host)
    reload_file = read_file(host, f"{DROPINS}/90-reload.yaml")
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", "kv_cache_mib=16000000"), clients=3)
    assert result.returncode != 0
    assert "even once the serving runner's is freed" in result.stderr + result.stdout
    assert counts["refused"] == 0 and counts["lost"] == 0, counts
    assert pids(host) == before and running_limits(host) == limits
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == reload_file


def test_manager_killed_during_an_in_place_reload_leaves_one_engine_on_one_config(host):
    before = pids(host)
    path = hostctl(host, "reload", "tiny", f"max_num_seqs={another_max_num_seqs(host)}", "--no-wait",
                   check=True).stdout.strip()
    # Whichever stage the kill lands in (the rebuild takes a fraction of a
    # second here), the outcome must be the same: one engine, one config.
    wait_for(lambda: op_property(host, path, "Stage") != "validate", timeout=60, what="the reload under way")
    kill_manager_and_await_recovery(host)
    assert active(host, MAIN) == "active" and active(host, NEXT) == "inactive"
    assert pids(host)[0] == before[0] and pids(host)[2] == before[2]  # recovered in place: no engine start
    running = running_limits(host)
    on_disk = json.loads(hostctl(host, "config", "tiny", "--json", check=True).stdout)["data"]
    assert running["max_num_seqs"] == on_disk["engine.max_num_seqs"]["value"]  # committed or rolled back
    wait_for(lambda: (standby_health(host) or {}).get("engine_config") == running, timeout=120,
             what="the standby on the serving config")
