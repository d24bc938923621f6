"""Benchmark: what the gateway adds on top of talking to the engine directly.

Starts a weight daemon, a builtin engine and a gateway on a tiny random model
(CPU), then, in one run, interleaving direct and gateway requests:

- latency of GET /v1/models (no generation: isolates the proxy hop) and of a
  1-token completion, p50/p99, direct (HTTP over engine.sock) and through the
  gateway (TCP on 127.0.0.1 -> engine.sock);
- streaming throughput of a long completion (chunks per second).

With --baseline CHECKOUT, a second gateway from that checkout (another
commit's tree, run with PYTHONPATH=CHECKOUT) serves the same engine on its own
port, and every iteration times direct, baseline and this gateway in turn: on
a busy machine the two gateways see the same load, which two separate runs
do not.

    python benchmarks/gateway_overhead.py --requests 400 --streams 5
    python benchmarks/gateway_overhead.py --requests 300 --streams 5 --baseline /tmp/hostd-before
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hostd.checkpoints.random_model import write_checkpoint

# The harness that runs a model's daemons by hand lives beside the tests
# (harness/local.py): put the checkout on the path to import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.local import ModelTree, cpu_seconds, free_port, wait_for  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def timed(client: httpx.Client, method: str, url: str, **kw) -> float:
    started = time.perf_counter()
    response = client.request(method, url, **kw)
    response.raise_for_status()
    return time.perf_counter() - started


def stream_rate(client: httpx.Client, tokens: int) -> float:
    body = {"model": "bench", "prompt": "Once", "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    chunks, started = 0, time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
    return chunks / (time.perf_counter() - started)


def start_baseline(tree: ModelTree, checkout: Path, port: int) -> subprocess.Popen:
    """The gateway of CHECKOUT on PORT with its own control socket, same engine."""
    control = tree.root / "baseline" / "control.sock"  # a private directory of its own
    log = open(tree.root / "baseline-gateway.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hostd.main", "gateway", tree.name, "--listen", f"127.0.0.1:{port}",
         "--control", str(control)],
        env={**tree.env(), "PYTHONPATH": str(checkout)}, cwd=checkout, stdout=log, stderr=subprocess.STDOUT)

    def serving() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(serving, 60, "baseline gateway serving", proc)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--streams", type=int, default=5)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="also time the gateway of this checkout, interleaved")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="hostd-gw-bench-"))
    port = free_port()
    tree = ModelTree(workdir, name="bench")
    tree.write_config(write_checkpoint(workdir / "ckpt"), fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=4)
    rows = []
    baseline_proc = None
    try:
        tree.start_weights()
        tree.start_engine()
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        direct = tree.http()
        gateway = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        clients = {"direct": direct, "gateway": gateway}
        pids = {"gateway": tree.daemons[-1].pid}
        if args.baseline:
            baseline_port = free_port()
            baseline_proc = start_baseline(tree, args.baseline, baseline_port)
            clients = {"direct": direct, "baseline": httpx.Client(base_url=f"http://127.0.0.1:{baseline_port}",
                                                                  timeout=60), "gateway": gateway}
            pids["baseline"] = baseline_proc.pid
        completion = {"json": {"model": "bench", "prompt": "Hi", "max_tokens": 1, "temperature": 0}}
        for name, method, url, kw in (
            ("GET /v1/models", "GET", "/v1/models", {}),
            ("1-token completion", "POST", "/v1/completions", completion),
        ):
            times: dict[str, list[float]] = {k: [] for k in clients}
            for _ in range(20):  # warm every path
                for client in clients.values():
                    timed(client, method, url, **kw)
            cpu = {k: cpu_seconds(pid) for k, pid in pids.items()}
            for _ in range(args.requests):
                for key, client in clients.items():
                    times[key].append(timed(client, method, url, **kw))
            cpu = {k: (cpu_seconds(pid) - cpu[k]) / args.requests for k, pid in pids.items()}
            rows.append((name, times, cpu))
        rates: dict[str, list[float]] = {k: [] for k in clients}
        for _ in range(args.streams):
            for key, client in clients.items():
                rates[key].append(stream_rate(client, args.stream_tokens))
    finally:
        if baseline_proc is not None:
            baseline_proc.terminate()
            baseline_proc.wait(60)
        tree.stop_all()

    ms = lambda v: f"{v * 1000:.2f}"  # noqa: E731
    print(f"\nGateway overhead, {args.requests} requests each, direct and gateway(s) interleaved; ms. "
          "CPU per request: the gateway process's user+system time over the row, divided by the requests "
          "(its 2 Hz health check included).\n")
    gateways = [k for k in clients if k != "direct"]
    print("| request | direct p50 | direct p99 | " + " | ".join(
        f"{k} p50 | {k} added p50 | {k} p99 | {k} added p99 | {k} CPU per request" for k in gateways) + " |")
    print("|---" * (3 + 5 * len(gateways)) + "|")
    for name, times, cpu in rows:
        p50d, p99d = statistics.median(times["direct"]), percentile(times["direct"], 0.99)
        cells = []
        for k in gateways:
            p50, p99 = statistics.median(times[k]), percentile(times[k], 0.99)
            cells += [ms(p50), ms(p50 - p50d), ms(p99), ms(p99 - p99d), ms(cpu[k])]
        print(f"| {name} | {ms(p50d)} | {ms(p99d)} | " + " | ".join(cells) + " |")
    print(f"\nStreaming, {args.streams} streams of {args.stream_tokens} tokens (median chunks/s): "
          + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in rates.items()) + ".")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
