"""The checkpoint's config.json, which any user can make the manager read
(D-Bus WeightsRetained, WeightsNotRetainedReason), is read without blocking,
within the loader's size cap and once per file identity (issue 22, item 14)."""

from __future__ import annotations

import os
import threading

from hostd.backends import upstream


def read_in_a_thread(model_dir) -> tuple[bool, object]:
    result = []
    thread = threading.Thread(target=lambda: result.append(upstream.checkpoint_quantization(str(model_dir))),
                              daemon=True)
    thread.start()
    thread.join(10)  # bounds the test only: the read returns at once or never
    return thread.is_alive(), (result[0] if result else "no answer")


def test_a_fifo_named_config_json_does_not_hang_the_reader(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    assert read_in_a_thread(tmp_path) == (False, None)


def test_a_config_json_past_the_loaders_cap_is_not_read(tmp_path):
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "fp8"}, "pad": "'
                                          + "x" * (2 << 20) + '"}')
    assert read_in_a_thread(tmp_path) == (False, None)


def test_config_json_is_read_once_per_identity_and_again_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text('{"quantization_config": {"quant_method": "fp8"}}')
    reads = []
    real = upstream.read_regular_file
    monkeypatch.setattr(upstream, "read_regular_file", lambda p, n: reads.append(p) or real(p, n), raising=False)
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "fp8"}
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "fp8"}
    assert len(reads) == 1
    path.write_text('{"quantization_config": {"quant_method": "awq"}}')
    os.utime(path, ns=(1, 1))
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "awq"}
    assert len(reads) == 2
