"""A checkpoint swap (issue 36) under a real systemd 252: `model:` changes
by a reload, under streaming load, with nothing refused and nothing lost; a
checkpoint that does not load is rolled back; a swap that does not fit
under reload.strategy overlap is refused with the numbers; and a manager
killed mid-swap leaves one checkpoint serving, the one on disk.

One container for the module (model tiny, builtin, CPU, hostd.service);
checkpoints from `hostd make-checkpoint` with different seeds. Clients are
the official openai client without retries, streaming the whole time.
"""

from __future__ import annotations

import json

import httpx
import pytest

from container import SystemdContainer, wait_for
from test_manager import DROPINS, busctl, hostctl, kill_manager_and_await_recovery, last_operation, model_state, \
    op_property, read_file, wait_operation
from test_model_units import main_pid
from test_overlap_units import active, serving_tiny, under_load

CHECKPOINTS = "/var/lib/hostd/checkpoints"
FIRST = f"{CHECKPOINTS}/tiny"
WEIGHTS, NEXT_WEIGHTS = "model-weights@tiny.service", "model-weights-next@tiny.service"
MAIN, SWAP_ENGINE = "model-engine@tiny.service", "model-engine-swap@tiny.service"


@pytest.fixture(scope="module")
def host(systemd_container: SystemdContainer):
    # A KV budget larger than the swap engine's (reload.bridge_kv_mib), so
    # that the swap engine's smaller cache shows (tiny's own is ~2 MiB).
    host = serving_tiny(systemd_container, {"30-kv.yaml": "engine:\n  kv_cache_mib: 32\nreload:\n  bridge_kv_mib: 16\n"})
    py = host.python
    for seed in (2, 3, 4):
        host.run([py, "-m", "hostd.main", "make-checkpoint", "--seed", str(seed), f"{CHECKPOINTS}/tiny-{seed}"],
                 timeout=120)
    # A checkpoint whose weight file was copied in part (a shard cut short):
    # config.json and the tokenizer are whole, so the manager's checks pass
    # and the new weight daemon's load fails.
    host.sh(f"cp -r {CHECKPOINTS}/tiny-4 {CHECKPOINTS}/tiny-broken && "
            f"f={CHECKPOINTS}/tiny-broken/model.safetensors && truncate -s $(( $(stat -c %s $f) / 2 )) $f")
    return host


def health(host: SystemdContainer, socket: str = "engine.sock") -> dict:
    return json.loads(host.run(["curl", "-s", "--unix-socket", f"/run/hostd/tiny/{socket}",
                                "http://engine/health"]).stdout)


def models(host: SystemdContainer) -> dict:
    return httpx.get(host.base_url + "/v1/models", timeout=30).json()["data"][0]


def on_disk(host: SystemdContainer) -> str:
    return json.loads(hostctl(host, "config", "tiny", "--json", check=True).stdout)["data"]["model"]["value"]


def serving_checkpoint(host: SystemdContainer) -> str:
    return health(host)["checkpoint"]


