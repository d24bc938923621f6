"""Generate every admitted request in one batched loop over a paged KV cache.

One job: the builtin engine's default runner (``engine.batching: continuous``).
It has generate.Runner's interface (``stream``, ``stats``, ``cancel_all``,
``join``) and its admission (at most ``max_num_seqs`` requests hold a slot,
the rest wait in arrival order), but instead of one worker thread per request
it hands every admitted request to transformers' continuous batching
(``transformers.generation.continuous_batching.ContinuousBatchingManager``):
one background thread runs the model once per step for all of them, prefill
and decode batched together, each request's keys and values in blocks of one
preallocated paged cache of ``kv_cache_bytes`` (hostd/engine/budget.py).

What hostd adds to the library, and why:

- **Per-request sampling** (``_Sampling``). The library samples one way for
  the whole batch (greedy or not, one global seed). hostd's requests each
  choose: greedy at temperature 0, else temperature, top_p and a seed of their
  own. ``_Sampling`` is the manager's logits-processor list: each step it
  writes every row's temperature, top_p and one uniform draw from the
  request's own generator into the library's argument rows, and picks the
  tokens on the device with generate.choose_tokens -- the very function of
  the one-request path -- handing the library a score row whose only finite
  entry is that token, so the library's argmax takes it. Greedy output
  therefore equals generate.Runner's token for token (the tests pin it), a
  seeded request repeats itself whatever it was batched with, and nothing in
  a step reads the device from the host, so the step can be a CUDA graph.
- **CUDA graphs** (``CUDA_GRAPHS``, engine.enforce_eager false on CUDA): the
  library's use_cuda_graph with padding intervals chosen here. A runner the
  engine starts with captures the largest step's graph before it serves
  (the library's warm-up: the graph pool is sized once); a runner rebuilt in
  place beside a serving one (``precapture`` false, server.py) does not: that
  capture took 0.74 s of a 7B rebuild's 0.76 s on the H200 (2026-12-04),
  and every other shape is captured at first use either way (about 0.2 s
  each, the first time it is seen).
- **Delivery to asyncio** (``_Router``). Each step's outputs reach the event
  loop in one ``call_soon_threadsafe``; outputs for a request that has gone
  (cancelled, stopped by a stop string) are dropped rather than queued
  forever.
- **Stop strings and cancellation** stay the application's: TextDecoder finds
  a stop string on the loop, and the request is cancelled in the library
  (``cancel_request``), which frees its blocks at its next step.
- **No collections when a runner stops** (``_quiet_collections``). The
  library runs ``gc.collect()`` when its manager stops and again when its
  batch processor is freed: two full collections per runner, each holding
  the interpreter's lock for 0.24 s in a process with a 7B model loaded (the
  H200, 2026-12-03). A runner that stops while another one starts in the
  same process (a warm standby's grow or rebuild, standby_kv.py, server.py)
  stalled the new one's warm-up and first requests (a grow's warm-up 0.47 s
  instead of 0.06). hostd frees a stopped runner itself
  (standby_kv.return_freed_memory: a collection only where a reference
  cycle still holds it, then the device's cache).

What it relies on in transformers (5.24, where it is tested): the manager's
``logit_processor`` and ``output_router`` attributes, replaced before its
batch processor exists; ``ContinuousBatchingLogitsProcessorList``'s
``fill_defaults`` / ``prepare_tensor_args`` / ``__call__`` protocol and its
``tensors_required`` argument rows; ``batch_processor.cache``
(num_blocks, compute_free_capacity) and ``.scheduler.waiting_requests`` for
the metrics. ``check_supported`` refuses, at start, a transformers without
them, saying to set ``engine.batching: none``. It also replaces
``continuous_api``'s module-level ``gc`` (``_quiet_collections``); a
transformers without it would only collect again (slower, not wrong), so
that is not refused.

Not done here (docs/builtin.md): torch.compile, prefix caching, async
double-buffering, speculative decoding.

Trust: as generate.py -- inputs validated by app.py, model and tokenizer from
the process that built them.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from hostd import kv_bytes
from hostd.engine import rules
from hostd.engine.budget import PAGE_SIZE
from hostd.engine.generate import (
    Completion,
    Delta,
    GenerationCancelled,
    Runner,
    SamplingParams,
    eos_token_ids,
    choose_tokens,
    draw,
    model_device,
    request_generator,
)

log = logging.getLogger("hostd.engine")

# Tokens one step may carry (prefill chunks plus one per decoding request):
# vLLM's max_num_batched_tokens. Bounds the activations of a step; a longer
# prompt is prefilled in chunks.
MAX_BATCH_TOKENS = {"cpu": 512, "cuda": 2048}


# CUDA graphs (engine.enforce_eager false): each step is padded to a whole
# number of 16 query tokens and 256 cached tokens (one page) and replayed from
# the graph captured for that shape, the first time it is seen. Measured on
# the H200 with a 7B model (docs/benchmarks.md, benchmarks/engine_step.py):
# one stream 9-10 ms a token against 31-43 ms eager; the library's own
# intervals (64 and 16384 tokens) pad the masked SDPA attention to 16384 keys
# a step and reached only 25 ms.
CUDA_GRAPHS = {"q_padding_interval_size": 16, "kv_padding_interval_size": 256}


class BatchingUnsupported(RuntimeError):
    """This transformers lacks what the batched runner relies on (module docstring)."""


def check_supported() -> None:
    """Raise BatchingUnsupported, saying what to do, when transformers lacks what this runner uses:
    a version outside the tested range (engine/rules.py, the same words as `hostctl config --check`),
    or one whose continuous batching lacks what is replaced here."""
    import transformers

    problem = rules.transformers_problem(transformers.__version__)
    if problem:
        raise BatchingUnsupported(problem)
    try:
        from transformers.generation.continuous_batching import cb_logits_processors, continuous_api
    except ImportError as error:
        problem = f"transformers.generation.continuous_batching cannot be imported ({error})"
    else:
        base = getattr(cb_logits_processors, "ContinuousBatchingLogitsProcessor", None)
        manager = getattr(continuous_api, "ContinuousBatchingManager", None)
        if base is None or manager is None or not hasattr(continuous_api, "OutputRouter"):
            problem = "its continuous batching lacks ContinuousBatchingLogitsProcessor or OutputRouter"
        elif not hasattr(base, "prepare_tensor_args") or "supported_kwargs" not in base.__annotations__:
            problem = "its continuous-batching logits processors have another protocol"
    if problem:
        raise BatchingUnsupported(
            f"transformers {transformers.__version__}: {problem}; the batched engine is tested with "
            "transformers 5.24. Install that version, or set engine.batching: none in the model's config "
            "to serve with one worker thread per request."
        )


class _NoCollection:
    """continuous_api's ``gc`` while hostd runs it (``_quiet_collections``): collect() does nothing."""

    @staticmethod
    def collect(generation: int = 2) -> int:
        return 0


