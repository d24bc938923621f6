"""The batched runner (hostd/engine/batch.py) against the one-request path.

In one process, on a tiny random Qwen2 checkpoint: what each request of a
batch gets must be what generate.Runner (a thread per request, Hugging
Face's DynamicCache) gives it alone -- token for token for greedy and for a
seeded sample -- and the runner's limits must hold: max_num_seqs requests at
once, requests beyond the KV budget wait and all finish, a stop string or
max_tokens ends its own request only, a cancelled request frees its slot.
No assertion depends on speed (timeouts are safety nets).

The model runs in float32. In bfloat16 (the checkpoint's dtype) logits have
an 8-bit mantissa, so a random model's top two often round to within one
step of each other, and the batched kernels (other shapes, other summation
orders) then break such near-ties differently: both paths are right, and
which token wins depends on rounding. float32 leaves no such near-ties in
these prompts, so there the pin is exact.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

from hostd.checkpoints.random_model import write_checkpoint
from hostd.engine.batch import BatchRunner
from hostd.engine.generate import Runner, SamplingParams, generate_tokens

SAFETY_TIMEOUT_S = 120

PROMPTS = [
    "Once upon a time there was a model",
    "Hello",
    "The quick brown fox jumps over the lazy dog. A weight cache keeps tensors",
    "Servers drain traffic, reload engines and roll back on failure. Once upon a time",
    "0 1 2 3 4 5",
    "hello hostd",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, SAFETY_TIMEOUT_S))


async def collect(runner, prompt_ids, params):
    text, deltas = "", []
    async with contextlib.aclosing(runner.stream(prompt_ids, params)) as stream:
        async for delta in stream:
            text += delta.text
            deltas.append(delta)
    return text, deltas[-1].completion_tokens, deltas[-1].finish_reason


async def with_runner(make, body):
    runner = make()
    try:
        return await body(runner)
    finally:
        runner.cancel_all()
        await asyncio.to_thread(runner.join)


def batch_runner(tiny, **kw):
    model, tokenizer = tiny
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_model_len", 256)
    kw.setdefault("kv_cache_bytes", 1 << 20)
    return lambda: BatchRunner(model, tokenizer, kw.pop("max_num_seqs"), **kw)


def one_request_path(tiny, params_for):
    """What generate.Runner answers to each prompt, alone."""
    model, tokenizer = tiny

    async def body(runner):
        return [await collect(runner, tokenizer.encode(p), params_for(i)) for i, p in enumerate(PROMPTS)]

    return run(with_runner(lambda: Runner(model, tokenizer, 1), body))


def test_batched_greedy_equals_the_one_request_path_token_for_token(tiny):
    model, tokenizer = tiny
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected_tokens = [list(generate_tokens(model, tokenizer.encode(p), params, eos_ids=())) for p in PROMPTS]
    expected = one_request_path(tiny, lambda i: params)
    seen: list[list[int]] = [[] for _ in PROMPTS]

    async def body(runner):
        original = runner._arrived

        def spy(outputs):  # the token ids the library produced, per request, before decoding
            for output in outputs:
                seen[int(output.request_id.split("-")[1]) - 1] = list(output.generated_tokens)
            original(outputs)

        runner._arrived = spy
        await runner.warm_up()  # request 0: the warm-up's own
        return await asyncio.gather(*(collect(runner, tokenizer.encode(p), params) for p in PROMPTS))

    got = run(with_runner(batch_runner(tiny), body))
    assert seen == expected_tokens
    assert got == expected
    assert all(finish == "length" and n == 48 for _, n, finish in got)


def test_seeded_and_greedy_requests_batched_together_each_get_their_own_answer(tiny):
    def params_for(i):
        if i % 2:
            return SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=32, temperature=0.9, top_p=0.8, seed=1000 + i, ignore_eos=True)

    expected = one_request_path(tiny, params_for)
    model, tokenizer = tiny

    async def body(runner):
        return await asyncio.gather(*(collect(runner, tokenizer.encode(p), params_for(i))
                                      for i, p in enumerate(PROMPTS)))

    assert run(with_runner(batch_runner(tiny), body)) == expected


def test_the_sampler_as_captured_in_a_cuda_graph_gives_the_same_answers(tiny):
    """Under CUDA graphs (engine.enforce_eager false) the sampler runs the
    device path every step, greedy rows included (no host-side shortcut can be
    captured). On CPU that path is forced here: the same mix of seeded and
    greedy requests must get exactly what the one-request path gives each."""
    def params_for(i):
        if i % 3 == 0:
            return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        return SamplingParams(max_tokens=24, temperature=0.7 + 0.1 * i, top_p=0.6 + 0.05 * i, seed=7 * i,
                              ignore_eos=True)

    expected = one_request_path(tiny, params_for)
    model, tokenizer = tiny
    make = batch_runner(tiny)

    def static_runner():
        runner = make()
        runner._manager.logit_processor.static = True
        return runner

    async def body(runner):
        return await asyncio.gather(*(collect(runner, tokenizer.encode(p), params_for(i))
                                      for i, p in enumerate(PROMPTS)))

    assert run(with_runner(static_runner, body)) == expected


def test_stop_strings_and_max_tokens_end_their_own_request_only(tiny):
    model, tokenizer = tiny
    free = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # A stop string from the middle of a completion, of plain characters
    # (random weights also emit bytes that decode to U+FFFD).
    for index, (text, _, _) in enumerate(one_request_path(tiny, lambda i: free)):
        middle = [i for i in range(len(text) // 3, len(text) - 2)
                  if text[i:i + 2].isascii() and text[i:i + 2].strip() and text[i:i + 2].isprintable()]
        if middle:
            alone, stop = text, text[middle[0]:middle[0] + 2]
            break
    else:
        pytest.fail("no completion has two plain characters to stop at")
    stopped = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = tokenizer.encode(PROMPTS[index])

    async def body(runner):
        return await asyncio.gather(collect(runner, prompt, stopped), collect(runner, prompt, short),
                                    collect(runner, prompt, free))

    (text_stop, n_stop, why_stop), (_, n_short, why_short), (text_free, n_free, why_free) = run(
        with_runner(batch_runner(tiny), body))
    assert why_stop == "stop" and text_stop == alone[:alone.index(stop)] and n_stop < 40
    assert why_short == "length" and n_short == 3
    assert why_free == "length" and n_free == 40 and text_free == alone


def test_max_num_seqs_and_the_kv_budget_make_requests_wait_and_lose_none(tiny):
    model, tokenizer = tiny
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    expected = one_request_path(tiny, lambda i: params)
    per_token = 2 * 2 * 2 * 16 * 4  # layers, k and v, kv heads, head_dim, float32
    # Room for two requests of max_model_len, with max_num_seqs=4: the other two wait for blocks.
    make = batch_runner(tiny, max_num_seqs=4, max_model_len=128, kv_cache_bytes=2 * 128 * per_token)
    peaks = {"running": 0, "waiting": 0, "blocks": 0, "waiting_for_kv": 0}

    async def body(runner):
        assert runner.kv_blocks_total == 16  # 2 * 128 tokens in blocks of 16

        async def watch():
            while True:
                peaks["running"] = max(peaks["running"], runner.stats.running)
                peaks["waiting"] = max(peaks["waiting"], runner.stats.waiting)
                peaks["blocks"] = max(peaks["blocks"], runner.kv_blocks_used())
                peaks["waiting_for_kv"] = max(peaks["waiting_for_kv"], runner.waiting_for_kv())
                # Not sleep(0): a loop that never waits keeps the interpreter's lock from the
                # batching thread, whose every step then waits out switch intervals (44-128 s
                # instead of 2 s here; CI hit the 120 s safety net). A request waits for blocks
                # for many steps, so sampling every 2 ms still sees it.
                await asyncio.sleep(0.002)

        watcher = asyncio.ensure_future(watch())
        try:
            return await asyncio.gather(*(collect(runner, tokenizer.encode(p), params) for p in PROMPTS))
        finally:
            watcher.cancel()

    assert run(with_runner(make, body)) == expected  # all six finished, each with its own answer
    assert peaks["running"] == 4 and peaks["waiting"] == 2  # max_num_seqs held; the rest waited
    assert 0 < peaks["blocks"] <= 16
    assert peaks["waiting_for_kv"] >= 1  # and some of those running waited for blocks


def test_a_cancelled_request_frees_its_slot_and_the_next_one_runs(tiny):
    model, tokenizer = tiny
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = tokenizer.encode(PROMPTS[0])

    async def body(runner):
        stream = runner.stream(prompt, long)
        await anext(stream)
        await anext(stream)
        await stream.aclose()  # the client went
        assert runner.stats.running == 0
        text, n, why = await collect(runner, prompt, short)  # one slot: it runs only if the first freed it
        return n, why, runner.stats.generated_tokens

    n, why, generated = run(with_runner(batch_runner(tiny, max_num_seqs=1), body))
    assert (n, why) == (4, "length")
    assert generated < 200


def test_the_transformers_pyproject_admits_has_what_the_batched_runner_replaces():
    """pyproject.toml's builtin extra pins transformers to the minor batch.py is tested with
    (it replaces internals of the continuous-batching manager): whatever pip
    installs within that pin passes the start-up check, and the pin names the
    installed version's minor."""
    import tomllib
    from pathlib import Path

    import transformers
    from packaging.requirements import Requirement

    from hostd.engine.batch import check_supported

    check_supported()
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    [pin] = [Requirement(d) for d in project["project"]["optional-dependencies"]["builtin"]
             if d.startswith("transformers")]
    assert pin.specifier.contains(transformers.__version__), (str(pin), transformers.__version__)
    assert any(spec.operator == "<" for spec in pin.specifier), f"{pin}: no upper bound on internals batch.py replaces"


