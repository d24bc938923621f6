"""Benchmark: the builtin engine's generation loop in one process, against transformers' own.

Where benchmarks/throughput.py measures through the gateway (HTTP, the
engine's event loop, the weights daemon), this one isolates the model loop:
one process builds the model the way the engine does (a skeleton, the
checkpoint's tensors attached; cuDNN's SDPA off on CUDA, as hostd/engine/main.py
does), then on the same model object and the same prompt token ids times

- ``generate``: transformers' ``model.generate`` (greedy, ``eos_token_id=-1``),
  one request after the other, a streamer stamping each token;
- ``one-request``: hostd's one-request loop (generate.generate_tokens, the
  engine's ``batching: none``), one request after the other;
- ``batched N``: hostd's BatchRunner (batch.py, ``batching: continuous``)
  with N requests at once, driven by asyncio as the engine's loop drives it,
  no HTTP;
- ``generate_batch N``: transformers' ``generate_batch`` on the same N
  prompts (library defaults, ``max_requests_per_batch`` N).

tokens/s = output tokens / wall time; TPOT = (last token - first token) /
(tokens - 1), median over requests. With ``--profile`` one extra batched run
per stream count runs under ``torch.profiler`` and the top operators by self
CPU time are printed (``--profile-rows``), which says whether the host or the
device bounds a step.

    python benchmarks/engine_step.py                                     # CPU, tiny model
    python benchmarks/engine_step.py --device cuda --size 7b --streams 1,16,64 --profile --workdir /tmp/av
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_model(checkpoint: Path, device: torch.device) -> torch.nn.Module:
    from hostd.weights import checkpoint as ckpt

    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # as hostd/engine/main.py
    dtype = ckpt.resolve_dtype(checkpoint, "auto")
    model = ckpt.build_skeleton(checkpoint, dtype, meta_buffers=True)
    disk = ckpt.build_skeleton(checkpoint, dtype, meta_buffers=False)
    ckpt.attach(model, ckpt.load_tensors(checkpoint, disk, device))
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timing:
    def __init__(self, name: str) -> None:
        self.name, self.tokens, self.wall, self.tpot = name, 0, 0.0, []

    def row(self) -> str:
        tps = self.tokens / self.wall if self.wall else 0.0
        tpot = statistics.median(self.tpot) * 1000 if self.tpot else float("nan")
        return f"| {self.name} | {self.tokens} | {self.wall:.2f} | {tps:.1f} | {tpot:.1f} |"


def run_generate(model, prompts, output_tokens, device) -> Timing:
    from transformers.generation.streamers import BaseStreamer

    class Stamp(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.first = True

        def put(self, value) -> None:
            if self.first:  # the prompt
                self.first = False
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    timing = Timing("transformers generate")
    start = time.perf_counter()
    for prompt in prompts:
        stamp = Stamp()
        ids = torch.tensor([prompt], device=device)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_tokens, do_sample=False,
                       eos_token_id=-1, pad_token_id=0, streamer=stamp)
        timing.tokens += len(stamp.times)
        if len(stamp.times) > 1:
            timing.tpot.append((stamp.times[-1] - stamp.times[0]) / (len(stamp.times) - 1))
    timing.wall = time.perf_counter() - start
    return timing


def run_one_request(model, prompts, output_tokens) -> Timing:
    from hostd.engine.generate import SamplingParams, generate_tokens

    timing = Timing("hostd one-request")
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        times = []
        for _ in generate_tokens(model, prompt, params, eos_ids=()):
            times.append(time.perf_counter())
        timing.tokens += len(times)
        if len(times) > 1:
            timing.tpot.append((times[-1] - times[0]) / (len(times) - 1))
    timing.wall = time.perf_counter() - start
    return timing


def run_generate_batch(model, prompts, output_tokens) -> Timing:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    timing = Timing(f"transformers generate_batch {len(prompts)}")
    config = GenerationConfig(max_new_tokens=output_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_requests_per_batch=len(prompts))
    model.generate_batch(inputs=[p[:4] for p in prompts[:2]], generation_config=GenerationConfig(
        max_new_tokens=2, do_sample=False, eos_token_id=-1, pad_token_id=0), continuous_batching_config=cb,
        progress_bar=False)  # warm-up, not timed
    start = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config, continuous_batching_config=cb,
                               progress_bar=False)
    timing.wall = time.perf_counter() - start
    timing.tokens = sum(len(o.generated_tokens) for o in out.values())
    return timing


async def _drive(runner, prompts, output_tokens, stamps, sample) -> None:
    from hostd.engine.generate import SamplingParams

    def params(i):
        if sample:  # temperature, top_p and a seed of each request's own
            return SamplingParams(max_tokens=output_tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
        return SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)

    async def one(i, prompt):
        async for _ in runner.stream(prompt, params(i)):
            stamps[i].append(time.perf_counter())

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run_batched(runner, prompts, output_tokens, label, sample=False) -> Timing:
    timing = Timing(label)
    stamps: list[list[float]] = [[] for _ in prompts]
    start = time.perf_counter()
    asyncio.run(_drive(runner, prompts, output_tokens, stamps, sample))
    timing.wall = time.perf_counter() - start
    for times in stamps:
        timing.tokens += len(times)
        if len(times) > 1:
            timing.tpot.append((times[-1] - times[0]) / (len(times) - 1))
    return timing


def run_variant(args, model, tokenizer, device, n, label, options, prompts, one, rows) -> None:
    """One batched-runner variant at N streams: a row in ROWS (and a profile with --profile)."""
    from hostd.engine.batch import BatchRunner

    runner = None
    kv_mib = int(options.get("kv", args.kv_cache_mib or (4096 if args.device == "cuda" else 64)))
    graphs = None
    if int(options.get("graphs", 0)):
        graphs = {}
        if "q" in options:
            graphs["q_padding_interval_size"] = int(options["q"])
        if "kvpad" in options:
            graphs["kv_padding_interval_size"] = int(options["kvpad"])
    t = time.perf_counter()
    try:
        runner = BatchRunner(model=model, tokenizer=tokenizer, max_num_seqs=max(n, 1),
                             max_model_len=args.prompt_tokens + args.output_tokens + 16,
                             kv_cache_bytes=kv_mib << 20, cuda_graphs=graphs)
        asyncio.run(runner.warm_up())
        print(f"{label}: runner built and warmed up in {time.perf_counter() - t:.2f} s", flush=True)
        batch = prompts(n) if n > 1 else one
        name = f"hostd batched {n} [{label}]"
        sample = bool(int(options.get("sample", 0)))
        if n == 1:
            timing = Timing(name)
            for p in batch:
                part = run_batched(runner, [p], args.output_tokens, "x", sample)
                timing.tokens += part.tokens
                timing.wall += part.wall
                timing.tpot += part.tpot
        else:
            timing = run_batched(runner, batch, args.output_tokens, name, sample)
        rows.append(timing.row())
        print(rows[-1], flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=activities) as prof:
                run_batched(runner, batch[:n], min(args.output_tokens, 24), "profile")
                sync(device)
            print(f"\nprofile, {name} (24 tokens):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
            if device.type == "cuda":
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    except Exception as error:  # a variant that cannot run says why and the others go on
        rows.append(f"| hostd batched {n} [{label}] | failed: {type(error).__name__}: {str(error)[:200]} | | | |")
        print(rows[-1], flush=True)
    finally:
        runner_stop(runner)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, rest = text.partition(":")
    return label, dict(item.split("=", 1) for item in rest.split(",") if item)


def runner_stop(runner) -> None:
    if runner is not None:
        runner.cancel_all()
        runner.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--size", default="tiny", help="hostd make-checkpoint size")
    parser.add_argument("--streams", default="1,16", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=2, help="one-stream rows: requests one after the other")
    parser.add_argument("--kv-cache-mib", type=int, help="the batched runner's KV cache (default 4096 on CUDA, 64 on CPU)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                        help="a batched-runner variant (repeatable; default one, 'eager'): keys kv (MiB), "
                             "graphs (0/1: CUDA graphs), q and kvpad (the graphs' q and kv padding intervals), "
                             "sample (0/1: temperature 0.8, top_p 0.95, a seed per request; else greedy)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--skip", default="", help="comma list of: generate,one-request,generate_batch")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hostd-engine-step"))
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from transformers import AutoTokenizer

    from hostd.checkpoints.random_model import write_checkpoint
    from hostd.engine.batch import BatchRunner

    checkpoint = args.workdir / f"checkpoint-{args.size}"  # as throughput.py: one checkpoint for both
    if not (checkpoint / "config.json").exists():
        write_checkpoint(checkpoint, args.size)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    t = time.perf_counter()
    model = build_model(checkpoint, device)
    print(f"model built and attached in {time.perf_counter() - t:.1f} s; attention: "
          f"{model.config._attn_implementation}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    vocab = model.config.vocab_size
    rng = torch.Generator().manual_seed(0)

    def prompts(n):
        return [torch.randint(10, vocab - 1, (args.prompt_tokens,), generator=rng).tolist() for _ in range(n)]

    rows: list[str] = []
    one = prompts(args.requests)
    with torch.inference_mode():
        if "generate" not in skip:
            run_generate(model, one[:1], 4, device)  # warm-up
            rows.append(run_generate(model, one, args.output_tokens, device).row())
            print(rows[-1], flush=True)
        if "one-request" not in skip:
            rows.append(run_one_request(model, one, args.output_tokens).row())
            print(rows[-1], flush=True)
    variants = [parse_variant(v) for v in args.variant] or [("eager", {})]
    for n in args.streams:
        for label, options in variants:
            run_variant(args, model, tokenizer, device, n, label, options, prompts, one, rows)
        if n > 1 and "generate_batch" not in skip:
            with torch.inference_mode():
                rows.append(run_generate_batch(model, prompts(n), args.output_tokens).row())
            print(rows[-1], flush=True)
        if args.profile and n == 1 and "generate" not in skip:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with torch.inference_mode(), profile(activities=activities) as prof:
                run_generate(model, one[:1], 24, device)
                sync(device)
            print("\nprofile, transformers generate (24 tokens):")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))

    print(f"\n{args.device}, {args.size}, {args.prompt_tokens} prompt tokens, {args.output_tokens} out, greedy")
    print("| loop | tokens | wall s | tokens/s | TPOT ms (median) |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n" + " ".join(["python", *sys.argv]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