def test_a_swap_under_streaming_load_refuses_nothing_loses_nothing_and_serves_the_new_digest(host):
    before, weights_pid = health(host), main_pid(host, WEIGHTS)
    target = f"{CHECKPOINTS}/tiny-2" if before["checkpoint"] != f"{CHECKPOINTS}/tiny-2" else FIRST
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", f"model={target}"), clients=3)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reload of tiny: done (strategy swap)" in result.stdout
    assert counts["refused"] == 0 and counts["lost"] == 0 and counts["completed"] > 0, counts
    after = health(host)
    assert after["checkpoint"] == target and after["content_digest"] != before["content_digest"]
    card = models(host)
    assert card["id"] == "tiny"  # the served name stays
    assert (card["root"], card["hostd_content_digest"]) == (target, after["content_digest"])
    path = last_operation(host)
    assert (op_property(host, path, "Strategy"), op_property(host, path, "WeightsReused")) == ("swap", False)
    stages = op_property(host, path, "Stages")
    assert stages[stages.index("record") + 1: stages.index("switch")] == ["load-next", "start-next"]
    notes = " ".join(op_property(host, path, "Notes"))
    assert f"new checkpoint: {target}" in notes and after["content_digest"] in notes
    # The main pair serves the new checkpoint; the swap's pair is gone.
    assert main_pid(host, WEIGHTS) != weights_pid
    assert active(host, NEXT_WEIGHTS) == "inactive" and active(host, SWAP_ENGINE) == "inactive"
    assert on_disk(host) == target
    assert f"Checkpoint: {target}" in hostctl(host, "status", "tiny").stdout.replace("  ", " ")
    journal = host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout
    assert f"the new checkpoint is loaded: {target}" in journal
    # The swap's engine ran on reload.bridge_kv_mib's cache, the main one on its own.
    assert after["kv_cache_bytes"] == 32 << 20
    swap_journal = host.run(["journalctl", "-u", SWAP_ENGINE, "-o", "cat", "--no-pager"]).stdout
    assert f'"kv_cache_bytes": {16 << 20}' in swap_journal, swap_journal[-2000:]


def test_a_checkpoint_cut_short_is_rolled_back_and_the_old_one_keeps_serving(host):
    before, engine_pid = health(host), main_pid(host, MAIN)
    dropin = read_file(host, f"{DROPINS}/90-reload.yaml")
    result, counts = under_load(host, lambda: hostctl(host, "reload", "tiny", f"model={CHECKPOINTS}/tiny-broken"),
                                clients=3)
    assert result.returncode == 1, result.stdout
    assert counts["refused"] == 0 and counts["lost"] == 0, counts
    path = last_operation(host)
    assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "swap")
    assert "truncated?" in op_property(host, path, "Error")  # the new weight daemon's own words
    assert main_pid(host, MAIN) == engine_pid  # never stopped
    assert health(host)["content_digest"] == before["content_digest"]
    assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
    assert active(host, NEXT_WEIGHTS) in ("inactive", "failed") and active(host, SWAP_ENGINE) == "inactive"


def test_a_swap_that_does_not_fit_under_overlap_is_refused_with_the_numbers(host):
    # More than any machine has must stay free beside the second pair.
    host.write_file(f"{DROPINS}/40-reserve.yaml", "reload:\n  overlap_reserve_mib: 100000000\n")
    try:
        before, dropin = health(host), read_file(host, f"{DROPINS}/90-reload.yaml")
        result = hostctl(host, "reload", "tiny", f"model={CHECKPOINTS}/tiny-3")
        assert result.returncode == 1
        assert "a checkpoint swap does not fit" in result.stderr, result.stderr
        assert "the new checkpoint's weights (" in result.stderr and "MemAvailable is" in result.stderr
        assert "reload.strategy: restart" in result.stderr  # what would swap anyway
        assert health(host)["content_digest"] == before["content_digest"]
        assert read_file(host, f"{DROPINS}/90-reload.yaml") == dropin
        assert active(host, NEXT_WEIGHTS) in ("inactive", "failed")
    finally:
        host.run(["rm", "-f", f"{DROPINS}/40-reserve.yaml"])


