"""Generate the tokens of one request on a Hugging Face causal LM.

One job: given a built model that already holds its weights (on CPU or CUDA),
a prompt as token ids and the sampling parameters, produce the completion token
by token, with the model's KV cache, and turn it into text. Nothing here knows
about HTTP; the application (app.py) decides what to admit and how to answer.

Three layers, each usable alone:

- ``generate_tokens`` is the blocking loop for one request: prefill, then one
  decode step per token, greedy at temperature 0 and sampled otherwise, until
  an end-of-sequence token, ``max_tokens`` or cancellation (checked between
  steps). It runs in a worker thread, never on the event loop.
- ``TextDecoder`` turns those ids into text incrementally and applies stop
  strings, holding back text that may still turn into a stop string or that
  ends inside a multi-byte character.
- ``Runner`` runs at most ``max_num_seqs`` generations at once, each in its own
  worker thread, admits the rest in arrival order, and hands the results to
  asyncio code as an async iterator. A request's slot is freed when its worker
  thread has stopped, so "running" counts model work, not open connections.

The tokenizer given to ``Runner`` is only ever used on the event loop thread
(decoding here in ``Runner.stream``): Hugging Face fast tokenizers are not
safe to use from several threads at once. Prompt encoding and chat templates
(app.py's ``Engine.prompt_ids`` and ``chat_prompt_ids``) run on a
preparation thread with a copy of their own.

Trust: the inputs come from the application (app.py), which has already
validated them (openai_api.py's types); the model and tokenizer come from
the process that built them.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

# Prompt tokens decoded together with the first completion tokens, so that
# tokenizers which change a token's text by its left neighbour (SentencePiece's
# leading space) decode the completion as they would inside the whole text.
_DECODE_CONTEXT_TOKENS = 5

# tokens_per_second (/metrics, /health): the rate over this many recent seconds,
# from samples taken at most this often.
THROUGHPUT_WINDOW_S = 10.0
THROUGHPUT_SAMPLE_S = 0.5


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: already validated by the caller."""

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (benchmarks, tests)


