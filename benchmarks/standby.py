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
  with `switch`; without one the row says so;
- standby (a second stack with `standby: true` and a warm standby engine in
  slot standby): the standby rebuilds on the new config (its POST
  /hostd/rebuild), the gateway switches to it, the main engine restarts on
  the new config (finishing what it admitted), the gateway switches back.

Each reload changes the config (max_num_seqs alternates between
--max-num-seqs and one less, written to the model's YAML as the manager's
drop-in would be), so "new config serves" is real: the seconds from the
reload's start until the first request sent after new requests went to an
engine running the new config (restart: the resume; overlap: the switch to
the next engine; standby: the switch to the rebuilt standby) got its first
byte.

Then a failover run per stack (without and with the standby): under the same
load, kill -9 of the serving engine, and after RestartSec (2 s, as
model-engine@.service) a new main engine, as systemd's Restart= would start
it; per kill: seconds until a request sent after the kill gets its first byte,
503s, other errors and lost requests (streams that were running on the killed
engine) until the main engine serves again, and how long that took.

Prints, per strategy: requests sent, admitted, completed, answered 503, lost
(admitted but not completed: must be 0), other errors, seconds of 503 per
reload, seconds until the new config serves, p50/p99 latency of completed
requests inside and outside reloads, reload duration, and peak memory during
the reloads over the level before them (host: MemTotal - MemAvailable; GPU 0:
NVML used, on --device cuda); the failover table; and what the standby costs
(host and GPU memory used before and after it started).

    python benchmarks/standby.py --clients 4 --seconds 60 --reloads 5
    python benchmarks/standby.py --device cuda --size 7b --workdir /var/tmp/hb   # GPU host
    python benchmarks/standby.py --strategies standby --kills 0   # one stack, standby only