def test_busctl_and_systemctl_reload_swap_too_and_a_broken_checkpoint_from_a_dropin_is_pinned(host):
    """The other doors: Reload over D-Bus with `model s PATH`; and an
    administrator's drop-in naming a checkpoint that does not load, applied
    by `systemctl reload`: rolled back with the checkpoint that served pinned
    in 99-rollback.yaml (the administrator's file is not edited)."""
    target = next(c for c in (f"{CHECKPOINTS}/tiny-3", f"{CHECKPOINTS}/tiny-2") if c != serving_checkpoint(host))
    busctl(host, "call", "org.hostd1", "/org/hostd1", "org.hostd1.Manager", "Reload", "sa{sv}", "tiny", "1",
           "model", "s", target)
    wait_for(lambda: op_property(host, last_operation(host), "State") != "running", timeout=300, what="the swap")
    assert op_property(host, last_operation(host), "State") == "done"
    assert serving_checkpoint(host) == target
    before = health(host)
    # The administrator's own drop-in, below 90-reload.yaml: the patch's
    # model goes first (a reload with no patch applies what is on disk).
    reload_dropin = read_file(host, f"{DROPINS}/90-reload.yaml")
    host.run(["rm", "-f", f"{DROPINS}/90-reload.yaml"])
    host.write_file(f"{DROPINS}/50-checkpoint.yaml", f"model: {CHECKPOINTS}/tiny-broken\n")
    try:
        result = host.systemctl("reload", "model@tiny.service", check=False, timeout=600)
        assert result.returncode != 0
        path = last_operation(host)
        assert (op_property(host, path, "State"), op_property(host, path, "Strategy")) == ("rolled-back", "swap")
        assert health(host)["content_digest"] == before["content_digest"]
        pin = read_file(host, f"{DROPINS}/99-rollback.yaml")
        assert f"model: {target}" in pin, pin
        assert on_disk(host) == target  # the pin wins over the administrator's file, which is as it was
        assert read_file(host, f"{DROPINS}/50-checkpoint.yaml") == f"model: {CHECKPOINTS}/tiny-broken\n"
    finally:
        host.run(["rm", "-f", f"{DROPINS}/50-checkpoint.yaml", f"{DROPINS}/99-rollback.yaml"])
        host.write_file(f"{DROPINS}/90-reload.yaml", reload_dropin)  # the disk says what serves again


def test_under_reload_strategy_restart_a_swap_restarts_the_pair_on_the_new_checkpoint(host):
    """reload.strategy: restart: the swap drains, restarts the weights daemon
    (the engine with it) on the new checkpoint and resumes: no second pair."""
    host.write_file(f"{DROPINS}/40-strategy.yaml", "reload:\n  strategy: restart\n")
    try:
        target = next(c for c in (f"{CHECKPOINTS}/tiny-3", f"{CHECKPOINTS}/tiny-2") if c != serving_checkpoint(host))
        weights_pid = main_pid(host, WEIGHTS)
        # CheckReload with `model` asks polkit's reload action (root: allowed), then says what would run.
        check = hostctl(host, "reload", "--check", "tiny", f"model={target}")
        assert check.returncode == 0, check.stderr
        assert "(strategy restart:" in check.stdout and f'-> "{target}"' in check.stdout, check.stdout
        assert main_pid(host, WEIGHTS) == weights_pid  # a check changes nothing
        result = hostctl(host, "reload", "tiny", f"model={target}")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "reload of tiny: done (strategy restart)" in result.stdout
        assert serving_checkpoint(host) == target == on_disk(host)
        assert main_pid(host, WEIGHTS) != weights_pid
        # Never started (a rolled-back swap earlier in the module may have left it failed).
        assert active(host, NEXT_WEIGHTS) in ("inactive", "failed") and active(host, SWAP_ENGINE) == "inactive"
        journal = host.run(["journalctl", "-u", "hostd.service", "-o", "cat", "--no-pager"]).stdout
        assert "reload.strategy is restart: the checkpoint swap stops the engine and weights" in journal
    finally:
        host.run(["rm", "-f", f"{DROPINS}/40-strategy.yaml"])


@pytest.mark.parametrize("stages", [("load-next", "start-next"), ("restart", "verify")],
                         ids=["before-the-switch", "main-pair-restarting"])