def _quiet_collections() -> None:
    """The library's collections on a runner's stop (module docstring), made no-ops. Idempotent."""
    from transformers.generation.continuous_batching import continuous_api

    continuous_api.gc = _NoCollection


def _sampling_class():
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessorList,
    )
    from transformers.generation.logits_process import LogitsProcessorList

    class _Sampling(ContinuousBatchingLogitsProcessorList):
        """Picks each row's token as the one-request path would (module docstring).

        Three argument rows per step, float32 stored in the library's int32
        rows: each request's temperature, top_p and this token's uniform
        draw (-1: greedy), filled on the host from the request's parameters
        and generator (``samplers``: its hostd_seq -> (params, generator);
        written on the event loop, read on the generation thread, single dict
        operations). ``__call__`` is generate.choose_tokens on the device with
        no host read, so it can run inside a captured CUDA graph (``static``:
        then it always runs; otherwise an all-greedy step returns the scores
        as they are, and the library's argmax is generate.pick_token's)."""

        def __init__(self, samplers: dict, static: bool) -> None:
            super().__init__(LogitsProcessorList())
            self.samplers = samplers
            self.static = static
            self.tensors_required = 3
            self.do_processing = True
            self.supported_keys = {"hostd_seq": int}
            self.ignored_keys = set()
            self._any_sampled = False

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            greedy = torch.tensor([[1.0], [1.0], [-1.0]], dtype=torch.float32).view(torch.int32)
            int32_tensor.copy_(greedy.to(int32_tensor.device).expand_as(int32_tensor))

        def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
            values = []
            for request in requests_in_batch:
                if not request.has_new_token:
                    continue  # as the library: arguments for the rows that get a token
                entry = self.samplers.get(request.state.logit_processor_kwargs.get("hostd_seq", -1))
                if entry is None or entry[0].temperature == 0:
                    values.append((1.0, 1.0, -1.0))  # greedy, or a request gone: picked greedily, then dropped
                else:
                    params, generator = entry
                    values.append((params.temperature, params.top_p, draw(params, generator)))
            self._any_sampled = any(v[2] >= 0 for v in values)
            if values:
                rows = torch.tensor(values, dtype=torch.float32).t().contiguous().view(torch.int32)
                arg_storage[:3, : len(values)] = rows.to(arg_storage.device)
            return arg_storage

        def __call__(self, input_ids, scores: torch.Tensor, arguments: torch.Tensor) -> torch.Tensor:
            if not self.static and not self._any_sampled:
                return scores
            rows = scores.size(0)
            values = arguments[:3, :rows].contiguous().view(torch.float32)
            tokens = choose_tokens(scores, values[0], values[1], values[2])
            chosen = torch.full_like(scores, -math.inf)
            return chosen.scatter_(1, tokens.unsqueeze(1), 0.0)

    return _Sampling