"""

from __future__ import annotations

import argparse
import platform
import shlex
import signal
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
from availability import MemorySampler, percentile, seconds_of_503  # noqa: E402  (the same sampler and figures)


@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # completed | 503 | lost | error
    detail: str = ""
    first: Optional[float] = None  # when its first chunk came (admitted requests)


@dataclass
class Run:
    strategy: str
    outcomes: list[Outcome] = field(default_factory=list)
    reloads: list[tuple[float, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    skipped: str = ""
    new_config: list[float] = field(default_factory=list)  # per reload: when new requests went to the new config
    backs: list[float] = field(default_factory=list)  # failover: when the main engine served again, per kill


# ---------------------------------------------------------------- the model's processes


class Stack:
    """Weights daemon, engine(s), gateway: the model, by hand."""

    def __init__(self, tree: ModelTree, port: int, checkpoint: Path, device: str, max_num_seqs: int,
                 standby: bool = False):
        self.tree = tree
        self.port = port
        self.checkpoint, self.device, self.standby = checkpoint, device, standby
        self.limits = [max_num_seqs, max(1, max_num_seqs - 1)]  # what reloads alternate between
        self.reloads = 0
        self.engine: Optional[Daemon] = None
        self.standby_engine: Optional[Daemon] = None
        self.standby_cost: dict = {}
        self.write(self.limits[0])

    def write(self, max_num_seqs: int) -> dict:
        """The model's YAML with MAX_NUM_SEQS (what a reload's drop-in does);
        the engine section it makes."""
        fixed = {"listen": f"127.0.0.1:{self.port}", **({"standby": True} if self.standby else {})}
        self.tree.write_config(self.checkpoint, device=self.device, fixed=fixed, max_num_seqs=max_num_seqs)
        return {"max_num_seqs": max_num_seqs, "max_model_len": None, "shutdown_timeout": 60.0}

    def next_config(self) -> dict:
        self.reloads += 1
        return self.write(self.limits[self.reloads % 2])

    def socket(self, slot: str) -> Path:
        return self.tree.runtime_dir / paths.ENGINE_SOCKETS[slot]

    def start_engine(self, slot: str) -> Daemon:
        engine = self.tree.start_engine("--slot", slot, wait=False)
        wait_for(lambda: healthy(self.socket(slot)), 1800, f"engine in slot {slot}", engine.proc)
        return engine

    def start(self, gpu: bool) -> None:
        self.tree.start_weights(timeout=3600)
        self.engine = self.start_engine("main")
        self.tree.start_gateway()
        wait_for(lambda: self.tree.control("status")["state"] == "serving", 60, "gateway serving")
        if self.standby:
            time.sleep(2.0)
            before = used_memory(gpu)
            self.standby_engine = self.start_engine("standby")
            time.sleep(2.0)
            after = used_memory(gpu)
            self.standby_cost = {k: after[k] - before[k] for k in before}
            reported = engine_health(self.socket("standby")).get("memory") or {}
            if "anonymous" in reported:
                self.standby_cost["anonymous"] = reported["anonymous"] / 2**20

    def restart(self, drain_timeout: float) -> float:
        """The restart strategy: 503 from the drain until the new engine answers."""
        assert self.engine
        self.next_config()
        self.tree.control("drain", timeout=drain_timeout)
        self.engine.stop(timeout=120)
        self.engine = self.start_engine("main")
        self.tree.control("resume")
        return time.monotonic()

    def overlap(self) -> float:
        """The overlap strategy, as the manager runs it: a second engine in
        slot next takes new requests while main restarts, then main again."""
        assert self.engine
        self.next_config()
        following = self.start_engine("next")
        try:
            self.tree.control("switch", slot="next")
            switched = time.monotonic()
            self.engine.stop(timeout=120)  # SIGTERM: finishes what it admitted, then exits
            self.engine = self.start_engine("main")
            self.tree.control("switch", slot="main")
        finally:
            following.stop(timeout=120)
        return switched

    def standby_reload(self) -> float:
        """The standby strategy, as the manager runs it: the standby rebuilds on
        the new config, takes new requests while main restarts, then main again."""
        assert self.engine and self.standby_engine
        section = self.next_config()
        transport = httpx.HTTPTransport(uds=str(self.socket("standby")))
        with httpx.Client(transport=transport, base_url="http://engine", timeout=600) as http:
            answer = http.post("/hostd/rebuild", json={"engine": section})
            if answer.status_code != 200:
                raise RuntimeError(f"the standby refused the rebuild: {answer.text[:300]}")
        self.tree.control("switch", slot="standby")
        switched = time.monotonic()
        self.engine.stop(timeout=120)
        self.engine = self.start_engine("main")
        self.tree.control("switch", slot="main")
        return switched

    def kill_main(self, restart_sec: float) -> float:
        """kill -9 of the serving engine; after RESTART_SEC a new one, as
        systemd's Restart= starts it; returns when the gateway sends new
        requests to it again."""
        assert self.engine
        self.engine.stop(signal.SIGKILL)
        time.sleep(restart_sec)
        self.engine = self.start_engine("main")
        wait_for(lambda: self.tree.control("status")["slot"] == "main"
                 and self.tree.control("status")["state"] == "serving", 60, "the gateway on the main engine")
        return time.monotonic()


def engine_health(path: Path) -> dict:
    transport = httpx.HTTPTransport(uds=str(path))
    with httpx.Client(transport=transport, base_url="http://engine", timeout=10) as client:
        return client.get("/health").json()


def used_memory(gpu: bool) -> dict:
    """Host used memory (MemTotal - MemAvailable) and GPU 0's NVML used, MiB."""
    out = {"host": MemorySampler.host_used()}
    if gpu:
        import pynvml

        pynvml.nvmlInit()
        out["gpu"] = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20
    return out


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


