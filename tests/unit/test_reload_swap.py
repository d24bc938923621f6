"""The checkpoint swap's pure parts (issue 36): where a patch's `model` goes
in 90-reload.yaml, which values the manager refuses before the loader, which
keys ride a swap per backend, and the preflight's words. The swap itself
runs against real daemons under systemd: tests/system/test_swap_units.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hostd.config import schema
from hostd.manager import errors
from hostd.manager.dropins import merge_patch
from hostd.manager.patch import check_checkpoint_values
from hostd.manager.strategies import STRATEGIES, checkpoint_bytes


def test_a_patchs_model_goes_to_the_top_of_the_dropin_and_limits_under_engine(tmp_path: Path):
    dropin = tmp_path / "90-reload.yaml"
    dropin.write_text("engine:\n  max_num_seqs: 4\n")
    merged = merge_patch(dropin, {"model": "/srv/ckpt/v2", "max_model_len": 64}, ("model",))
    assert merged == {"model": "/srv/ckpt/v2", "engine": {"max_num_seqs": 4, "max_model_len": 64}}


@pytest.mark.parametrize("value", ["relative/dir", "", 7, None, "/srv/\0x"])
def test_a_model_that_is_not_an_absolute_path_is_refused_naming_the_key(value):
    with pytest.raises(errors.InvalidValue, match="^model: expected the absolute path"):
        check_checkpoint_values({"model": value}, ("model",))


def test_a_checkpoint_whose_config_json_is_no_regular_file_is_refused_before_anything_reads_it(tmp_path: Path):
    import os

    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")  # root reading it would hang the manager
    (tmp_path / "device").mkdir()
    (tmp_path / "device" / "config.json").symlink_to("/dev/zero")
    for name in ("fifo", "device"):
        with pytest.raises(errors.InvalidValue, match="config.json is not a regular file"):
            check_checkpoint_values({"model": str(tmp_path / name)}, ("model",))
    with pytest.raises(errors.InvalidValue, match="has no config.json"):
        check_checkpoint_values({"model": str(tmp_path / "absent")}, ("model",))
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / "config.json").write_text("{}")
    check_checkpoint_values({"model": str(tmp_path / "good")}, ("model",))


def test_every_backend_swaps_its_model_and_nothing_else():
    assert {backend: schema.swappable_fields(backend) for backend in ("builtin", "vllm", "sglang")} == {
        "builtin": ("model",), "vllm": ("model",), "sglang": ("model",)}


def test_the_swap_strategy_publishes_its_stages_and_is_cancellable_until_its_engine_started():
    swap = STRATEGIES["swap"]
    assert [s.value for s in swap.stages] == [
        "validate", "preflight", "record", "load-next", "start-next", "switch", "settle", "restart", "verify",
        "resume", "retire", "commit", "finished"]
    assert {s.value for s in swap.cancellable} == {"validate", "preflight", "record", "load-next", "start-next"}


def test_the_preflight_counts_the_checkpoints_weight_files(tmp_path: Path):
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-00002.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 1000)
    assert checkpoint_bytes(str(tmp_path)) == 500
    assert checkpoint_bytes(str(tmp_path / "absent")) == 0


def test_a_reload_is_a_swap_exactly_when_the_target_names_another_checkpoint_than_the_daemon_holds(tmp_path: Path):
    """change.change_of, validate's one answer: another directory than the
    one the main weight daemon reports (resolved: a symlink to it is the
    same) is a swap; the same is a change of limits; a daemon that does not
    answer refuses a patch that names `model` and is a limits change
    otherwise."""
    from types import SimpleNamespace

    from hostd.manager.change import change_of

    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (tmp_path / "link").symlink_to(old)
    status = SimpleNamespace(fingerprint=SimpleNamespace(model_path=str(old.resolve())))
    target = lambda path: SimpleNamespace(model=str(path))  # noqa: E731
    swap = change_of("tiny", "model-weights@tiny.service", target(new), True, status)
    assert (swap.swaps, swap.checkpoint, swap.previous) == (True, str(new.resolve()), str(old.resolve()))
    assert not change_of("tiny", "model-weights@tiny.service", target(tmp_path / "link"), True, status).swaps
    assert not change_of("tiny", "model-weights@tiny.service", target(new), False, None).swaps
    with pytest.raises(errors.NotRunning, match="model-weights@tiny.service.*does not answer"):
        change_of("tiny", "model-weights@tiny.service", target(new), True, None)