def test_an_older_transformers_is_refused_at_start_and_at_config_time_saying_what_to_do(monkeypatch, tmp_path):
    """docs/builtin.md's promise (issue 31: on the H200's 5.17 the check passed
    and the engine died mid-start with a TypeError): the version found, the
    one needed and engine.batching: none, from check_supported at start and
    from the backend's config-time refusals the manager and hostctl ask."""
    import json

    import msgspec
    import transformers

    from hostd import backends
    from hostd.config import schema
    from hostd.engine import rules
    from hostd.engine.batch import BatchingUnsupported, check_supported

    check_supported()  # the installed one passes
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(BatchingUnsupported) as refused:
        check_supported()
    said = str(refused.value)
    assert "transformers 5.17.0 is installed" in said and "transformers<5.25,>=5.24" in said, said
    assert "engine.batching: none" in said
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4}))
    monkeypatch.setattr(rules, "installed_transformers", lambda: "5.17.0")  # what the engine unit would import
    cfg = msgspec.convert({"backend": "builtin", "model": str(tmp_path)}, type=schema.BuiltinModel)
    assert backends.for_config(cfg).start_refusals(cfg) == [said]
    none = msgspec.convert({"backend": "builtin", "model": str(tmp_path), "engine": {"batching": "none"}},
                           type=schema.BuiltinModel)
    assert backends.for_config(none).start_refusals(none) == []