def client_loop(port: int, model: str, max_tokens: int, until: float, out: list[Outcome]) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    while time.monotonic() < until:
        started = time.monotonic()
        admitted = False
        try:
            stream = client.completions.create(
                model=model, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )
            admitted = True
            finished, first = False, None
            for chunk in stream:
                first = first or time.monotonic()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finished = True
            out.append(Outcome(started, time.monotonic(), "completed" if finished else "lost", "no finish_reason",
                               first))
        except openai.APIStatusError as exc:
            kind = "503" if exc.status_code == 503 else "error"
            out.append(Outcome(started, time.monotonic(), kind, f"{exc.status_code}"))
            if kind == "503":
                time.sleep(0.05)
        except Exception as exc:  # a broken stream after admission is a lost request
            out.append(Outcome(started, time.monotonic(), "lost" if admitted else "error", repr(exc)[:200]))


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
        new_config = None
        try:
            new_config = {"restart": lambda: stack.restart(args.drain_timeout), "overlap": stack.overlap,
                          "standby": stack.standby_reload}[strategy]()
        except Exception as exc:
            run.failures.append(repr(exc)[:300])
        t1 = time.monotonic()
        run.reloads.append((t0, t1))
        run.new_config.append(new_config)
        print(f"# {strategy}: reload {len(run.reloads)} took {t1 - t0:.2f} s", file=sys.stderr)
        time.sleep(max(0.0, gap - (t1 - t0)))
    for thread in threads:
        thread.join()
    sampler.stopping.set()
    sampler.join()
    run.memory = sampler.summary(run.reloads, first_reload)
    return run


def run_failover(stack: Stack, args, gpu: bool) -> Run:
    """kill -9 of the serving engine under load, ARGS.kills times."""
    run = Run("failover, " + ("with the standby" if stack.standby else "no standby"))
    until = time.monotonic() + args.warmup + args.kills * (args.failover_gap + 2 * args.warmup)
    threads = [
        threading.Thread(target=client_loop, args=(stack.port, stack.tree.name, args.max_tokens, until, run.outcomes))
        for _ in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup)
    for _ in range(args.kills):
        if time.monotonic() > until - args.warmup:
            break
        t0 = time.monotonic()
        try:
            back = stack.kill_main(args.restart_sec)
        except Exception as exc:
            run.failures.append(repr(exc)[:300])
            back = time.monotonic()
        run.reloads.append((t0, back))
        run.backs.append(back)
        print(f"# {run.strategy}: kill {len(run.reloads)}, main back after {back - t0:.2f} s", file=sys.stderr)
        time.sleep(args.warmup)
    for thread in threads:
        thread.join()
    return run


def first_answer_after(run: Run, moment: float) -> Optional[float]:
    """Seconds from MOMENT to the first byte of the first request sent at or after it."""
    firsts = [o.first for o in run.outcomes if o.first is not None and o.started >= moment]
    return min(firsts) - moment if firsts else None


# ---------------------------------------------------------------- report