def _router_class():
    from transformers.generation.continuous_batching.continuous_api import OutputRouter

    class _Router(OutputRouter):
        """Hands each step's outputs to the event loop in one call; BatchRunner drops those of requests gone.

        It holds its runner weakly: runner -> manager -> router -> runner
        would be a reference cycle, which only a full garbage collection
        frees, and that takes 0.3-0.8 s of the interpreter's lock in a
        process holding torch and transformers (standby_kv.py frees a
        swapped-out runner right when a request arrives)."""

        def __init__(self, runner: "BatchRunner") -> None:
            super().__init__()
            self._runner = weakref.ref(runner)

        def deliver(self, output) -> None:
            self.deliver_batch([output])

        def deliver_batch(self, outputs) -> None:
            runner = self._runner()
            loop = runner._loop if runner is not None else None
            if loop is None:
                return  # nothing was ever streamed (only the warm-up's outputs, read nowhere), or the runner is gone
            try:
                loop.call_soon_threadsafe(runner._arrived, list(outputs))
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass

    return _Router


@dataclass
class _Request:
    """One request handed to the library, as the loop sees it."""

    queue: asyncio.Queue
    seen: int = 0  # generated tokens already queued


class _Cancelled:
    """Queued to a request by cancel_all."""


@dataclass
class _Failed:
    error: str


