"""Benchmark: what the gateway adds on top of talking to the engine directly.

Starts a weight daemon, a builtin engine and a gateway on a tiny random model
(CPU), then, in one run, interleaving direct and gateway requests:

- latency of GET /v1/models (no generation: isolates the proxy hop) and of a
  1-token completion, p50/p99, direct (HTTP over engine.sock) and through the
  gateway (TCP on 127.0.0.1 -> engine.sock);
- streaming throughput of a long completion (chunks per second).

    python benchmarks/gateway_overhead.py --requests 400 --streams 5
"""

from __future__ import annotations

import argparse
import shlex
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hostd.checkpoints.random_model import write_checkpoint
from hostd.local import ModelTree, wait_for


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--streams", type=int, default=5)
    parser.add_argument("--stream-tokens", type=int, default=400)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="hostd-gw-bench-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tree = ModelTree(workdir, name="bench")
    tree.write_config(write_checkpoint(workdir / "ckpt"), fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=4)
    rows = []
    try:
        tree.start_weights()
        tree.start_engine()
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        direct = tree.http()
        gateway = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        completion = {"json": {"model": "bench", "prompt": "Hi", "max_tokens": 1, "temperature": 0}}
        for name, method, url, kw in (
            ("GET /v1/models", "GET", "/v1/models", {}),
            ("1-token completion", "POST", "/v1/completions", completion),
        ):
            d, g = [], []
            for _ in range(20):  # warm both paths
                timed(direct, method, url, **kw), timed(gateway, method, url, **kw)
            for _ in range(args.requests):
                d.append(timed(direct, method, url, **kw))
                g.append(timed(gateway, method, url, **kw))
            rows.append((name, d, g))
        rates_d, rates_g = [], []
        for _ in range(args.streams):
            rates_d.append(stream_rate(direct, args.stream_tokens))
            rates_g.append(stream_rate(gateway, args.stream_tokens))
    finally:
        tree.stop_all()

    ms = lambda v: f"{v * 1000:.2f}"  # noqa: E731
    print(f"\nGateway overhead, {args.requests} requests each, direct and gateway interleaved; ms.\n")
    print("| request | direct p50 | gateway p50 | added p50 | direct p99 | gateway p99 | added p99 |")
    print("|---|---|---|---|---|---|---|")
    for name, d, g in rows:
        p50d, p50g = statistics.median(d), statistics.median(g)
        p99d, p99g = percentile(d, 0.99), percentile(g, 0.99)
        print(f"| {name} | {ms(p50d)} | {ms(p50g)} | {ms(p50g - p50d)} | {ms(p99d)} | {ms(p99g)} | {ms(p99g - p99d)} |")
    print(f"\nStreaming, {args.streams} streams of {args.stream_tokens} tokens: "
          f"direct {statistics.median(rates_d):.0f} chunks/s, gateway {statistics.median(rates_g):.0f} chunks/s (medians).")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
