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

Work is bounded before it is done, and never done on the event loop: the
checks, the tokenizing lanes and the Job are prepare.py's (Preparer); the
/metrics families are latency.py's; the /health answer is health.py's
EngineHealth.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from hostd import logs
from hostd.engine.generate import GenerationCancelled, Runner
from hostd.engine.health import EngineHealth
from hostd.engine.health import encode as health_encode
from hostd.engine.latency import Latency, RequestClock, RunnerCollector
from hostd.engine.openai_api import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    GENERATION_PATHS,
    ChatFormat,
    ChatRequest,
    CompletionFormat,
    CompletionRequest,
    Job,
    OpenAIError,
    encode,
    envelope,
    read_request,
    shutting_down_error,
    sse_event,
    token_usage,
)
from hostd.engine.prepare import Preparer
from hostd.engine.standby_kv import StandbyKV, join_and_drop

STATUS_CLIENT_CLOSED = "499"  # requests_total status for a client that left before the end (nginx's code)

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
    # continuous, the standby slot: the budget its runner holds while no request
    # comes (reload.standby_kv_mib; standby_kv.py grows it to kv_cache_bytes)
    kv_cache_bytes_idle: int | None = None
    cuda_graphs: bool = False  # continuous on CUDA: batch.CUDA_GRAPHS (engine.enforce_eager false, not the standby)

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


# --- the engine's state ------------------------------------------------------


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
    standby_kv: "StandbyKV | None" = None  # the standby slot's runner swap (build_app sets it)

    def __post_init__(self) -> None:
        self.idle.set()
        self.prepare = Preparer(self.tokenizer, self.limits.max_model_len, self.served_name, self.vocab_size)
        self.requests_total = Counter(
            "hostd_engine_requests", "Generation requests answered, by endpoint and HTTP status "
            f"({STATUS_CLIENT_CLOSED}: the client left before the end)",
            ["endpoint", "status"], registry=self.registry,
        )
        self.registry.register(RunnerCollector(self))
        self.latency = Latency(self.registry, self.limits.max_model_len)
        self.runner.on_change = self.changed

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def swap_runner(self, new: Runner) -> Runner:
        """Serve on NEW from now on (standby_kv.py, with no request on the
        old one); returns the old runner. The counters carry over."""
        old, self.runner = self.runner, new
        new.stats, new.on_change = old.stats, self.changed
        return old

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

    def close(self) -> None:
        self.prepare.close()

    def summary(self) -> str:
        """The one-line human status (systemd's STATUS=)."""
        s = self.runner.stats
        if self.draining:
            return f"shutting down: {self.in_flight} request(s) in flight"
        return f"serving: {s.running} running, {s.waiting} waiting"

    # --- request preparation: checks on the loop, tokenizing on a preparation lane

    def health(self) -> EngineHealth:
        """GET /health: the engine's own facts, then the start's (HEALTH_INFO,
        engine/main.py) over them; the status is always the engine's."""
        s = self.runner.stats
        running, waiting = self.running_waiting()
        status = "shutting_down" if self.draining else "ok"
        health = EngineHealth(
            status=status, model=self.served_name, pid=os.getpid(), max_num_seqs=self.limits.max_num_seqs,
            max_model_len=self.limits.max_model_len, max_body_bytes=self.prepare.max_body_bytes,
            batching=self.limits.batching, running=running,
            waiting=waiting, running_max=s.running_max, tokens_per_s=round(s.tokens_per_second(), 2),
        )
        try:
            extra = self.health_info() if callable(self.health_info) else self.health_info
            if extra:
                health = msgspec.structs.replace(health, **extra, status=status)
        except Exception:  # a callback that failed, or a field EngineHealth does not have
            self.log.exception("the health_info facts failed; /health answers without them")
        blocks = self.kv_blocks()
        if blocks is not None:  # the live runner's cache, over the start's figure: a standby's changes size
            health = msgspec.structs.replace(
                health, kv_blocks_used=blocks[0], kv_blocks_total=blocks[1], kv_block_tokens=self.runner.page_size,
                kv_cache_bytes=self.runner.kv_cache_bytes)
        if self.standby_kv is not None:
            health = msgspec.structs.replace(health, **self.standby_kv.facts())
        return health


ENGINE = web.AppKey("hostd_engine", Engine)
_ARRIVED = "hostd_arrived"  # request key: time.monotonic() when the engine took it (the latency clock)
_OUTCOME = "hostd_outcome_status"  # request key: status to count when it differs from the response's


# --- answering generation requests -------------------------------------------



async def _answer(request: web.Request, engine: Engine, job: Job, fmt) -> web.StreamResponse:
    if engine.standby_kv is not None:
        await engine.standby_kv.full()  # an idle standby grows its KV cache first
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
    body = await read_request(request, kind, engine.prepare.max_body_bytes, engine.log)
    engine.prepare.check_model(body.model)
    engine.prepare.check_stop(body.stop)
    if kind is ChatRequest:
        chars = engine.prepare.check_messages(body.messages)
        return engine, body, await engine.prepare.prepared(chars, engine.prepare.chat_prompt_ids, body.messages)
    chars = engine.prepare.check_prompt(body.prompt)
    return engine, body, await engine.prepare.prepared(chars, engine.prepare.prompt_ids, body.prompt)


