"""Benchmark: how available a model stays while it is reloaded, per reload strategy.

Runs the weights daemon, the builtin engine and the gateway as plain
processes (tests/local.py, as tests/gpu does: no systemd, no manager), then, for
each strategy in turn on the same processes, N streaming clients (the official
`openai` client, no retries) send completions through the gateway for T
seconds while R reloads run, each strategy doing what the manager does:

- restart: drain the gateway, stop the engine, start a new one on the same
  weights and socket, wait until it answers, resume (503 while it starts);
- overlap: start a second engine (slot next, engine-next.sock) beside the
  serving one on the same weights, wait until it answers, switch the
  gateway's new requests to it (control verb `switch`), restart the main
  engine (the old one finishes what it admitted), switch back to it and stop
  the second one (which finishes its own). No 503 by design. Needs a gateway
  with `switch`; without one the row says so.

Prints, per strategy: requests sent, admitted, completed, answered 503, lost
(admitted but not completed: must be 0), other errors, seconds of 503 per
reload, p50/p99 latency of completed requests inside and outside reloads,
reload duration, and peak memory during the reloads over the level before
them (host: MemTotal - MemAvailable; GPU 0: NVML used, on --device cuda).

    python benchmarks/availability.py --clients 4 --seconds 60 --reloads 5
    python benchmarks/availability.py --device cuda --size 7b --workdir /var/tmp/hb   # GPU host
"""

from __future__ import annotations

import argparse
import platform
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import openai

from hostd import paths
from hostd.checkpoints.random_model import write_checkpoint

# The harness that runs a model's daemons by hand lives beside the tests
# (tests/local.py): put the checkout on the path to import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.local import Daemon, ModelTree, wait_for  # noqa: E402

@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # completed | 503 | lost | error
    detail: str = ""


@dataclass
class Run:
    strategy: str
    outcomes: list[Outcome] = field(default_factory=list)
    reloads: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    skipped: str = ""


# ---------------------------------------------------------------- the model's processes


class Stack:
    """Weights daemon, engine(s), gateway: the model, by hand."""

    def __init__(self, tree: ModelTree, port: int):
        self.tree = tree
        self.port = port
        self.engine: Optional[Daemon] = None

    def socket(self, slot: str) -> Path:
        return self.tree.runtime_dir / paths.ENGINE_SOCKETS[slot]

    def start_engine(self, slot: str) -> Daemon:
        engine = self.tree.start_engine("--slot", slot, wait=False)
        wait_for(lambda: healthy(self.socket(slot)), 1800, f"engine in slot {slot}", engine.proc)
        return engine

    def start(self) -> None:
        self.tree.start_weights(timeout=3600)
        self.engine = self.start_engine("main")
        self.tree.start_gateway()
        wait_for(lambda: self.tree.control("status")["state"] == "serving", 60, "gateway serving")

    def restart(self, drain_timeout: float) -> None:
        """The restart strategy: 503 from the drain until the new engine answers."""
        assert self.engine
        self.tree.control("drain", timeout=drain_timeout)
        self.engine.stop(timeout=120)
        self.engine = self.start_engine("main")
        self.tree.control("resume")

    def overlap(self) -> None:
        """The overlap strategy, as the manager runs it: a second engine in
        slot next takes new requests while main restarts, then main again."""
        assert self.engine
        following = self.start_engine("next")
        try:
            self.tree.control("switch", slot="next")
            self.engine.stop(timeout=120)  # SIGTERM: finishes what it admitted, then exits
            self.engine = self.start_engine("main")
            self.tree.control("switch", slot="main")
        finally:
            following.stop(timeout=120)


def healthy(path: Path) -> bool:
    try:
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://engine", timeout=5) as client:
            return client.get("/health").status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def gateway_has_switch(tree: ModelTree) -> bool:
    """Whether the gateway knows the `switch` verb (one without it refuses
    the verb itself, naming $.verb)."""
    try:
        tree.control("switch", slot="main")
    except Exception as exc:
        return "$.verb" not in str(exc)
    return True


