"""Benchmark: streamed tokens through hostd's vLLM path against straight to upstream's socket.

Issue 55, item 7. Runs the vLLM test double (tests/doubles/vllm, a stand-in
upstream that streams one SSE event per token, --token-seconds apart) under
hostd's real weights and engine supervisors and its gateway, by hand
(harness/local.py). For each number of concurrent streams, clients in one
asyncio process run streams back to back for --seconds, first straight to
vLLM's --uds socket (direct), then through the gateway's TCP port (hostd).
The table gives tokens per second and the CPU time hostd's own processes
(the gateway and the engine supervisor, from /proc) spent per token.

With --hostd CHECKOUT, hostd's processes run from another checkout (another
commit's tree, PYTHONPATH=CHECKOUT): the "before" of a change.

    python benchmarks/upstream_streams.py --streams 1,32,128
    python benchmarks/upstream_streams.py --streams 1,32,128 --hostd /tmp/hostd-before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import aiohttp
import yaml

# The harness that runs a model's daemons by hand lives beside the tests
# (harness/local.py): put the checkout on the path to import it.
CHECKOUT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(CHECKOUT))
from harness.local import ModelTree, cpu_seconds, free_port, wait_for  # noqa: E402

DOUBLE = CHECKOUT / "tests" / "doubles" / "vllm"  # run as a program, as HOSTD_VLLM
NAME = "m"


def model_tree(root: Path, port: int, token_seconds: float) -> ModelTree:
    checkpoint = root / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    (checkpoint / "model.safetensors").write_bytes(b"not really weights")
    tree = ModelTree(root, name=NAME)
    data = {"backend": "vllm", "model": str(checkpoint), "device": "cpu", "listen": f"127.0.0.1:{port}",
            "engine": {"max_num_seqs": 256}, "gateway": {"max_connections_per_client": 1024},
            "env": {"HOSTD_VLLM": str(DOUBLE), "HOSTD_TEST_TOKEN_SECONDS": str(token_seconds)}}
    path = tree.config_dir / "models" / f"{NAME}.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(data))
    return tree


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int) -> int:
    body = {"model": NAME, "prompt": "Once", "max_tokens": tokens, "stream": True}
    got = 0
    async with session.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b'data: {"id"'):  # a token's event, not an error event
                got += 1
    if got != tokens:
        raise RuntimeError(f"a stream ended after {got} of {tokens} tokens")
    return got


async def load(connector: Callable[[], aiohttp.BaseConnector], url: str, streams: int, tokens: int, seconds: float,
               pids: list[int]) -> tuple[float, float]:
    """STREAMS clients, each running streams back to back until SECONDS have
    passed: (tokens per second, CPU seconds of PIDS meanwhile)."""
    async with aiohttp.ClientSession(connector=connector(), timeout=aiohttp.ClientTimeout(total=None)) as session:
        await one_stream(session, url, 2)  # the connection and both ends warm
        deadline = time.monotonic() + seconds

        async def client() -> int:
            total = 0
            while time.monotonic() < deadline:
                total += await one_stream(session, url, tokens)
            return total

        cpu = sum(cpu_seconds(pid) for pid in pids)
        started = time.monotonic()
        total = sum(await asyncio.gather(*(client() for _ in range(streams))))
        elapsed = time.monotonic() - started
        return total / elapsed, (sum(cpu_seconds(pid) for pid in pids) - cpu) / total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,32,128", help="comma-separated numbers of concurrent streams")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    parser.add_argument("--token-seconds", type=float, default=0.02, help="the stand-in's pause before each token")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long each measurement keeps streams going")
    parser.add_argument("--hostd", type=Path, metavar="CHECKOUT", help="run hostd's processes from this checkout")
    args = parser.parse_args()
    counts = [int(n) for n in args.streams.split(",")]

    if args.hostd:  # the daemons import hostd from there (python -m puts the cwd first)
        os.environ["PYTHONPATH"] = str(args.hostd.resolve())
        os.chdir(args.hostd)
    root = Path(tempfile.mkdtemp(prefix="hostd-", dir="/tmp"))  # short: socket paths
    port = free_port()
    tree = model_tree(root, port, args.token_seconds)
    rows = []
    try:
        tree.start_weights(timeout=60)
        tree.start_engine(timeout=60)
        tree.start_gateway()
        wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving")
        hostd_pids = [tree.daemons[1].pid, tree.daemons[2].pid]  # engine supervisor, gateway
        upstream = tree.runtime_dir / "vllm-engine.sock"
        for streams in counts:
            for path, connector, url in (
                ("direct", lambda: aiohttp.UnixConnector(path=str(upstream), limit=0), "http://engine/v1/completions"),
                ("hostd", lambda: aiohttp.TCPConnector(limit=0), f"http://127.0.0.1:{port}/v1/completions"),
            ):
                rate, cpu = asyncio.run(load(connector, url, streams, args.tokens, args.seconds, hostd_pids))
                rows.append((streams, path, rate, cpu * 1e6))
                print(f"# {streams} streams, {path}: {rate:.0f} tokens/s, hostd {cpu * 1e6:.1f} CPU µs/token",
                      flush=True)
    finally:
        tree.stop_all()
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nStreamed tokens, stand-in vLLM ({args.tokens} tokens a stream, one every {args.token_seconds} s), "
          f"{args.seconds:.0f} s each; hostd from {args.hostd or 'this checkout'}; {os.cpu_count()} CPUs.\n")
    print("| streams | path | tokens/s | of direct | hostd's CPU µs per token (gateway + engine supervisor) |")
    print("|---|---|---|---|---|")
    direct = {}
    for streams, path, rate, micros in rows:
        direct.setdefault(streams, rate)
        print(f"| {streams} | {path} | {rate:.0f} | {rate / direct[streams]:.0%} | {micros:.1f} |")
    print("\nCommand: python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