async def _completions(request: web.Request) -> web.StreamResponse:
    engine, body, prompt_ids = await _read_and_tokenize(request, CompletionRequest)
    job = engine.prepare.job(body, prompt_ids, CompletionFormat, prompt_field="prompt", max_tokens_field="max_tokens",
                     max_tokens=body.max_tokens)
    return await _answer(request, engine, job, CompletionFormat)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine, body, prompt_ids = await _read_and_tokenize(request, ChatRequest)
    if body.max_completion_tokens is not None:
        field_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        field_name, max_tokens = "max_tokens", body.max_tokens
    job = engine.prepare.job(body, prompt_ids, ChatFormat, prompt_field="messages", max_tokens_field=field_name,
                     max_tokens=max_tokens)
    return await _answer(request, engine, job, ChatFormat)


def _model_card(engine: Engine) -> dict:
    """/v1/models' entry: the served name; `root`, the checkpoint directory
    (as vLLM names it), and its content digest, so that a client sees a
    checkpoint swap (docs/operations.md)."""
    health = engine.health()
    card = {
        "id": engine.served_name, "object": "model", "created": engine.created, "owned_by": "hostd",
        "max_model_len": engine.limits.max_model_len,
    }
    if health.checkpoint:
        card["root"] = health.checkpoint
    if health.content_digest:
        card["hostd_content_digest"] = health.content_digest
    return card


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(body=encode({"object": "list", "data": [_model_card(engine)]}), content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.prepare.check_model(request.match_info["name"])
    return web.Response(body=encode(_model_card(engine)), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(
        status=503 if engine.draining else 200, body=health_encode(engine.health()), content_type="application/json"
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


def full_kv_bytes(model, limits: Limits) -> int:
    """The KV budget of a runner that serves requests within LIMITS (batching: continuous)."""
    if limits.kv_cache_bytes is not None:
        return limits.kv_cache_bytes
    from hostd import kv_bytes
    from hostd.engine import budget
    from hostd.engine.generate import model_device

    config = model.config.get_text_config().to_dict()
    per_token = kv_bytes.bytes_per_token(config, str(model.dtype).removeprefix("torch."))
    kind = "cuda" if model_device(model).type == "cuda" else "cpu"
    return budget.kv_cache_bytes(kv_cache_mib=None, max_num_seqs=limits.max_num_seqs,
                                 max_model_len=limits.max_model_len, per_token=per_token, device_total=None,
                                 page=budget.PAGE_SIZE[kind])


def make_runner(model, tokenizer, limits: Limits, *, full: bool = False, precapture: bool = True) -> Runner:
    """The runner LIMITS ask for: one batched loop (batch.BatchRunner), or a
    worker thread per request. With an idle budget (the standby), the idle
    runner unless FULL. PRECAPTURE false: a runner rebuilt beside a serving
    one, whose CUDA graphs are all captured at first use (batch.py). Blocking:
    the cache is allocated here."""
    if limits.batching == "none":
        return Runner(model, tokenizer, limits.max_num_seqs)
    from hostd.engine import batch

    idle = limits.kv_cache_bytes_idle is not None and not full
    return batch.BatchRunner(model, tokenizer, limits.max_num_seqs, max_model_len=limits.max_model_len,
                             kv_cache_bytes=limits.kv_cache_bytes_idle if idle else full_kv_bytes(model, limits),
                             idle=idle, cuda_graphs=batch.CUDA_GRAPHS if limits.cuda_graphs else None,
                             precapture=precapture)


def build_app(
    model,
    tokenizer,
    limits: Limits,
    *,
    served_name: str,
    health_info: dict | Callable[[], dict] | None = None,
    log: logging.Logger | None = None,
    runner: Runner | None = None,
) -> web.Application:
    """The aiohttp application serving MODEL within LIMITS: routes, admission,
    metrics; on RUNNER when given (make_runner's, built off the loop), else
    on a new one. Its cleanup stops the worker threads."""
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
        runner=runner or make_runner(model, tokenizer, limits),
        served_name=served_name,
        limits=limits,
        vocab_size=vocab_size,
        health_info=health_info,
        log=log,
    )
    if limits.batching == "continuous" and limits.kv_cache_bytes_idle is not None:
        engine.standby_kv = StandbyKV(engine, functools.partial(make_runner, model, tokenizer, limits),
                                      full_bytes=full_kv_bytes(model, limits), log=log)
    # Bodies: at most what a request of this model can take (prepare.max_body_bytes;
    # aiohttp refuses a body longer than client_max_size while reading it).
    app = web.Application(middlewares=[_admission, _errors], client_max_size=engine.prepare.max_body_bytes)
    app[ENGINE] = engine
    app.router.add_post(COMPLETIONS, _completions)
    app.router.add_post(CHAT_COMPLETIONS, _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{name}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)

    async def stop_workers(app: web.Application) -> None:
        if app[ENGINE].standby_kv is not None:
            await app[ENGINE].standby_kv.close()  # a grow or shrink under way ends first
        app[ENGINE].close()
        app[ENGINE].runner.cancel_all()
        await asyncio.to_thread(join_and_drop, [app[ENGINE].runner])

    app.on_cleanup.append(stop_workers)
    return app

