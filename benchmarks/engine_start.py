"""Benchmark: engine start from disk (cold) against attaching from the daemon.

For each checkpoint size, one weight daemon is started and then the engine is
started repeatedly in ABBA order, A = `hostd engine --from-disk` (reads the
checkpoint itself), B = `hostd engine` (attaches the daemon's weights). Each
start is timed from process spawn to the first successful greedy completion
through the engine's socket; the engine's own start-up phases (from /health:
process start and imports, CUDA context, skeleton, fingerprint check, attach or
load, tokenizer, warm-up) are reported beside it, medians per phase. On CUDA,
the GPU's used memory (NVML, GPU 0) is read before the daemon starts, with the
daemon alone, with the daemon and each engine (read after its first token) and
after everything stopped. Prints Markdown tables and the command that produced
them.

With --spare, after those starts the model's config gains `spare: true`,
`hostd engine-spare` is started (the pre-imported spare, hostd/engine/spare.py)
and the engine is started RUNS times more through it: `hostd engine`
hands off to a process forked from the spare (by hand, without systemd's
cgroup move) and exits; that process serves, timed from the `hostd engine`
spawn as the others, and is stopped by its pid (/health).

    python benchmarks/engine_start.py --sizes tiny,0.5b --runs 6
    python benchmarks/engine_start.py --sizes 7b --device cuda --runs 4   # GPU host
    python benchmarks/engine_start.py --sizes 7b --device cuda --runs 2 --spare
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hostd.checkpoints.random_model import write_checkpoint

# The harness that runs a model's daemons by hand lives beside the tests
# (harness/local.py): put the checkout on the path to import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.local import ModelTree, wait_for  # noqa: E402


def first_token(tree: ModelTree) -> None:
    def ok() -> bool:
        try:
            with tree.http(timeout=60) as http:
                response = http.post(
                    "/v1/completions",
                    json={"model": tree.name, "prompt": "Hello", "max_tokens": 1, "temperature": 0},
                )
            return response.status_code == 200
        except Exception:
            return False

    wait_for(ok, 1800, "first greedy token")


def drop_page_cache() -> None:
    """Make the next read of the checkpoint come from the disk (root only)."""
    import os

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def gpu_used_mib(settle: float = 0.0):
    """GPU 0's used memory in MiB as NVML reports it, or None without NVML."""
    try:
        import pynvml

        time.sleep(settle)
        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def one_start(tree: ModelTree, from_disk: bool, drop_caches: bool, gpu: bool,
              spare: bool = False) -> tuple[float, dict, object]:
    if from_disk and drop_caches:
        drop_page_cache()
    started = time.monotonic()
    engine = tree.wait_engine(tree.start_engine(*(["--from-disk"] if from_disk else []), wait=False), 1800)
    first_token(tree)
    elapsed = time.monotonic() - started
    phases = tree.health()["phases_s"]
    used = gpu_used_mib(1.0) if gpu else None
    # From the spare the engine is the forked process (ForkedProcess), not `hostd engine`.
    assert spare == (engine.log().count("forked from the spare") == 1), engine.log()[-2000:]
    assert engine.stop() == 0, engine.log()[-2000:]
    return elapsed, phases, used