def report(runs: list[Run], args) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print(f"\nAvailability during reloads: {args.clients} streaming clients (openai client, no retries, "
          f"{args.max_tokens} tokens each) for {args.seconds:.0f} s per strategy, {args.reloads} reloads; "
          f"device {args.device}, checkpoint {args.size}; host {platform.node()}, "
          f"{platform.processor() or platform.machine()}.\n")
    print("| strategy | sent | admitted | completed | 503 | lost | other errors | 503 s/reload "
          "| new config serves s (median, max) "
          "| p50 / p99 s inside reloads | p50 / p99 s outside | reload s (median, max) | peak memory over base, MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    failovers = [run for run in runs if run.backs or run.strategy.startswith("failover")]
    for run in runs:
        if run in failovers:
            continue
        if run.skipped:
            print(f"| {run.strategy} | not run: {run.skipped} |" + " |" * 11)
            continue
        serves = [answer for (t0, _), moment in zip(run.reloads, run.new_config) if moment is not None
                  for answer in [first_answer_after(run, moment)] if answer is not None
                  for answer in [answer + moment - t0]]
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
              f"| {fmt(statistics.median(serves) if serves else None)}, {fmt(max(serves, default=None))} "
              f"| {fmt(percentile(inside, 0.5))} / {fmt(percentile(inside, 0.99))} "
              f"| {fmt(percentile(outside, 0.5))} / {fmt(percentile(outside, 0.99))} "
              f"| {fmt(statistics.median(durations) if durations else None)}, {fmt(max(durations, default=None))} "
              f"| {memory} |")
    if failovers:
        print(f"\nFailover: kill -9 of the serving engine under the same load, {args.kills} time(s); a new main "
              f"engine {args.restart_sec:g} s later (RestartSec=). Counted from each kill until the main engine "
              "serves again (+2 s).\n")
        print("| run | kills | answered again s (median, max) | 503 | lost | other errors | main back s (median) |")
        print("|---|---|---|---|---|---|---|")
        for run in failovers:
            window = [o for o in run.outcomes if any(t0 <= o.ended and o.started <= t1 + 2.0
                                                      for t0, t1 in run.reloads)]
            count = lambda kind: sum(o.kind == kind for o in window)  # noqa: E731
            again = [a for t0, _ in run.reloads for a in [first_answer_after(run, t0)] if a is not None]
            backs = [t1 - t0 for t0, t1 in run.reloads]
            print(f"| {run.strategy} | {len(run.reloads)} "
                  f"| {fmt(statistics.median(again) if again else None)}, {fmt(max(again, default=None))} "
                  f"| {count('503')} | {count('lost')} | {count('error')} "
                  f"| {fmt(statistics.median(backs) if backs else None)} |")
    for stack_cost in getattr(args, "standby_costs", []):
        text = ", ".join(f"{k} +{v:.0f} MiB" for k, v in stack_cost.items())
        print(f"\nStandby cost (used memory after the standby started, over before; anonymous: what the "
              f"standby engine itself reports beyond the shared weights): {text}")
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
    parser.add_argument("--strategies", default="restart,overlap,standby",
                        help="restart and overlap run without a standby, standby on a second stack that has one")
    parser.add_argument("--kills", type=int, default=2, help="failover run: kill -9s per stack (0: none)")
    parser.add_argument("--failover-gap", type=float, default=20.0,
                        help="seconds of load to allow per kill for the main engine to come back")
    parser.add_argument("--restart-sec", type=float, default=2.0, help="RestartSec= of model-engine@.service")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny", help="hostd make-checkpoint size: tiny, 0.5b, 7b, 14b")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint here between runs")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-avail-"))
    checkpoint = workdir / f"checkpoint-{args.size}"
    if not (checkpoint / "config.json").exists():
        print(f"# writing a random {args.size} checkpoint to {checkpoint}", file=sys.stderr)
        write_checkpoint(checkpoint, args.size)
    strategies = [s for s in args.strategies.split(",") if s]
    gpu = args.device == "cuda"
    runs: list[Run] = []
    args.standby_costs = []
    # Without a standby (today's strategies), then with one: one stack each,
    # so that the first one's gateway has no standby to fail over to.
    for standby, wanted in ((False, [s for s in strategies if s != "standby"]),
                            (True, [s for s in strategies if s == "standby"])):
        if not wanted and not (args.kills and (standby is False or "standby" in strategies)):
            continue
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        tree = ModelTree(Path(tempfile.mkdtemp(prefix="tree-", dir=workdir)), name="bench")
        stack = Stack(tree, port, checkpoint, args.device, args.max_num_seqs, standby=standby)
        try:
            stack.start(gpu)
            if standby:
                args.standby_costs.append(stack.standby_cost)
            for strategy in wanted:
                runs.append(run_strategy(stack, strategy, args, gpu))
            if args.kills:
                runs.append(run_failover(stack, args, gpu))
        finally:
            tree.stop_all()
    report(runs, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