@dataclass
class BatchRunner(Runner):
    """generate.Runner's interface over one continuous-batching loop (module docstring).

    ``max_model_len`` and ``kv_cache_bytes`` size the paged cache: at least
    one request of ``max_model_len`` tokens must fit, else ValueError at
    construction, naming the numbers. ``idle`` says the runner serves no
    request (the warm standby's idle runner, standby_kv.py: its warm-up and
    /health only), so one KV block is enough. Construct it on any thread;
    stream from one event loop.
    """

    max_model_len: int = 2048
    kv_cache_bytes: int = 0
    idle: bool = False
    # CUDA only: capture each step shape's model forward and sampling in a
    # CUDA graph (transformers' use_cuda_graph), with these
    # ContinuousBatchingConfig overrides (q/kv padding intervals); None: eager.
    cuda_graphs: dict | None = None
    # Capture the largest step's graph now (module docstring); False: its
    # first use captures it, like every other shape's.
    precapture: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        check_supported()
        _quiet_collections()
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

        self.model.eval()
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        device = model_device(self.model)
        kind = "cuda" if device.type == "cuda" else "cpu"
        config = self.model.config.get_text_config()
        page = PAGE_SIZE[kind]
        # budget.py's arithmetic, on the built model's config and dtype (the manager's preflight uses the same)
        per_token = kv_bytes.bytes_per_token(config.to_dict(), str(self.model.dtype).removeprefix("torch."))
        self.kv_bytes_per_token = per_token
        num_blocks = self.kv_cache_bytes // (per_token * page)
        if self.idle:
            problem = None if num_blocks >= 1 else (
                f"reload.standby_kv_mib: the standby's idle KV budget of {self.kv_cache_bytes} bytes holds no block "
                f"of {page} tokens ({per_token * page} bytes); raise reload.standby_kv_mib to at least "
                f"{(per_token * page + (1 << 20) - 1) >> 20}")
        else:
            problem = rules.kv_problem(kv_cache_bytes=self.kv_cache_bytes, per_token=per_token,
                                       max_model_len=self.max_model_len, device=kind)
        if problem:  # the engine's start checked it from the config (rules.py); this is the built model's word
            raise ValueError(problem)
        graphs = dict(self.cuda_graphs) if self.cuda_graphs is not None and kind == "cuda" else None
        cb_config = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=num_blocks,
            max_batch_tokens=max(MAX_BATCH_TOKENS[kind], self.max_num_seqs),
            max_requests_per_batch=self.max_num_seqs,
            max_blocks_per_request=0,  # no flash decode fast path: it needs flash_attn_with_kvcache
            allow_block_sharing=False,  # no prefix caching: blocks used = blocks the requests hold
            use_async_batching=False,
            use_cuda_graph=graphs is not None,
            auto_switch_to_flash=kind == "cuda",
            max_memory_percent=1.0,  # the budget is ours (kv_cache_bytes), not a share of what is free
            scheduler_type="fifo",
            **(graphs or {}),
        )
        generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=self.max_model_len)
        self._samplers: dict[int, tuple[SamplingParams, torch.Generator | None]] = {}
        self._requests: dict[str, _Request] = {}
        self._seq = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._cancels: set = set()  # Runner's; unused here
        self._device = device
        manager = ContinuousBatchingManager(self.model, generation, cb_config)
        manager.logit_processor = _sampling_class()(self._samplers, static=graphs is not None)
        manager.output_router = _router_class()(self)
        create = getattr(manager, "_create_batch_processor", None)
        if self.precapture or graphs is None or create is None:
            manager.warmup()  # builds the batch processor and allocates the cache now, so that errors stop the start
        else:  # the same, without the largest step's capture (module docstring)
            manager.batch_processor = create()
        self.cache = manager.batch_processor.cache
        if device.type == "cpu":
            # Touch every page of the cache now: RssAnon then counts all of it,
            # which is what the overlap preflight reads on CPU (hostd/memory.py).
            self.cache.cache_tensor.fill_(0)
        self.kv_blocks_total = int(self.cache.num_blocks)
        self.page_size = page
        self._manager = manager
        manager.start()
        log.info("continuous batching: %d KV blocks of %d tokens (%d bytes), max_num_seqs=%d, %d tokens per step",
                 self.kv_blocks_total, page, self.kv_cache_bytes, self.max_num_seqs, cb_config.max_batch_tokens)

    # --- what /health and /metrics read (on the loop thread) -----------------

    def kv_blocks_used(self) -> int:
        try:
            free = float(self.cache.compute_free_capacity(relative=True))
        except Exception:  # a library that changed under us: report none rather than fail a scrape
            return 0
        return max(0, min(self.kv_blocks_total, round((1.0 - free) * self.kv_blocks_total)))

    def waiting_for_kv(self) -> int:
        """Requests holding a slot that the library has not scheduled yet (no room in the cache)."""
        processor = getattr(self._manager, "batch_processor", None)
        scheduler = getattr(processor, "scheduler", None)
        try:
            return len(scheduler.waiting_requests) if scheduler is not None else 0
        except Exception:
            return 0

    # --- delivery (on the loop thread) ----------------------------------------

    def _arrived(self, outputs: list) -> None:
        for output in outputs:
            request = self._requests.get(output.request_id)
            if request is None:
                continue  # cancelled or ended: dropped
            if output.error is not None:
                request.queue.put_nowait(_Failed(str(output.error)))
                continue
            tokens = output.generated_tokens
            for token in tokens[request.seen:]:
                if token >= 0:  # the library's placeholder for a token not yet read back is -1
                    request.queue.put_nowait(int(token))
                    self.stats.generated_tokens += 1
                    request.seen += 1
            self.stats.note_tokens()

    # --- generation --------------------------------------------------------------

    async def warm_up(self) -> None:
        """One short greedy generation through the batched loop, so that lazy set-up is not paid by a request."""
        prompt = self.tokenizer.encode("Hello", add_special_tokens=True) or [0]
        async for _ in self.stream(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                   count=False):
            pass

    async def stream(self, prompt_ids: list[int], params: SamplingParams, *, count: bool = True
                     ) -> AsyncIterator[Delta]:
        """As generate.Runner.stream: wait for a slot, then one Delta per token; the last has finish_reason.

        Closing the iterator or cancelling the task cancels the request in the
        library and frees the slot at once (the library frees its KV blocks at
        its next step)."""
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: the model needs at least one token to continue")
        await self._acquire()
        self._loop = asyncio.get_running_loop()
        seq = next(self._seq)
        request_id = f"hostd-{seq}"
        generator = request_generator(params)
        request = _Request(asyncio.Queue())
        self._requests[request_id] = request
        self._samplers[seq] = (params, generator)
        eos_ids = frozenset() if params.ignore_eos else self.eos_ids
        finished = False
        try:
            if count:
                self.stats.prompt_tokens += len(prompt_ids)
            added = self._manager.add_request(
                list(prompt_ids), request_id=request_id, max_new_tokens=params.max_tokens, streaming=True,
                eos_token_id=sorted(eos_ids) if eos_ids else -1, hostd_seq=seq,
            )
            if added is None:
                raise GenerationCancelled("the batching loop refused the request: it is stopping")
            completion = Completion(self.tokenizer, prompt_ids, params, self.eos_ids)
            while True:
                item = await request.queue.get()
                if isinstance(item, _Failed):
                    finished = True
                    raise RuntimeError(f"the batching loop failed this request: {item.error}")
                if isinstance(item, _Cancelled):
                    finished = True  # the library was told already
                    raise GenerationCancelled("the engine stopped this generation while shutting down")
                delta = completion.add(item)
                finished = completion.generator_done  # a stop string: the library is told in finally
                yield delta
                if delta.finish_reason:
                    return
        finally:
            self._requests.pop(request_id, None)
            self._samplers.pop(seq, None)
            if not finished:
                self._manager.cancel_request(request_id)
            self._release()

    # --- shutdown ------------------------------------------------------------------

    def cancel_all(self) -> None:
        """Stop every generation and refuse new ones (shutdown). On the loop thread."""
        self._closed = True
        for request_id, request in list(self._requests.items()):
            self._manager.cancel_request(request_id)
            request.queue.put_nowait(_Cancelled())
        self._refuse_waiting()

    def join(self) -> None:
        """Stop the batching loop's thread (after cancel_all: within one step). Blocking."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=60)