def bench(size: str, runs: int, device: str, workdir: Path, drop_caches: bool, spare: bool = False) -> dict:
    checkpoint = workdir / f"checkpoint-{size}"
    if not (checkpoint / "config.json").exists():
        print(f"# writing a random {size} checkpoint to {checkpoint}", file=sys.stderr)
        write_checkpoint(checkpoint, size)
    tree = ModelTree(workdir / f"tree-{size}", name=f"bench-{size}".replace(".", "_"))
    tree.write_config(checkpoint, device=device)
    samples: dict[str, list[tuple[float, dict, object]]] = {"disk": [], "daemon": [], "spare": []}
    gpu = device == "cuda"
    memory = {"before": gpu_used_mib() if gpu else None}
    try:
        started = time.monotonic()
        tree.start_weights(timeout=3600)
        daemon_load = time.monotonic() - started
        memory["daemon"] = gpu_used_mib(2.0) if gpu else None
        print(f"# {size}: daemon loaded in {daemon_load:.2f} s; GPU used {memory}", file=sys.stderr)
        order = ["disk", "daemon", "daemon", "disk"] * (-(-runs // 2))
        for kind in order[: 2 * runs]:
            samples[kind].append(one_start(tree, from_disk=kind == "disk", drop_caches=drop_caches, gpu=gpu))
            elapsed, phases, used = samples[kind][-1]
            print(f"# {size} {kind}: {elapsed:.2f} s; phases {phases}; GPU used {used} MiB", file=sys.stderr)
        if spare:
            tree.write_config(checkpoint, device=device, fixed={"spare": True})
            started = time.monotonic()
            spare_daemon = tree._spawn("engine-spare")
            wait_for(lambda: tree._connectable(tree.runtime_dir / "engine-spare.sock"), 600, "the spare",
                     spare_daemon.proc)
            print(f"# {size}: the spare's imports took {time.monotonic() - started:.2f} s", file=sys.stderr)
            for _ in range(runs):
                samples["spare"].append(one_start(tree, from_disk=False, drop_caches=False, gpu=gpu, spare=True))
                elapsed, phases, used = samples["spare"][-1]
                print(f"# {size} spare: {elapsed:.2f} s; phases {phases}; GPU used {used} MiB", file=sys.stderr)
    finally:
        tree.stop_all()
    memory["after"] = gpu_used_mib(3.0) if gpu else None
    bytes_ = sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))
    return {"size": size, "bytes": bytes_, "daemon_load": daemon_load, "memory": memory, **samples}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,0.5b", help="comma-separated: tiny, 0.5b, 7b, 14b")
    parser.add_argument("--runs", type=int, default=6, help="starts of each kind")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--workdir", type=Path, help="keep checkpoints here between runs")
    parser.add_argument("--spare", action="store_true",
                        help="then RUNS starts through the pre-imported spare (spare: true)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before each cold start (root): a checkpoint read from disk")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-bench-"))
    results = [bench(size, args.runs, args.device, workdir, args.drop_caches, args.spare)
               for size in args.sizes.split(",")]

    print(f"\nEngine start to first greedy token, {args.runs} runs each in ABBA order, "
          f"median (min–max), seconds. Device: {args.device}; page cache "
          f"{'dropped before each cold start' if args.drop_caches else 'warm'}; host: {platform.node()}, "
          f"{platform.processor() or platform.machine()}.\n")
    spare = " start attaching, forked from the spare |" if args.spare else ""
    print(f"| checkpoint | weights | cold start (from disk) | start attaching to daemon |{spare} attach/cold "
          "| daemon load (once) |")
    print("|---|---|---|---|---|---|" + ("---|" if args.spare else ""))
    for r in results:
        cold = [s[0] for s in r["disk"]]
        warm = [s[0] for s in r["daemon"]]
        forked = f" {spread([s[0] for s in r['spare']])} |" if args.spare else ""
        print(
            f"| {r['size']} | {r['bytes'] / 2**20:.1f} MiB | {spread(cold)} | {spread(warm)} |{forked} "
            f"{statistics.median(warm) / statistics.median(cold):.2f} | {r['daemon_load']:.2f} |"
        )
    print("\nWhere the time goes: median seconds per start-up phase (engine's own clock).\n")
    kinds = ("disk", "daemon", "spare") if args.spare else ("disk", "daemon")
    phases = list(dict.fromkeys(p for r in results for k in kinds for _, ph, _ in r[k] for p in ph))
    print("| checkpoint | start | " + " | ".join(phases) + " |")
    print("|---|---|" + "---|" * len(phases))
    for r in results:
        for kind in kinds:
            cells = [
                f"{statistics.median([ph.get(p, 0.0) for _, ph, _ in r[kind]]):.3f}" for p in phases
            ]
            label = {"disk": "cold", "daemon": "attach", "spare": "attach, from the spare"}[kind]
            print(f"| {r['size']} | {label} | " + " | ".join(cells) + " |")
    if any(r["memory"]["before"] is not None for r in results):
        print("\nGPU 0 used memory (NVML), MiB; engines read after their first token, "
              "median (min–max) over the starts; in brackets the increase over the row's previous state.\n")
        print("| checkpoint | weights (MiB) | before daemon | daemon | daemon + attached engine "
              "| daemon + cold engine | after all stopped |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            m = r["memory"]
            attached = [u for _, _, u in r["daemon"] if u is not None]
            cold = [u for _, _, u in r["disk"] if u is not None]
            if m["before"] is None or m["daemon"] is None or not attached or not cold:
                continue
            print(
                f"| {r['size']} | {r['bytes'] / 2**20:.0f} | {m['before']:.0f} "
                f"| {m['daemon']:.0f} (+{m['daemon'] - m['before']:.0f}) "
                f"| {statistics.median(attached):.0f} ({min(attached):.0f}–{max(attached):.0f}; "
                f"+{statistics.median(attached) - m['daemon']:.0f}) "
                f"| {statistics.median(cold):.0f} ({min(cold):.0f}–{max(cold):.0f}; "
                f"+{statistics.median(cold) - m['daemon']:.0f}) "
                f"| {m['after']:.0f} ({m['after'] - m['before']:+.0f}) |"
            )
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