def test_a_manager_killed_mid_swap_leaves_one_checkpoint_serving_the_one_on_disk(host, stages):
    """Before the switch the main pair was never touched: recovery must roll
    back to the checkpoint that served (the main daemon does not hold the new
    one). While the main pair restarts, systemd's restart job outlives the
    manager, so either end is right, by whether the engine came up on the new
    checkpoint before recovery looked (recovery.py's _verified_target): the
    recovery operation says which, and the disk, the engine, /v1/models and
    RunningConfig agree with it."""
    before = serving_checkpoint(host)
    target = next(c for c in (f"{CHECKPOINTS}/tiny-3", f"{CHECKPOINTS}/tiny-2") if c != before)
    path = hostctl(host, "reload", "tiny", f"model={target}", "--no-wait", check=True).stdout.strip()
    wait_for(lambda: op_property(host, path, "Stage") in stages, timeout=120, interval=0.05,
             what=f"the swap at {' or '.join(stages)}")
    kill_manager_and_await_recovery(host)
    wait_for(lambda: active(host, SWAP_ENGINE) == "inactive" and active(host, NEXT_WEIGHTS) in ("inactive", "failed"),
             timeout=120, what="the swap's pair stopped")
    assert active(host, MAIN) == "active" and active(host, WEIGHTS) == "active"
    recovery = last_operation(host)
    assert op_property(host, recovery, "Kind") == "recovery"
    outcome = wait_operation(host, recovery)
    if stages == ("load-next", "start-next"):
        assert outcome == "rolled-back", outcome
    expected = target if outcome == "done" else before
    assert outcome in ("done", "rolled-back") and on_disk(host) == expected, (outcome, on_disk(host))
    assert serving_checkpoint(host) == expected and models(host)["root"] == expected
    assert running_config(host)["fixed"]["model"] == expected


def running_config(host: SystemdContainer) -> dict:
    out = busctl(host, "--json=short", "get-property", "org.hostd1", "/org/hostd1/model/tiny", "org.hostd1.Model",
                 "RunningConfig").stdout
    return json.loads(json.loads(out)["data"])


def test_after_a_restart_reloads_are_held_to_what_the_restart_read_and_status_names_it(host):
    """Issue 53: what the manager compares a reload against follows a restart
    (model-weights@tiny's start records the disk it reads). A restart onto
    another checkpoint by a drop-in: status and RunningConfig name the one
    that serves (they named the last swap's). A fixed key changed after that
    restart is refused by reload --check and by systemctl reload (both
    accepted it), and putting it back is accepted (it was refused)."""
    target = next(c for c in (f"{CHECKPOINTS}/tiny-3", f"{CHECKPOINTS}/tiny-2") if c != serving_checkpoint(host))
    model_dropin, fixed_dropin = f"{DROPINS}/95-model.yaml", f"{DROPINS}/95-fixed.yaml"
    try:
        host.write_file(model_dropin, f"model: {target}\n")
        host.systemctl("daemon-reload")
        host.systemctl("restart", "model@tiny.service", timeout=300)
        wait_for(lambda: model_state(host) == "serving", timeout=120, what="serving after the restart")
        assert serving_checkpoint(host) == target
        assert f"Checkpoint: {target}" in hostctl(host, "status", "tiny").stdout.replace("  ", " ")
        assert running_config(host)["fixed"]["model"] == target

        host.write_file(fixed_dropin, "gateway:\n  retry_after: 7\n")
        check = hostctl(host, "reload", "--check", "tiny", "max_num_seqs=3")
        assert check.returncode != 0 and "gateway" in check.stdout + check.stderr, check.stdout + check.stderr
        assert "changed on disk" in check.stdout + check.stderr
        reload = host.systemctl("reload", "model@tiny.service", check=False, timeout=300)
        assert reload.returncode != 0
        assert running_config(host)["fixed"]["gateway"]["retry_after"] == 5  # not recorded as running

        host.run(["rm", "-f", fixed_dropin])  # put back: what runs
        check = hostctl(host, "reload", "--check", "tiny", "max_num_seqs=3")
        assert check.returncode == 0, check.stdout + check.stderr
        assert host.systemctl("reload", "model@tiny.service", check=False, timeout=300).returncode == 0
    finally:
        host.run(["rm", "-f", model_dropin, fixed_dropin])
        host.systemctl("daemon-reload")
        host.systemctl("restart", "model@tiny.service", timeout=300)  # back on the checkpoint on disk
        wait_for(lambda: model_state(host) == "serving", timeout=120, what="serving again")