@dataclass(frozen=True)
class Delta:
    """What one step of a stream adds: new text, tokens so far, and, last, why it ended."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None  # "stop" | "length" on the last delta


class GenerationCancelled(Exception):
    """The runner was told to stop all work (shutdown) before this generation ended."""


def eos_token_ids(model: torch.nn.Module, tokenizer) -> frozenset[int]:
    """Every token id that ends a sequence: generation config, model config, tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward() keyword for the KV cache: ``cache`` in transformers >= 5.x, else ``past_key_values``."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _new_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def choose_tokens(scores: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  draws: torch.Tensor) -> torch.Tensor:
    """The next token of each row of SCORES [rows, vocab], on the scores' device
    with no host synchronisation (batch.py runs it inside a captured CUDA graph).

    Row i is greedy (argmax of its scores) where DRAWS[i] < 0, else sampled
    from softmax(scores / TEMPERATURE[i]) restricted to the smallest set of
    tokens whose mass reaches TOP_P[i] (the most likely always stays; no
    restriction at 1.0), by inverse transform: the first token whose
    cumulative probability, in vocabulary order, exceeds DRAWS[i] times the
    kept mass. DRAWS are uniform in [0, 1) from the request's own generator,
    one per token, so a seeded request repeats itself whatever it is batched
    with and whichever runner serves it (pick_token is this on one row)."""
    greedy = draws < 0
    logits = scores.float()
    safe_t = torch.where(greedy | (temperature <= 0), torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / safe_t.unsqueeze(1), dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    # Outside the nucleus: the mass before a token already reaches top_p.
    outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= top_p.unsqueeze(1)
    outside &= (top_p < 1.0).unsqueeze(1)
    kept = probs.scatter(1, order, sorted_probs.masked_fill(outside, 0.0))
    cumulative = torch.cumsum(kept, dim=-1)
    target = draws.clamp(min=0.0).unsqueeze(1) * cumulative[:, -1:]
    sampled = torch.searchsorted(cumulative, target, right=True).squeeze(1)
    sampled = sampled.clamp(max=scores.size(-1) - 1)  # a draw at the kept mass's rounding edge
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def draw(params: SamplingParams, generator: torch.Generator | None) -> float:
    """This token's uniform draw for choose_tokens: -1.0 (greedy) at temperature 0."""
    if params.temperature == 0 or generator is None:
        return -1.0
    return float(torch.rand((), generator=generator))


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Choose the next token from the last position's logits: choose_tokens on one row."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    device = logits.device
    token = choose_tokens(logits.reshape(1, -1),
                          torch.tensor([params.temperature], dtype=torch.float32, device=device),
                          torch.tensor([params.top_p], dtype=torch.float32, device=device),
                          torch.tensor([draw(params, generator)], dtype=torch.float32, device=device))
    return int(token[0])


def generate_tokens(
    model: torch.nn.Module,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    eos_ids: Iterable[int],
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """Yield the completion's token ids one by one. Blocking: call it from a worker thread.

    Stops after an end-of-sequence token (which is yielded; not with
    ``params.ignore_eos``), after ``params.max_tokens`` tokens, or before the
    next model step once ``cancel`` is set. Each step runs under ``torch.inference_mode()``.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: the model needs at least one token to continue")
    eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
    device = model_device(model)
    cache_keyword = _cache_keyword(model)
    generator = request_generator(params)
    cache = _new_cache(model)
    inputs = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    for _ in range(params.max_tokens):
        if cancel is not None and cancel.is_set():
            return
        with torch.inference_mode():
            output = model(input_ids=inputs, use_cache=True, logits_to_keep=1, **{cache_keyword: cache})
            token = pick_token(output.logits[0, -1], params, generator)
        yield token
        if token in eos:
            return
        inputs = torch.tensor([[token]], dtype=torch.long, device=device)


def warm_up(model: torch.nn.Module, tokenizer) -> None:
    """Run one short greedy generation, so that lazy initialisation is not paid by a request."""
    prompt = tokenizer.encode("Hello", add_special_tokens=True) or [0]
    for _ in generate_tokens(model, prompt, SamplingParams(max_tokens=2, temperature=0.0), eos_ids=()):
        pass


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's own random generator (both runners): None when greedy,
    else seeded by params.seed, or at random without one. On the host
    whatever the model's device: it gives one uniform draw per token
    (``draw``), which the sampler reads as a number, not a device tensor."""
    if params.temperature == 0:
        return None
    generator = torch.Generator(device="cpu")
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


class Completion:
    """The token -> Delta rule of both runners (generate.Runner, batch.BatchRunner):
    each token's text through TextDecoder, and when the completion ends.

    ``add(token)`` returns the Delta that TOKEN adds; its finish_reason is set
    when the completion ends there: "stop" at an end-of-sequence token (not
    with ignore_eos; the token counts, its text is none) or a stop string,
    "length" at max_tokens, whose Delta carries that token's text and all
    held back. ``generator_done`` is then whether the model's loop ended the
    sequence too (eos, max_tokens), or must be told to (a stop string).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams, eos_ids: Iterable[int]) -> None:
        self.decoder = TextDecoder(tokenizer, prompt_ids, params.stop)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.max_tokens = params.max_tokens
        self.tokens = 0
        self.generator_done = False

    def add(self, token: int) -> Delta:
        self.tokens += 1
        if token in self.eos:
            self.generator_done = True
            return Delta(self.decoder.flush(), self.tokens, "stop")
        text, stopped = self.decoder.add(token)
        if stopped:
            return Delta(text, self.tokens, "stop")
        if self.tokens >= self.max_tokens:
            self.generator_done = True
            return Delta(text + self.decoder.flush(), self.tokens, "length")
        return Delta(text, self.tokens)


class TextDecoder:
    """Turns completion token ids into text deltas and applies stop strings.

    ``add(token_id)`` returns the text that is now safe to show and whether a
    stop string was reached (the stop string itself is never shown, as in the
    OpenAI API). Text is held back while it ends inside a multi-byte character
    or while its end could still become a stop string. ``flush()`` returns what
    was held back once the completion has ended for another reason.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: Iterable[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._ids = list(prompt_ids[-_DECODE_CONTEXT_TOKENS:])
        self._prefix = 0  # ids[prefix:read] decodes to text already in self._text
        self._read = len(self._ids)
        self._text = ""  # the completion's text so far
        self._shown = 0  # characters of self._text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._text += after[len(before):]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False), self.stopped

    def flush(self) -> str:
        """The held-back text, once no more tokens will come."""
        if self.stopped:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before):
            self._text += after[len(before):]
            self._prefix = self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        # A stop string cannot start before self._shown: text that could begin
        # one is held back until it either completes the stop string or cannot.
        found = [i for i in (self._text.find(s, self._shown) for s in self._stop) if i >= 0]
        if found:
            end = min(found)
            self.stopped = True
        elif final:
            end = len(self._text)
        else:
            end = len(self._text) - self._held_back()
        out = self._text[self._shown:end]
        self._shown = max(self._shown, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest unshown suffix that is a proper prefix of a stop string."""
        pending = self._text[self._shown:]
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class _Done:
    """Sentinel a worker thread queues when its loop has ended."""


@dataclass
class _Failed:
    error: BaseException


@dataclass
class RunnerStats:
    """Counters app.py exports (/metrics, /health); only touched on the event loop thread."""

    running: int = 0  # generations holding a slot (their worker thread has not ended)
    waiting: int = 0  # generations admitted by the application, waiting for a slot
    running_max: int = 0  # high-water marks since start
    waiting_max: int = 0
    prompt_tokens: int = 0  # prompt tokens of generations that got a slot
    generated_tokens: int = 0  # tokens the model produced, shown to a client or not
    # (monotonic time, generated_tokens) at most every THROUGHPUT_SAMPLE_S, for tokens_per_second
    _samples: collections.deque = field(default_factory=collections.deque, repr=False)

    def note_tokens(self, now: float | None = None) -> None:
        """Remember generated_tokens now (called as tokens arrive), for tokens_per_second."""
        now = time.monotonic() if now is None else now
        samples = self._samples
        if samples and now - samples[-1][0] < THROUGHPUT_SAMPLE_S:
            samples[-1] = (samples[-1][0], self.generated_tokens)
            return
        samples.append((now, self.generated_tokens))
        # Keep one sample from before the window: the count the window starts from.
        while len(samples) > 2 and now - samples[1][0] > THROUGHPUT_WINDOW_S:
            samples.popleft()

    def tokens_per_second(self, now: float | None = None) -> float:
        """Tokens generated per second over the last THROUGHPUT_WINDOW_S (0 when none came in it)."""
        now = time.monotonic() if now is None else now
        inside = [(t, n) for t, n in self._samples if now - t <= THROUGHPUT_WINDOW_S]
        before = [n for t, n in self._samples if now - t > THROUGHPUT_WINDOW_S]
        if not inside:
            return 0.0
        if before:
            return (self.generated_tokens - before[-1]) / THROUGHPUT_WINDOW_S
        start = inside[0][0] - THROUGHPUT_SAMPLE_S  # the first sample already counts up to half a second of tokens
        return self.generated_tokens / max(now - start, THROUGHPUT_SAMPLE_S)


@dataclass
class Runner:
    """Runs generations in worker threads: at most ``max_num_seqs`` at once, the rest wait in FIFO order.

    Create it anywhere; use ``stream`` from one event loop. ``on_change`` is
    called on that loop whenever ``stats.running`` or ``stats.waiting`` changes.
    """

    model: torch.nn.Module
    tokenizer: object
    max_num_seqs: int
    on_change: Callable[[], None] | None = None
    stats: RunnerStats = field(default_factory=RunnerStats)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        self.model.eval()
        self.eos_ids = eos_token_ids(self.model, self.tokenizer)
        self._pool = ThreadPoolExecutor(max_workers=self.max_num_seqs, thread_name_prefix="hostd-generate")
        self._waiters: collections.deque[asyncio.Future] = collections.deque()
        self._cancels: set[threading.Event] = set()
        self._closed = False

    # --- slots -----------------------------------------------------------

    def _changed(self) -> None:
        s = self.stats
        s.waiting = len(self._waiters)
        s.running_max = max(s.running_max, s.running)
        s.waiting_max = max(s.waiting_max, s.waiting)
        if self.on_change is not None:
            self.on_change()

    async def _acquire(self) -> None:
        if self._closed:
            raise GenerationCancelled("the engine is shutting down")
        if self.stats.running < self.max_num_seqs and not self._waiters:
            self.stats.running += 1
            self._changed()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._changed()
        try:
            await waiter  # _release hands its slot over: running is already counted
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release()  # granted while being cancelled: pass the slot on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        finally:
            self._changed()

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                self._changed()
                return
        self.stats.running -= 1
        self._changed()

    # --- generation --------------------------------------------------------

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """Wait for a slot, then yield one Delta per completion token; the last has finish_reason.

        Close the iterator (``contextlib.aclosing``) or cancel the task to stop
        the generation early: the worker thread stops before its next model
        step and frees the slot, and the iterator ends only after that. Raises
        GenerationCancelled after ``cancel_all``.
        """
        await self._acquire()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        stats = self.stats

        def arrived(item) -> None:  # on the loop thread
            if isinstance(item, int):
                stats.generated_tokens += 1
                stats.note_tokens()
            queue.put_nowait(item)

        def put(item) -> None:  # on the worker thread
            try:
                loop.call_soon_threadsafe(arrived, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancel.set()

        def work() -> None:
            try:
                for token in generate_tokens(self.model, prompt_ids, params, eos_ids=self.eos_ids, cancel=cancel):
                    put(token)
            except BaseException as error:  # reported to the consumer, which logs it
                put(_Failed(error))
            else:
                put(_Done())

        def finished(_future) -> None:
            self._cancels.discard(cancel)
            self._release()

        self._cancels.add(cancel)
        stats.prompt_tokens += len(prompt_ids)
        try:
            worker = loop.run_in_executor(self._pool, work)
        except BaseException:
            finished(None)
            raise
        worker.add_done_callback(finished)

        completion = Completion(self.tokenizer, prompt_ids, params, self.eos_ids)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Failed):
                    raise item.error
                if isinstance(item, _Done):
                    raise GenerationCancelled("the engine stopped this generation while shutting down")
                delta = completion.add(item)
                yield delta
                if delta.finish_reason:
                    return
        finally:
            cancel.set()
            # End only once the worker thread has (within one model step), so that
            # a request that has ended never still holds its slot.
            await asyncio.shield(worker)

    # --- shutdown ----------------------------------------------------------

    def cancel_all(self) -> None:
        """Stop every generation before its next step and refuse new ones (shutdown). On the loop thread."""
        self._closed = True
        for cancel in list(self._cancels):
            cancel.set()
        self._refuse_waiting()

    def _refuse_waiting(self) -> None:
        """Shutdown: every request waiting for a slot gets GenerationCancelled."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(GenerationCancelled("the engine is shutting down"))
        self._changed()

    def join(self) -> None:
        """Wait for the worker threads to end (after cancel_all: within one model step). Blocking."""
        self._pool.shutdown(wait=True, cancel_futures=True)