@pytest.mark.parametrize("runner_kind", ["one-request", "batched"])
def test_a_completion_that_ends_at_max_tokens_carries_its_last_tokens_text(tiny, runner_kind):
    """Both runners' text is the decode of every token they generated: the
    token at max_tokens included (both dropped its text before issue 32's
    one Completion rule: 'azaz' instead of 'azaz t' for 3 tokens)."""
    model, tokenizer = tiny
    prompt = tokenizer.encode("Hello world")
    for max_tokens in (1, 3, 7):
        make = (lambda: Runner(model, tokenizer, 1)) if runner_kind == "one-request" else batch_runner(tiny)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens = list(generate_tokens(model, prompt, params, eos_ids=()))
        text, count, reason = run(with_runner(make, lambda r: collect(r, prompt, params)))
        assert (count, reason) == (max_tokens, "length")
        assert text == tokenizer.decode(tokens, skip_special_tokens=True), (max_tokens, text, tokens)


def test_an_idle_runner_needs_one_block_not_one_request_of_max_model_len(tiny):
    """The warm standby's idle runner (standby_kv.py) serves its warm-up only:
    one KV block does; a runner that serves requests keeps the max_model_len rule."""
    from hostd import kv_bytes
    from hostd.engine import budget

    model, _ = tiny
    block = kv_bytes.bytes_per_token(model.config.to_dict(), "float32") * budget.PAGE_SIZE["cpu"]
    with pytest.raises(ValueError, match="max_model_len=256"):
        batch_runner(tiny, kv_cache_bytes=block)()
    with pytest.raises(ValueError, match="reload.standby_kv_mib"):
        batch_runner(tiny, kv_cache_bytes=block - 1, idle=True)()

    async def body(runner):
        await runner.warm_up()
        return runner.kv_blocks_total

    assert run(with_runner(batch_runner(tiny, kv_cache_bytes=block, idle=True), body)) == 1


def test_a_stopped_runner_is_freed_without_a_garbage_collection(tiny):
    """standby_kv.py frees a swapped-out runner (and its KV cache) right when
    a request may arrive: with no reference cycle through the runner its last
    reference frees it, and return_freed_memory skips the full collection
    (0.3-0.8 s of the interpreter's lock with torch loaded). Nor does the
    library collect when the runner stops (batch.py's _quiet_collections)."""
    import gc

    from transformers.generation.continuous_batching import continuous_api

    from hostd.engine import standby_kv

    runner = batch_runner(tiny)()
    run(collect(runner, tiny[1].encode("Hello"), SamplingParams(max_tokens=4, temperature=0.8, seed=1)))
    runner.cancel_all()
    collections = []
    real = gc.collect
    try:
        gc.collect = lambda *a: collections.append(a) or 0
        assert continuous_api.gc.collect() == 0 and collections == []  # the library's gc.collect is a no-op
        runner.join()  # the library's stop, then its batch processor freed: no collection
        assert collections == []
    finally:
        gc.collect = real
    refs = standby_kv.references(runner)
    assert len(refs) == 2  # the runner and its KV cache
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del runner
        assert all(ref() is None for ref in refs)
    finally:
        if was_enabled:
            gc.enable()
    try:
        gc.collect = lambda *a: collections.append(a) or 0
        standby_kv.return_freed_memory(refs)
        assert collections == []  # freed already: no collection
        standby_kv.return_freed_memory(None)
        assert len(collections) == 1  # unknown: collect
    finally:
        gc.collect = real
