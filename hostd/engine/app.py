"""The builtin engine's aiohttp application: routes, admission, metrics.

One job: answer one loaded model's OpenAI API -- POST /v1/completions and
/v1/chat/completions (streaming as server-sent events or not), GET /v1/models,
/health and /metrics -- within its Limits. The shapes of requests, answers and
errors are openai_api.py's; generation is generate.py's; listening, signals
and the graceful drain are the process's (server.py).

Limits: at most ``max_num_seqs`` requests generate at once; the others wait
their turn (first come, first served) and are never rejected for being many.
``prompt_tokens + max_tokens`` must fit in ``max_model_len``, else 400
context_length_exceeded. While the process drains, new generation requests
get 503 with Retry-After.

Work is bounded before it is done, and never done on the event loop: a prompt
(or a chat's messages) longer in characters than ``max_model_len`` times the
tokenizer's longest token cannot fit and is refused unread (a chat counts
every string its template receives, roles included, and at least one token per
message; openai_api caps a role's length and the number of messages);
tokenizing and applying the chat template run on two preparation lanes, each a
thread with its own copy of the tokenizer (Hugging Face tokenizers are not
thread-safe; the loop's copy decodes completions): texts up to
SHORT_PREPARE_CHARS on one, longer ones on the other, so that one client's
long prompts never hold up everyone's short ones; stop strings are capped in count and total length
(openai_api.MAX_STOP_STRINGS, MAX_STOP_CHARS), since each generated token is
checked against all of them on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hostd import logs
from hostd.engine.generate import GenerationCancelled, Runner, SamplingParams
from hostd.engine.openai_api import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    GENERATION_PATHS,
    ChatFormat,
    ChatMessage,
    ChatRequest,
    CommonFields,
    CompletionFormat,
    CompletionRequest,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    Job,
    OpenAIError,
    encode,
    envelope,
    read_request,
    shutting_down_error,
    sse_event,
    token_usage,
)

CLIENT_MAX_SIZE = 64 * 1024 * 1024  # request bodies: long contexts need more than aiohttp's 1 MiB
STATUS_CLIENT_CLOSED = "499"  # requests_total status for a client that left before the end (nginx's code)
# Texts up to this many characters are prepared on the short lane: any tokenizer
# and template takes milliseconds for them, so a queue of long prompts (each up to
# max_model_len times the longest token, seconds of work) cannot stall them.
SHORT_PREPARE_CHARS = 8192

_log = logging.getLogger("hostd.engine")


@dataclass(frozen=True)
class Limits:
    """What one builtin engine allows: the engine: section of its config with
    max_model_len resolved (hostd/engine/main.py builds it)."""

    max_num_seqs: int  # requests generating at once; later ones wait their turn
    max_model_len: int  # prompt plus completion tokens of one request
    shutdown_timeout: float  # seconds admitted requests get after SIGTERM
    batching: str = "continuous"  # "continuous": batch.BatchRunner; "none": generate.Runner, a thread per request
    kv_cache_bytes: int | None = None  # continuous: the paged KV cache; None: budget.kv_cache_bytes's unset rule

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "none"):
            raise ValueError(f"batching must be 'continuous' or 'none', got {self.batching!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_model_len < 2:
            raise ValueError(
                f"max_model_len must be at least 2 (one prompt and one completion token), got {self.max_model_len}"
            )
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be at least 0, got {self.shutdown_timeout}")


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token of TOKENIZER stands for: the longest
    vocabulary entry (byte-level BPE spells each byte as one character, and
    SentencePiece a space as one), added tokens included. None when the
    tokenizer lists no vocabulary: then no prompt is refused unread."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    return max((len(token) for token in vocab), default=None) or None


# --- the engine's state and metrics ------------------------------------------

# The latency histograms mean what vLLM's do (vllm/v1/metrics/loggers.py),
# under hostd_engine_ names, with vLLM's buckets: a request's clock starts
# when the engine takes it (its arrival), as vLLM's arrival_time does.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to MAX_MODEL_LEN (vLLM's build_1_2_5_buckets)."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class Latency:
    """The latency histograms of one engine, observed per request through a RequestClock."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int) -> None:
        self.ttft = Histogram(
            "hostd_engine_time_to_first_token_seconds", "From the request's arrival at the engine to its first "
            "generated token (vllm:time_to_first_token_seconds)", buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(
            "hostd_engine_time_per_output_token_seconds", "Seconds between two consecutive tokens of a request, "
            "one observation per token after the first (vllm:time_per_output_token_seconds, "
            "vllm:inter_token_latency_seconds in newer vLLM)", buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram(
            "hostd_engine_e2e_request_latency_seconds", "From the request's arrival at the engine to its last "
            "token, for requests that finished (vllm:e2e_request_latency_seconds)", buckets=E2E_BUCKETS,
            registry=registry)
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = Histogram(
            "hostd_engine_request_prompt_tokens", "Prompt tokens of finished requests "
            "(vllm:request_prompt_tokens)", buckets=tokens, registry=registry)
        self.generation_tokens = Histogram(
            "hostd_engine_request_generation_tokens", "Generated tokens of finished requests "
            "(vllm:request_generation_tokens)", buckets=tokens, registry=registry)


class RequestClock:
    """One request's latencies: tokens(n) with the count of tokens so far at
    every delta, finished() once it ended on its own (a stop or its length),
    not when it was cancelled or its client left."""

    def __init__(self, latency: Latency, arrived: float, prompt_tokens: int) -> None:
        self.latency, self.arrived, self.prompt_tokens = latency, arrived, prompt_tokens
        self.count, self.last = 0, arrived

    def tokens(self, count: int) -> None:
        if count <= self.count:
            return
        now = time.monotonic()
        if self.count == 0:
            self.latency.ttft.observe(now - self.arrived)
            new, self.count = count - 1, 1  # the first token's gap is the TTFT, not a TPOT
        else:
            new = count - self.count
        if new > 0:
            gap = (now - self.last) / new  # tokens that came in one delta share its gap
            for _ in range(new):
                self.latency.tpot.observe(gap)
        self.count, self.last = count, now

    def finished(self) -> None:
        self.latency.e2e.observe(time.monotonic() - self.arrived)
        self.latency.prompt_tokens.observe(self.prompt_tokens)
        self.latency.generation_tokens.observe(self.count)



class _RunnerCollector:
    """Exports the runner's counters and the engine's limits at scrape time."""

    def __init__(self, engine: "Engine") -> None:
        self._engine = engine

    def collect(self):
        engine = self._engine
        s, limits = engine.runner.stats, engine.limits
        running, waiting = engine.running_waiting()
        gauges = [
            ("hostd_engine_requests_running", "Requests generating now (holding one of max_num_seqs slots and, "
             "batched, KV blocks) (vllm:num_requests_running)", running),
            ("hostd_engine_requests_waiting", "Requests admitted and waiting for a slot or for KV blocks "
             "(vllm:num_requests_waiting)", waiting),
            ("hostd_engine_requests_running_max", "Most requests generating at once since start", s.running_max),
            ("hostd_engine_requests_waiting_max", "Most requests waiting at once since start", s.waiting_max),
            ("hostd_engine_max_num_seqs", "Configured limit on requests generating at once", limits.max_num_seqs),
            ("hostd_engine_max_model_len", "Configured limit on prompt plus completion tokens", limits.max_model_len),
            ("hostd_engine_draining", "1 while shutting down, else 0", int(engine.draining)),
        ]
        blocks = engine.kv_blocks()
        if blocks is not None:
            used, total = blocks
            gauges += [
                ("hostd_engine_kv_blocks_used", "KV cache blocks held by requests (vLLM: kv_cache_usage_perc's count)",
                 used),
                ("hostd_engine_kv_blocks_total", "KV cache blocks of the paged cache (engine.kv_cache_mib)", total),
                ("hostd_engine_kv_cache_usage_perc", "Fraction of the KV cache blocks in use, 0 to 1 "
                 "(vllm:kv_cache_usage_perc)", used / total if total else 0.0),
            ]
        gauges.append(("hostd_engine_avg_generation_throughput_toks_per_s", "Tokens generated per second over the "
                       "last 10 s (vllm:avg_generation_throughput_toks_per_s)", s.tokens_per_second()))
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("hostd_engine_prompt_tokens", "Prompt tokens of requests that started generating",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("hostd_engine_generation_tokens", "Tokens generated by the model",
                                  value=s.generated_tokens)


class _PrepareLane:
    """One preparation thread and the copy of the tokenizer only it uses."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


@dataclass
class Engine:
    """Everything the handlers share: the model's runner, the limits, shutdown state, metrics."""

    tokenizer: Any
    runner: Runner
    served_name: str
    limits: Limits
    vocab_size: int | None
    health_info: dict | Callable[[], dict] | None
    log: logging.Logger
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    in_flight: int = 0  # generation requests between arrival and their last byte
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    on_change: Callable[[], None] | None = None  # run_server's status line
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.idle.set()
        # Each lane's own tokenizer: the loop's decodes completions meanwhile.
        self._short_lane = _PrepareLane(self.tokenizer, "hostd-prepare-short")
        self._long_lane = _PrepareLane(self.tokenizer, "hostd-prepare-long")
        self.longest_token = longest_token_chars(self.tokenizer)
        self.max_prompt_chars = None if self.longest_token is None else self.limits.max_model_len * self.longest_token
        self.requests_total = Counter(
            "hostd_engine_requests", "Generation requests answered, by endpoint and HTTP status "
            f"({STATUS_CLIENT_CLOSED}: the client left before the end)",
            ["endpoint", "status"], registry=self.registry,
        )
        self.registry.register(_RunnerCollector(self))
        self.latency = Latency(self.registry, self.limits.max_model_len)
        self.runner.on_change = self.changed

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def running_waiting(self) -> tuple[int, int]:
        """Requests generating, and requests waiting (for a slot, or batched: holding one, waiting for KV blocks)."""
        s = self.runner.stats
        held_back = self.runner.waiting_for_kv() if hasattr(self.runner, "waiting_for_kv") else 0
        held_back = min(held_back, s.running)
        return s.running - held_back, s.waiting + held_back

    def kv_blocks(self) -> tuple[int, int] | None:
        """(used, total) blocks of the paged KV cache; None without one (batching: none)."""
        if not hasattr(self.runner, "kv_blocks_used"):
            return None
        return self.runner.kv_blocks_used(), self.runner.kv_blocks_total

    def summary(self) -> str:
        """The one-line human status (systemd's STATUS=)."""
        s = self.runner.stats
        if self.draining:
            return f"shutting down: {self.in_flight} request(s) in flight"
        return f"serving: {s.running} running, {s.waiting} waiting"

    # --- request preparation: checks on the loop, tokenizing on a preparation lane

    async def prepared(self, chars: int, prepare: Callable[..., list[int]], *args) -> list[int]:
        """PREPARE(tokenizer, *ARGS) on the lane for a text of CHARS characters, with that lane's tokenizer."""
        lane = self._short_lane if chars <= SHORT_PREPARE_CHARS else self._long_lane
        return await asyncio.get_running_loop().run_in_executor(lane.thread, prepare, lane.tokenizer, *args)

    def close(self) -> None:
        self._short_lane.close()
        self._long_lane.close()

    def check_text_fits(self, chars: int, what: str, param: str) -> None:
        """Refuse, unread, a text of CHARS characters that no tokenization fits in max_model_len."""
        bound = self.max_prompt_chars
        if bound is not None and chars > bound:
            limit = self.limits.max_model_len
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens, and your {what} is {chars} characters "
                f"long: more than {limit} tokens of this model's tokenizer can hold ({bound} characters). "
                f"Shorten the {what}.",
                param=param, code="context_length_exceeded",
            )

    def check_stop(self, stop: str | list[str] | None) -> None:
        """Stop strings are checked against the completion at every token, on the loop: bounded."""
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise OpenAIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
                              param="stop")
        total = sum(len(s) for s in stops)
        if total > MAX_STOP_CHARS:
            raise OpenAIError(400, f"stop strings are {total} characters long together; at most {MAX_STOP_CHARS} "
                              "are allowed", param="stop")

    def check_prompt(self, prompt: str | list) -> int:
        """What can be refused before tokenizing a completions prompt; its size in characters."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            self.check_text_fits(len(prompt), "prompt", "prompt")
            return len(prompt)
        return len(prompt) if isinstance(prompt, list) else 0

    def check_messages(self, messages: list[ChatMessage]) -> int:
        """What can be refused before templating a chat; its size in characters. The
        template receives every message's role and text, and wraps each message in
        delimiters of at least one token: each message also counts as one token's
        worth of characters, so a million empty messages cost what they weigh."""
        chars = 0
        for message in messages:
            chars += len(message.role)
            content = message.content
            if isinstance(content, list):
                chars += sum(len(p.type) + len(p.text or "") for p in content)
            elif content:
                chars += len(content)
        chars += len(messages) * (self.longest_token or 1)
        self.check_text_fits(chars, "messages", "messages")
        return chars

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise OpenAIError(
                404,
                f"The model '{name}' does not exist here: this engine serves '{self.served_name}'. "
                f"Set model to '{self.served_name}' (GET /v1/models lists it).",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, tokenizer, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return tokenizer.encode(prompt, add_special_tokens=True)
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            limit = self.vocab_size or 2**63
            bad = [t for t in prompt if not 0 <= t < limit]
            if bad:
                raise OpenAIError(
                    400, f"prompt holds token ids outside the vocabulary (0 to {limit - 1}): {bad[:5]}",
                    param="prompt",
                )
            return list(prompt)
        raise OpenAIError(
            400,
            "prompt must be a string, a list of one string, or a list of token ids; "
            "this engine takes one prompt per request, so send one request per prompt",
            param="prompt",
        )

    def chat_prompt_ids(self, tokenizer, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise OpenAIError(400, "messages is empty; send at least one message", param="messages")
        conversation = []
        for i, message in enumerate(messages):
            content = message.content
            if isinstance(content, list):
                other = sorted({p.type for p in content if p.type != "text"})
                if other:
                    raise OpenAIError(
                        400,
                        f"messages[{i}] has content parts of type {', '.join(other)}; "
                        "the builtin engine serves text only, so send text parts only",
                        param="messages",
                    )
                content = "".join(p.text or "" for p in content)
            conversation.append({"role": message.role, "content": content or ""})
        if not getattr(tokenizer, "chat_template", None):
            raise OpenAIError(
                400, f"the model '{self.served_name}' has no chat template; use {COMPLETIONS} with a prompt",
                param="messages",
            )
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja's TemplateError and raise_exception() in templates
            raise OpenAIError(
                400, f"the model's chat template refused these messages: {error}", param="messages"
            ) from None
        return tokenizer.encode(text, add_special_tokens=False)

    def job(self, body: CommonFields, prompt_ids: list[int], fmt, *, prompt_field: str, max_tokens_field: str,
            max_tokens: int | None) -> Job:
        if body.stream_options is not None and not body.stream:
            raise OpenAIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        temperature = 1.0 if body.temperature is None else body.temperature
        if not 0.0 <= temperature <= 2.0:
            raise OpenAIError(400, f"temperature must be between 0 and 2, got {temperature}", param="temperature")
        top_p = 1.0 if body.top_p is None else body.top_p
        if not 0.0 < top_p <= 1.0:
            raise OpenAIError(400, f"top_p must be greater than 0 and at most 1, got {top_p}", param="top_p")
        if body.seed is not None and not -(2**63) <= body.seed < 2**63:
            raise OpenAIError(400, f"seed must fit in a signed 64-bit integer, got {body.seed}", param="seed")
        if max_tokens is not None and max_tokens < 1:
            raise OpenAIError(400, f"{max_tokens_field} must be at least 1, got {max_tokens}", param=max_tokens_field)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        what = "messages" if prompt_field == "messages" else "prompt"
        n, limit = len(prompt_ids), self.limits.max_model_len
        if n == 0:
            raise OpenAIError(400, f"the {what} is empty: it must hold at least one token", param=prompt_field)
        if n >= limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens, and your {what} is {n} tokens long, "
                f"which leaves no room for a completion. Shorten the {what} to under {limit} tokens.",
                param=prompt_field, code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). "
                f"Set {max_tokens_field} to at most {limit - n} or shorten the {what}.",
                param=max_tokens_field, code="context_length_exceeded",
            )
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=body.seed,
                                stop=stop, ignore_eos=bool(body.ignore_eos))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Job(
            id=fmt.id_prefix + uuid.uuid4().hex,
            prompt_ids=prompt_ids, params=params, stream=bool(body.stream), include_usage=include_usage,
        )

    def health(self) -> dict:
        s = self.runner.stats
        running, waiting = self.running_waiting()
        info = {
            "status": "shutting_down" if self.draining else "ok",
            "model": self.served_name,
            "pid": os.getpid(),
            "max_num_seqs": self.limits.max_num_seqs,
            "max_model_len": self.limits.max_model_len,
            "batching": self.limits.batching,
            "running": running,
            "waiting": waiting,
            "running_max": s.running_max,
            "tokens_per_s": round(s.tokens_per_second(), 2),
        }
        blocks = self.kv_blocks()
        if blocks is not None:
            info |= {"kv_blocks_used": blocks[0], "kv_blocks_total": blocks[1],
                     "kv_block_tokens": self.runner.page_size, "kv_cache_bytes": self.runner.kv_cache_bytes}
        extra = self.health_info
        if callable(extra):
            try:
                extra = extra()
            except Exception:
                self.log.exception("the health_info callback failed; /health answers without its fields")
                extra = None
        return {**info, **(extra or {}), "status": info["status"]}


ENGINE = web.AppKey("hostd_engine", Engine)
_ARRIVED = "hostd_arrived"  # request key: time.monotonic() when the engine took it (the latency clock)
_OUTCOME = "hostd_outcome_status"  # request key: status to count when it differs from the response's


# --- answering generation requests -------------------------------------------



async def _answer(request: web.Request, engine: Engine, job: Job, fmt) -> web.StreamResponse:
    if job.stream:
        return await _answer_stream(request, engine, job, fmt)
    parts: list[str] = []
    completion_tokens, finish = 0, None
    started = time.monotonic()
    clock = RequestClock(engine.latency, request.get(_ARRIVED, started), len(job.prompt_ids))
    try:
        async with contextlib.aclosing(engine.runner.stream(job.prompt_ids, job.params)) as deltas:
            async for delta in deltas:
                parts.append(delta.text)
                completion_tokens, finish = delta.completion_tokens, delta.finish_reason
                clock.tokens(completion_tokens)
    except GenerationCancelled:
        raise shutting_down_error("this request was cancelled before it finished") from None
    body = envelope(job, fmt.object, [fmt.choice("".join(parts), finish)], engine.served_name)
    body["usage"] = token_usage(len(job.prompt_ids), completion_tokens)
    clock.finished()
    _log_done(engine, job, completion_tokens, finish, started)
    return web.Response(body=encode(body), content_type="application/json")


async def _answer_stream(request: web.Request, engine: Engine, job: Job, fmt) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    usage_field = {"usage": None} if job.include_usage else {}

    async def send(choices: list[dict]) -> None:
        chunk = envelope(job, fmt.chunk_object, choices, engine.served_name) | usage_field
        await response.write(sse_event(chunk))

    completion_tokens, finish = 0, None
    started = time.monotonic()
    clock = RequestClock(engine.latency, request.get(_ARRIVED, started), len(job.prompt_ids))
    try:
        opening = fmt.opening()
        if opening is not None:
            await send([opening])
        async with contextlib.aclosing(engine.runner.stream(job.prompt_ids, job.params)) as deltas:
            async for delta in deltas:
                completion_tokens, finish = delta.completion_tokens, delta.finish_reason
                clock.tokens(completion_tokens)
                if delta.text:
                    await send([fmt.chunk_choice(delta.text, None)])
        await send([fmt.chunk_choice("", finish)])
        clock.finished()
        if job.include_usage:
            usage = envelope(job, fmt.chunk_object, [], engine.served_name)
            usage["usage"] = token_usage(len(job.prompt_ids), completion_tokens)
            await response.write(sse_event(usage))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:  # the client left; leaving the aclosing block stopped its generation
        request[_OUTCOME] = STATUS_CLIENT_CLOSED
        engine.log.debug("%s: the client closed the stream after %d tokens", job.id, completion_tokens)
        return response
    except Exception as error:
        # Headers are sent, so the status stays 200: end the stream with an error
        # event, which the openai client raises as APIError, and no [DONE].
        if isinstance(error, GenerationCancelled):
            problem = shutting_down_error("this stream was cancelled before it finished")
            request[_OUTCOME] = "503"
        else:
            engine.log.exception("%s: generation failed after %d tokens", job.id, completion_tokens)
            problem = OpenAIError(500, f"generation failed: {type(error).__name__}: {error}", type="server_error")
            request[_OUTCOME] = "500"
        with contextlib.suppress(ConnectionResetError):
            await response.write(sse_event(problem.body()))
            await response.write_eof()
        return response
    _log_done(engine, job, completion_tokens, finish, started)
    return response


def _log_done(engine: Engine, job: Job, completion_tokens: int, finish: str | None, started: float) -> None:
    engine.log.debug(
        "%s: %d prompt + %d completion tokens, finish_reason=%s, %.2f s",
        job.id, len(job.prompt_ids), completion_tokens, finish, time.monotonic() - started,
    )


# --- handlers ------------------------------------------------------------------


async def _read_and_tokenize(request: web.Request, kind: type) -> tuple[Engine, Any, list[int]]:
    """The request's body and its prompt as token ids: the cheap checks on the
    loop first, then tokenizing (and a chat's template) on a preparation lane."""
    engine = request.app[ENGINE]
    body = await read_request(request, kind)
    engine.check_model(body.model)
    engine.check_stop(body.stop)
    if kind is ChatRequest:
        chars = engine.check_messages(body.messages)
        return engine, body, await engine.prepared(chars, engine.chat_prompt_ids, body.messages)
    chars = engine.check_prompt(body.prompt)
    return engine, body, await engine.prepared(chars, engine.prompt_ids, body.prompt)


async def _completions(request: web.Request) -> web.StreamResponse:
    engine, body, prompt_ids = await _read_and_tokenize(request, CompletionRequest)
    job = engine.job(body, prompt_ids, CompletionFormat, prompt_field="prompt", max_tokens_field="max_tokens",
                     max_tokens=body.max_tokens)
    return await _answer(request, engine, job, CompletionFormat)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine, body, prompt_ids = await _read_and_tokenize(request, ChatRequest)
    if body.max_completion_tokens is not None:
        field_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        field_name, max_tokens = "max_tokens", body.max_tokens
    job = engine.job(body, prompt_ids, ChatFormat, prompt_field="messages", max_tokens_field=field_name,
                     max_tokens=max_tokens)
    return await _answer(request, engine, job, ChatFormat)


def _model_card(engine: Engine) -> dict:
    return {
        "id": engine.served_name, "object": "model", "created": engine.created, "owned_by": "hostd",
        "max_model_len": engine.limits.max_model_len,
    }


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(body=encode({"object": "list", "data": [_model_card(engine)]}), content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.check_model(request.match_info["name"])
    return web.Response(body=encode(_model_card(engine)), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(
        status=503 if engine.draining else 200, body=encode(engine.health()), content_type="application/json"
    )


async def _metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(body=generate_latest(engine.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


# --- middlewares -----------------------------------------------------------------


@web.middleware
async def _admission(request: web.Request, handler) -> web.StreamResponse:
    """Outermost: refuses generation requests while draining, counts them in flight and by outcome."""
    if request.path not in GENERATION_PATHS:
        return await handler(request)
    engine = request.app[ENGINE]
    if engine.draining:
        engine.requests_total.labels(request.path, "503").inc()
        return shutting_down_error("new requests are refused").response()
    request[_ARRIVED] = time.monotonic()
    engine.in_flight += 1
    engine.idle.clear()
    status = STATUS_CLIENT_CLOSED  # unless a response comes back
    try:
        response = await handler(request)
        status = request.get(_OUTCOME, str(response.status))
        return response
    finally:
        engine.requests_total.labels(request.path, status).inc()
        engine.in_flight -= 1
        if engine.in_flight == 0:
            engine.idle.set()
        engine.changed()


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """Answers every failure in OpenAI's error format."""
    try:
        return await handler(request)
    except OpenAIError as error:
        return error.response()
    except HttpProcessingError as error:
        # The client's own protocol error (a body that does not decode): one
        # line at debug, never a traceback a client could repeat at will.
        request.app[ENGINE].log.debug("%s %s: client protocol error: %s", request.method, request.path,
                                      logs.one_line(error))
        return OpenAIError(400, f"the request is malformed: {logs.one_line(error)}").response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        if error.status == 404:
            message = (f"{request.method} {request.path} does not exist; this engine serves POST {COMPLETIONS}, "
                       f"POST {CHAT_COMPLETIONS}, GET /v1/models, GET /health and GET /metrics")
        else:
            message = f"{request.method} {request.path}: {error.reason}"
        return OpenAIError(error.status, message, code=error.reason.lower().replace(" ", "_")).response()
    except Exception as error:
        request.app[ENGINE].log.exception("%s %s failed", request.method, request.path)
        return OpenAIError(
            500, f"internal error: {type(error).__name__}: {error}; the engine's journal has the traceback",
            type="server_error",
        ).response()


# --- the application -------------------------------------------------------------


def make_runner(model, tokenizer, limits: Limits) -> Runner:
    """The runner LIMITS ask for: one batched loop (batch.BatchRunner), or a worker thread per request."""
    if limits.batching == "none":
        return Runner(model, tokenizer, limits.max_num_seqs)
    from hostd.engine import batch, budget

    kv = limits.kv_cache_bytes
    if kv is None:
        config = model.config.get_text_config().to_dict()
        dtype = str(model.dtype).removeprefix("torch.")
        kv = budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=limits.max_num_seqs,
                                   max_model_len=limits.max_model_len,
                                   per_token=budget.bytes_per_token(config, dtype), device_total=None)
    return batch.BatchRunner(model, tokenizer, limits.max_num_seqs, max_model_len=limits.max_model_len,
                             kv_cache_bytes=kv)


def build_app(
    model,
    tokenizer,
    limits: Limits,
    *,
    served_name: str,
    health_info: dict | Callable[[], dict] | None = None,
    log: logging.Logger | None = None,
) -> web.Application:
    """The aiohttp application serving MODEL within LIMITS: routes, admission,
    metrics. Its cleanup stops the worker threads."""
    log = log or _log
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and limits.max_model_len > positions:
        log.warning(
            "max_model_len=%d exceeds the model's max_position_embeddings=%d: output beyond %d tokens "
            "may degrade; lower max_model_len unless the model is known to extrapolate",
            limits.max_model_len, positions, positions,
        )
    try:
        vocab_size = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab_size = None
    engine = Engine(
        tokenizer=tokenizer,
        runner=make_runner(model, tokenizer, limits),
        served_name=served_name,
        limits=limits,
        vocab_size=vocab_size,
        health_info=health_info,
        log=log,
    )
    app = web.Application(middlewares=[_admission, _errors], client_max_size=CLIENT_MAX_SIZE)
    app[ENGINE] = engine
    app.router.add_post(COMPLETIONS, _completions)
    app.router.add_post(CHAT_COMPLETIONS, _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{name}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)

    async def stop_workers(app: web.Application) -> None:
        app[ENGINE].close()
        runner = app[ENGINE].runner
        runner.cancel_all()
        await asyncio.to_thread(runner.join)

    app.on_cleanup.append(stop_workers)
    return app

