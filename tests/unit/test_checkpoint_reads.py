"""The checkpoint's config.json, which any user can make the manager read
(D-Bus WeightsRetained, WeightsNotRetainedReason), is read without blocking,
within the loader's size cap and once per file identity (issue 22, item 14);
and every reader of it goes through the one guarded reader
(checkpoints/config_file.py), which a FIFO, a sparse 400 MiB file or a
rename racing the read never hold or grow (issue 52, S1)."""

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
    real = upstream.config_file.read
    monkeypatch.setattr(upstream.config_file, "read", lambda d: reads.append(d) or real(d))
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "fp8"}
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "fp8"}
    assert len(reads) == 1
    path.write_text('{"quantization_config": {"quant_method": "awq"}}')
    os.utime(path, ns=(1, 1))
    assert upstream.checkpoint_quantization(str(tmp_path)) == {"quant_method": "awq"}
    assert len(reads) == 2


def in_a_thread(work) -> tuple[bool, object]:
    """WORK()'s result or its exception, and whether it was still running
    after 10 s (which bounds the test only: each read returns at once)."""
    result = []

    def run():
        try:
            result.append(work())
        except Exception as exc:  # the answer under test
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return thread.is_alive(), (result[0] if result else "no answer")


def hostile_checkpoints(tmp_path):
    """A FIFO, a sparse 400 MiB file and a directory, each named config.json."""
    fifo, sparse, directory = (tmp_path / n for n in ("fifo", "sparse", "directory"))
    for d in (fifo, sparse, directory):
        d.mkdir()
    os.mkfifo(fifo / "config.json")
    with open(sparse / "config.json", "wb") as f:
        f.truncate(400 << 20)
    (directory / "config.json").mkdir()
    return {"FIFO": fifo, "sparse 400 MiB": sparse, "directory": directory}


def test_every_reader_of_config_json_refuses_a_fifo_a_sparse_file_and_a_directory_at_once(tmp_path):
    from pathlib import Path

    from hostd import kv_bytes
    from hostd.checkpoints import config_file
    from hostd.engine import budget
    from hostd.manager import errors
    from hostd.manager.patch import check_checkpoint_values

    readers = {
        "config_file.read": config_file.read,
        "a patch's model=": lambda d: check_checkpoint_values({"model": str(d)}, ("model",)),
        "kv_bytes.for_checkpoint": lambda d: kv_bytes.for_checkpoint(str(d), "auto"),
        "budget.for_checkpoint": lambda d: budget.for_checkpoint(Path(d), dtype="auto", kv_cache_mib=None,
                                                                 max_num_seqs=1, max_model_len=16,
                                                                 device_total=None, device="cpu"),
    }
    for what, checkpoint in hostile_checkpoints(tmp_path).items():
        for name, read in readers.items():
            hung, answer = in_a_thread(lambda: read(checkpoint))
            assert not hung, f"{name} hung on a {what} config.json"
            assert isinstance(answer, (ValueError, errors.InvalidValue)), (name, what, answer)
            assert "config.json" in str(answer), (name, what, answer)


def test_a_rename_racing_the_read_never_hangs_it(tmp_path):
    """The check of model= was stat-then-open: a FIFO renamed over a regular
    config.json between the two hung 3 of 20 calls. Now one open without
    blocking, then fstat on that descriptor."""
    from hostd.checkpoints import config_file

    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    os.mkfifo(tmp_path / "fifo")
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            (tmp_path / "regular").write_text("{}")
            os.replace(tmp_path / "regular", checkpoint / "config.json")
            os.mkfifo(tmp_path / "fifo2") if not (tmp_path / "fifo2").exists() else None
            os.replace(tmp_path / "fifo2", checkpoint / "config.json")

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    try:
        answers = [in_a_thread(lambda: config_file.read(checkpoint)) for _ in range(200)]
    finally:
        stop.set()
        thread.join(10)
    assert not any(hung for hung, _ in answers)
    assert {type(a).__name__ for _, a in answers} <= {"dict", "ConfigFileError"}