# ---------------------------------------------------------------- load and measurements


def client_loop(port: int, model: str, max_tokens: int, until: float, out: list[Outcome],
                stop: Optional[threading.Event] = None) -> None:
    """One client's requests, back to back, until UNTIL (monotonic) or STOP is set
    (tests/gpu_system runs this load through the real manager)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    while time.monotonic() < until and not (stop is not None and stop.is_set()):
        started = time.monotonic()
        admitted = False
        try:
            stream = client.completions.create(
                model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )
            admitted = True
            finished = False
            for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            out.append(Outcome(started, time.monotonic(), "completed" if finished else "lost", "no finish_reason"))
        except openai.APIStatusError as exc:
            kind = "503" if exc.status_code == 503 else "error"
            out.append(Outcome(started, time.monotonic(), kind, f"{exc.status_code}"))
            if kind == "503":
                time.sleep(0.05)
        except Exception as exc:  # a broken stream after admission is a lost request
            out.append(Outcome(started, time.monotonic(), "lost" if admitted else "error", repr(exc)[:200]))


class MemorySampler(threading.Thread):
    """Host used memory and GPU 0 used memory (MiB), sampled every 0.1 s."""

    def __init__(self, gpu: bool):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float, Optional[float]]] = []
        self.stopping = threading.Event()
        self.handle = None
        if gpu:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)

    @staticmethod
    def host_used() -> float:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0])
        return (info["MemTotal"] - info["MemAvailable"]) / 1024

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            gpu = self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20 if self.handle else None
            self.samples.append((time.monotonic(), self.host_used(), gpu))

    def summary(self, windows: list[tuple[float, float]], before: float) -> dict:
        base = [s for s in self.samples if s[0] < before]
        inside = [s for s in self.samples if any(a <= s[0] <= b for a, b in windows)]
        if not base or not inside:
            return {}
        out = {"host_base": statistics.median(s[1] for s in base), "host_peak": max(s[1] for s in inside)}
        if self.handle:
            out["gpu_base"] = statistics.median(s[2] for s in base)
            out["gpu_peak"] = max(s[2] for s in inside)
        return out


def run_strategy(stack: Stack, strategy: str, args, gpu: bool) -> Run:
    run = Run(strategy)
    if strategy == "overlap" and not gateway_has_switch(stack.tree):
        run.skipped = "this gateway has no `switch` control verb (issue 14, phase 2)"
        return run
    sampler = MemorySampler(gpu)
    sampler.start()
    started = time.monotonic()
    until = started + args.seconds
    threads = [
        threading.Thread(target=client_loop, args=(stack.port, stack.tree.name, args.max_tokens, until, run.outcomes))
        for _ in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup)
    first_reload = time.monotonic()
    gap = max(0.0, (until - first_reload - args.warmup) / max(1, args.reloads))
    for _ in range(args.reloads):
        if time.monotonic() > until - args.warmup:
            break
        t0 = time.monotonic()
        try:
            stack.restart(args.drain_timeout) if strategy == "restart" else stack.overlap()
        except Exception as exc:
            run.failures.append(repr(exc)[:300])
        t1 = time.monotonic()
        run.reloads.append((t0, t1))
        print(f"# {strategy}: reload {len(run.reloads)} took {t1 - t0:.2f} s", file=sys.stderr)
        time.sleep(max(0.0, gap - (t1 - t0)))
    for thread in threads:
        thread.join()
    sampler.stopping.set()
    sampler.join()
    run.memory = sampler.summary(run.reloads, first_reload)
    return run


# ---------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def seconds_of_503(run: Run) -> float:
    """Per reload: from the first request answered 503 to the last one's answer,
    counting 503s that overlap the reload or come within 2 s after it."""
    total = 0.0
    for t0, t1 in run.reloads:
        hits = [o for o in run.outcomes if o.kind == "503" and o.ended >= t0 and o.started <= t1 + 2.0]
        if hits:
            total += max(o.ended for o in hits) - min(o.started for o in hits)
    return total / max(1, len(run.reloads))


def report(runs: list[Run], args) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\nAvailability during reloads: {args.clients} streaming clients (openai client, no retries, "
          f"{args.max_tokens} tokens each) for {args.seconds:.0f} s per strategy, {args.reloads} reloads; "
          f"device {args.device}, checkpoint {args.size}; host {platform.node()}, "
          f"{platform.processor() or platform.machine()}.\n")
    print("| strategy | sent | admitted | completed | 503 | lost | other errors | 503 s/reload "
          "| p50 / p99 s inside reloads | p50 / p99 s outside | reload s (median, max) | peak memory over base, MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        if run.skipped:
            print(f"| {run.strategy} | not run: {run.skipped} |" + " |" * 10)
            continue
        count = lambda kind: sum(o.kind == kind for o in run.outcomes)  # noqa: E731
        completed = [o for o in run.outcomes if o.kind == "completed"]
        inside = [o.ended - o.started for o in completed
                  if any(o.started <= t1 and o.ended >= t0 for t0, t1 in run.reloads)]
        outside = [o.ended - o.started for o in completed
                   if not any(o.started <= t1 and o.ended >= t0 for t0, t1 in run.reloads)]
        durations = [t1 - t0 for t0, t1 in run.reloads]
        m = run.memory
        memory = "-"
        if m:
            memory = f"host +{m['host_peak'] - m['host_base']:.0f}"
            if "gpu_peak" in m:
                memory += f"; GPU +{m['gpu_peak'] - m['gpu_base']:.0f} (peak {m['gpu_peak']:.0f})"
        admitted = count("completed") + count("lost")
        print(f"| {run.strategy} | {len(run.outcomes)} | {admitted} | {count('completed')} | {count('503')} "
              f"| {count('lost')} | {count('error')} | {seconds_of_503(run):.2f} "
              f"| {fmt(percentile(inside, 0.5))} / {fmt(percentile(inside, 0.99))} "
              f"| {fmt(percentile(outside, 0.5))} / {fmt(percentile(outside, 0.99))} "
              f"| {fmt(statistics.median(durations) if durations else None)}, {fmt(max(durations, default=None))} "
              f"| {memory} |")
    for run in runs:
        for failure in run.failures:
            print(f"\n{run.strategy}: a reload failed: {failure}")
        details = sorted({o.detail for o in run.outcomes if o.kind in ("lost", "error")})
        if details:
            print(f"\n{run.strategy}: lost/other errors: {'; '.join(details[:5])}")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60, help="per strategy")
    parser.add_argument("--reloads", type=int, default=5, help="per strategy")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the first reload and after the last")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--drain-timeout", type=float, default=60)
    parser.add_argument("--strategies", default="restart,overlap")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny", help="hostd make-checkpoint size: tiny, 0.5b, 7b, 14b")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint here between runs")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-avail-"))
    checkpoint = workdir / f"checkpoint-{args.size}"
    if not (checkpoint / "config.json").exists():
        print(f"# writing a random {args.size} checkpoint to {checkpoint}", file=sys.stderr)
        write_checkpoint(checkpoint, args.size)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tree = ModelTree(Path(tempfile.mkdtemp(prefix="tree-", dir=workdir)), name="bench")
    tree.write_config(checkpoint, device=args.device, fixed={"listen": f"127.0.0.1:{port}"},
                      max_num_seqs=args.max_num_seqs)
    stack = Stack(tree, port)
    runs = []
    try:
        stack.start()
        for strategy in args.strategies.split(","):
            runs.append(run_strategy(stack, strategy, args, args.device == "cuda"))
    finally:
        tree.stop_all()
    report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
