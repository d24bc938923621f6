"""The builtin engine's OpenAI-compatible HTTP server.

One job: serve one loaded model over HTTP the way the OpenAI API does --
POST /v1/completions and /v1/chat/completions (streaming as server-sent events
or not), GET /v1/models, /health and /metrics -- within the limits it was
started with, and shut down gracefully on SIGTERM.

Trust: the engine listens on /run/hostd/NAME/engine.sock, a 0600 socket in the
model's private 0700 runtime directory, so only the service user (the gateway,
the manager) and root can connect; it trusts those peers and does no
authentication. It still validates every request, because a malformed one must
cost a 400, not the process. It refuses request fields it does not implement
(see REFUSED_FIELDS) rather than answer as if it had honoured them. A TCP
listener (host/port) exists for use by hand only: anyone who can reach it can
use the model.

Limits: at most ``max_num_seqs`` requests generate at once; the others wait
their turn (first come, first served) and are never rejected for being many.
``prompt_tokens + max_tokens`` must fit in ``max_model_len``, else 400
context_length_exceeded.

Shutdown (SIGTERM or SIGINT): stop listening, answer 503 with Retry-After to
any new request on an open connection, let admitted requests (streams
included) finish for up to ``shutdown_timeout`` seconds, then cancel what is
left, and return exit code 0. A second signal cancels at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hostd.engine.generate import GenerationCancelled, Runner, SamplingParams, warm_up

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATION_PATHS = (COMPLETIONS, CHAT_COMPLETIONS)

RETRY_AFTER_S = 5  # what a 503 during shutdown tells clients; a restarted engine is usually up by then
CANCEL_GRACE_S = 5.0  # after cancelling, how long handlers get to write their error and close
CLIENT_MAX_SIZE = 64 * 1024 * 1024  # request bodies: long contexts need more than aiohttp's 1 MiB
STATUS_INTERVAL_S = 1.0  # on_status is called at most about this often
STATUS_CLIENT_CLOSED = "499"  # requests_total status for a client that left before the end (nginx's code)

_log = logging.getLogger("hostd.engine")


# --- OpenAI wire format: errors ----------------------------------------------


class OpenAIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=_json(self.body()), content_type="application/json", headers=self.headers
        )


def shutting_down_error(what: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"{what}: the engine is shutting down. Retry in a few seconds; a restarted engine will take it.",
        type="server_error",
        code="engine_shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )


def _json(value: Any) -> bytes:
    return msgspec.json.encode(value)


# --- OpenAI wire format: requests --------------------------------------------


def _is_absent(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "" or value == [] or value == {}


# Request fields the builtin engine does not implement, with why. A request that
# sets one to anything but its "off" value is refused with 400: answering it as
# if the field had been honoured would hand the client something it did not
# ask for (no log-probabilities where it expects them, unpenalised text, no
# tool call). Each entry: (accepts this value?, why it is refused).
REFUSED_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v in (None, 1), "only one choice per request is generated; send n requests instead"),
    "best_of": (lambda v: v in (None, 1), "only one candidate per request is generated"),
    "logprobs": (_is_absent, "log-probabilities are not computed"),
    "top_logprobs": (_is_absent, "log-probabilities are not computed"),
    "echo": (_is_absent, "the prompt is not echoed back"),
    "suffix": (_is_absent, "text insertion (suffix) needs a fill-in-the-middle model and is not implemented"),
    "logit_bias": (_is_absent, "logit bias is not applied"),
    "presence_penalty": (_is_absent, "presence penalty is not applied"),
    "frequency_penalty": (_is_absent, "frequency penalty is not applied"),
    "tools": (_is_absent, "tool calling is not implemented"),
    "functions": (_is_absent, "function calling is not implemented"),
    "response_format": (
        lambda v: v is None or v == {"type": "text"},
        "structured output (json_object, json_schema) is not enforced",
    ),
}


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # optional for by-hand use: the one served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's extension, for benchmarks and tests


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list  # a string, [string], [token ids] or [[token ids]]: checked in _prompt_ids


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


_PATH_PARAM = re.compile(r"at `\$\.(\w+)|missing required field `(\w+)`")


async def _read_request(request: web.Request, kind: type) -> Any:
    body = await request.read()
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as error:
        raise OpenAIError(400, f"the request body is not valid JSON ({error}); send one JSON object") from None
    if not isinstance(raw, dict):
        raise OpenAIError(400, f"the request body is a JSON {type(raw).__name__}; send one JSON object")
    for name, (accepted, why) in REFUSED_FIELDS.items():
        if name in raw and not accepted(raw[name]):
            raise OpenAIError(
                400,
                f"'{name}' = {raw[name]!r} is not supported by the builtin engine: {why}. "
                f"Remove the field, or serve this model with the vllm or sglang backend.",
                param=name,
                code="unsupported_parameter",
            )
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as error:
        match = _PATH_PARAM.search(str(error))
        param = (match.group(1) or match.group(2)) if match else None
        raise OpenAIError(400, f"invalid request: {error}", param=param) from None


@dataclass(frozen=True)
class _Job:
    """One validated generation request."""

    id: str
    endpoint: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


# --- OpenAI wire format: responses -------------------------------------------


class _CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    chunk_choice = choice

    @staticmethod
    def opening() -> dict | None:
        return None


class _ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @staticmethod
    def choice(text: str, finish: str | None) -> dict:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
        }

    @staticmethod
    def chunk_choice(text: str, finish: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def opening() -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# --- the engine's state and metrics ------------------------------------------


class _RunnerCollector:
    """Exports the runner's counters and the engine's limits at scrape time."""

    def __init__(self, engine: "_Engine") -> None:
        self._engine = engine

    def collect(self):
        engine = self._engine
        s = engine.runner.stats
        gauges = [
            ("hostd_engine_requests_running", "Requests generating now (holding one of max_num_seqs slots)", s.running),
            ("hostd_engine_requests_waiting", "Requests admitted and waiting for a slot", s.waiting),
            ("hostd_engine_requests_running_max", "Most requests generating at once since start", s.running_max),
            ("hostd_engine_requests_waiting_max", "Most requests waiting at once since start", s.waiting_max),
            ("hostd_engine_max_num_seqs", "Configured limit on requests generating at once", engine.max_num_seqs),
            ("hostd_engine_max_model_len", "Configured limit on prompt plus completion tokens", engine.max_model_len),
            ("hostd_engine_draining", "1 while shutting down, else 0", int(engine.draining)),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("hostd_engine_prompt_tokens", "Prompt tokens of requests that started generating",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("hostd_engine_generation_tokens", "Tokens generated by the model",
                                  value=s.generated_tokens)


@dataclass
class _Engine:
    """Everything the handlers share: the model's runner, the limits, shutdown state, metrics."""

    tokenizer: Any
    runner: Runner
    served_name: str
    max_num_seqs: int
    max_model_len: int
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
        self.requests_total = Counter(
            "hostd_engine_requests", "Generation requests answered, by endpoint and HTTP status "
            f"({STATUS_CLIENT_CLOSED}: the client left before the end)",
            ["endpoint", "status"], registry=self.registry,
        )
        self.registry.register(_RunnerCollector(self))
        self.runner.on_change = self.changed

    def changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def summary(self) -> str:
        """The one-line human status (systemd's STATUS=)."""
        s = self.runner.stats
        if self.draining:
            return f"shutting down: {self.in_flight} request(s) in flight"
        return f"serving: {s.running} running, {s.waiting} waiting"

    # --- request preparation (on the event loop thread: the tokenizer is not thread-safe)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_name:
            raise OpenAIError(
                404,
                f"The model '{name}' does not exist here: this engine serves '{self.served_name}'. "
                f"Set model to '{self.served_name}' (GET /v1/models lists it).",
                param="model",
                code="model_not_found",
            )

    def prompt_ids(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
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

    def chat_prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
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
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(
                400, f"the model '{self.served_name}' has no chat template; use {COMPLETIONS} with a prompt",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as error:  # jinja's TemplateError and raise_exception() in templates
            raise OpenAIError(
                400, f"the model's chat template refused these messages: {error}", param="messages"
            ) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def job(self, body: _Common, prompt_ids: list[int], fmt, *, prompt_field: str, max_tokens_field: str,
            max_tokens: int | None) -> _Job:
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
        n, limit = len(prompt_ids), self.max_model_len
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
        return _Job(
            id=fmt.id_prefix + uuid.uuid4().hex, endpoint=COMPLETIONS if fmt is _CompletionFormat else CHAT_COMPLETIONS,
            prompt_ids=prompt_ids, params=params, stream=bool(body.stream), include_usage=include_usage,
        )

    def health(self) -> dict:
        s = self.runner.stats
        info = {
            "status": "shutting_down" if self.draining else "ok",
            "model": self.served_name,
            "pid": os.getpid(),
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "running": s.running,
            "waiting": s.waiting,
            "running_max": s.running_max,
        }
        extra = self.health_info
        if callable(extra):
            try:
                extra = extra()
            except Exception:
                self.log.exception("the health_info callback failed; /health answers without its fields")
                extra = None
        return {**info, **(extra or {}), "status": info["status"]}


ENGINE = web.AppKey("hostd_engine", _Engine)
_OUTCOME = "hostd_outcome_status"  # request key: status to count when it differs from the response's


# --- answering generation requests -------------------------------------------


def _envelope(job: _Job, obj: str, choices: list[dict], served_name: str) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": served_name, "choices": choices}


async def _answer(request: web.Request, engine: _Engine, job: _Job, fmt) -> web.StreamResponse:
    if job.stream:
        return await _answer_stream(request, engine, job, fmt)
    parts: list[str] = []
    completion_tokens, finish = 0, None
    started = time.monotonic()
    try:
        async with contextlib.aclosing(engine.runner.stream(job.prompt_ids, job.params)) as deltas:
            async for delta in deltas:
                parts.append(delta.text)
                completion_tokens, finish = delta.completion_tokens, delta.finish_reason
    except GenerationCancelled:
        raise shutting_down_error("this request was cancelled before it finished") from None
    body = _envelope(job, fmt.object, [fmt.choice("".join(parts), finish)], engine.served_name)
    body["usage"] = _usage(len(job.prompt_ids), completion_tokens)
    _log_done(engine, job, completion_tokens, finish, started)
    return web.Response(body=_json(body), content_type="application/json")


async def _answer_stream(request: web.Request, engine: _Engine, job: _Job, fmt) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    usage_field = {"usage": None} if job.include_usage else {}

    async def send(choices: list[dict]) -> None:
        chunk = _envelope(job, fmt.chunk_object, choices, engine.served_name) | usage_field
        await response.write(b"data: " + _json(chunk) + b"\n\n")

    completion_tokens, finish = 0, None
    started = time.monotonic()
    try:
        opening = fmt.opening()
        if opening is not None:
            await send([opening])
        async with contextlib.aclosing(engine.runner.stream(job.prompt_ids, job.params)) as deltas:
            async for delta in deltas:
                completion_tokens, finish = delta.completion_tokens, delta.finish_reason
                if delta.text:
                    await send([fmt.chunk_choice(delta.text, None)])
        await send([fmt.chunk_choice("", finish)])
        if job.include_usage:
            usage = _envelope(job, fmt.chunk_object, [], engine.served_name)
            usage["usage"] = _usage(len(job.prompt_ids), completion_tokens)
            await response.write(b"data: " + _json(usage) + b"\n\n")
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
            await response.write(b"data: " + _json(problem.body()) + b"\n\n")
            await response.write_eof()
        return response
    _log_done(engine, job, completion_tokens, finish, started)
    return response


def _log_done(engine: _Engine, job: _Job, completion_tokens: int, finish: str | None, started: float) -> None:
    engine.log.debug(
        "%s: %d prompt + %d completion tokens, finish_reason=%s, %.2f s",
        job.id, len(job.prompt_ids), completion_tokens, finish, time.monotonic() - started,
    )


# --- handlers ------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _read_request(request, CompletionRequest)
    engine.check_model(body.model)
    prompt_ids = engine.prompt_ids(body.prompt)
    job = engine.job(body, prompt_ids, _CompletionFormat, prompt_field="prompt", max_tokens_field="max_tokens",
                     max_tokens=body.max_tokens)
    return await _answer(request, engine, job, _CompletionFormat)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await _read_request(request, ChatRequest)
    engine.check_model(body.model)
    prompt_ids = engine.chat_prompt_ids(body.messages)
    if body.max_completion_tokens is not None:
        field_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    else:
        field_name, max_tokens = "max_tokens", body.max_tokens
    job = engine.job(body, prompt_ids, _ChatFormat, prompt_field="messages", max_tokens_field=field_name,
                     max_tokens=max_tokens)
    return await _answer(request, engine, job, _ChatFormat)


def _model_card(engine: _Engine) -> dict:
    return {
        "id": engine.served_name, "object": "model", "created": engine.created, "owned_by": "hostd",
        "max_model_len": engine.max_model_len,
    }


async def _models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(body=_json({"object": "list", "data": [_model_card(engine)]}), content_type="application/json")


async def _model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.check_model(request.match_info["name"])
    return web.Response(body=_json(_model_card(engine)), content_type="application/json")


async def _health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(
        status=503 if engine.draining else 200, body=_json(engine.health()), content_type="application/json"
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


def build_app(
    model,
    tokenizer,
    *,
    served_name: str,
    max_num_seqs: int,
    max_model_len: int,
    health_info: dict | Callable[[], dict] | None = None,
    log: logging.Logger | None = None,
) -> web.Application:
    """The aiohttp application serving MODEL: routes, limits, metrics. Its cleanup stops the worker threads."""
    log = log or _log
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be at least 2 (one prompt and one completion token), got {max_model_len}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and max_model_len > positions:
        log.warning(
            "max_model_len=%d exceeds the model's max_position_embeddings=%d: output beyond %d tokens "
            "may degrade; lower max_model_len unless the model is known to extrapolate",
            max_model_len, positions, positions,
        )
    try:
        vocab_size = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab_size = None
    engine = _Engine(
        tokenizer=tokenizer,
        runner=Runner(model, tokenizer, max_num_seqs),
        served_name=served_name,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
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
        runner = app[ENGINE].runner
        runner.cancel_all()
        await asyncio.to_thread(runner.join)

    app.on_cleanup.append(stop_workers)
    return app


# --- the process: listening, status, signals -------------------------------------


class ListenError(Exception):
    """The engine cannot take its listening address; the message says why and what to do."""


@dataclass
class _Listener:
    sock: socket.socket
    address: str
    owned_path: Path | None = None  # a Unix socket we bound: removed at shutdown if still ours
    inode: int | None = None

    def release_path(self) -> None:
        if self.owned_path is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if self.owned_path.lstat().st_ino == self.inode:
                self.owned_path.unlink()


def _listen_unix(path: str) -> _Listener:
    """Bind PATH as a 0600 Unix socket, replacing a stale socket but nothing else."""
    p = Path(path)
    try:
        mode = p.lstat().st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if stat.S_ISLNK(mode):
            raise ListenError(f"{path} is a symbolic link; the engine refuses to listen through a link. Remove it.")
        if not stat.S_ISSOCK(mode):
            raise ListenError(f"{path} exists and is not a socket; the engine will not replace it. Remove it "
                              f"or choose another socket path.")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                p.unlink()  # stale: its server is gone
            else:
                raise ListenError(f"another process is already serving on {path}; stop it before starting this engine")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)  # before listen(): nobody can connect in between
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return _Listener(sock, f"unix:{path}", owned_path=p, inode=p.lstat().st_ino)


def _check_listen_args(unix_path, sock, host, port) -> None:
    given = [name for name, value in (("unix_path", unix_path), ("sock", sock), ("host/port", host or port))
             if value is not None]
    if len(given) != 1:
        raise ValueError(f"pass exactly one of unix_path, sock, or host and port; got {given or 'none'}")
    if (host is None) != (port is None):
        raise ValueError(f"host and port go together; got host={host!r}, port={port!r}")


def _listener(unix_path, sock, host, port, log) -> _Listener:
    if unix_path is not None:
        return _listen_unix(unix_path)
    if sock is not None:
        name = sock.getsockname()
        return _Listener(sock, f"unix:{name}" if sock.family == socket.AF_UNIX else f"{name}")
    log.warning("listening on TCP %s:%s: anyone who can reach it can use the model; the engine's own "
                "address is a private Unix socket", host, port)
    return _Listener(socket.create_server((host, port), backlog=socket.SOMAXCONN), f"http://{host}:{port}")


class _StatusLine:
    """Hands a one-line status to a callback when it changes, at most about once per interval."""

    def __init__(self, callback: Callable[[str], None] | None, log: logging.Logger, interval: float) -> None:
        self._callback = callback
        self._log = log
        self._interval = interval
        self._wanted: str | None = None
        self._shown: str | None = None
        self._last = float("-inf")
        self._timer: asyncio.TimerHandle | None = None

    def set(self, text: str, *, now: bool = False) -> None:
        self._wanted = text
        if self._callback is None or (self._timer is not None and not now):
            return  # nothing to call, or a pending report will carry the latest text
        loop = asyncio.get_running_loop()
        wait = self._last + self._interval - loop.time()
        if now or wait <= 0:
            self._emit()
        else:
            self._timer = loop.call_later(wait, self._emit)

    def _emit(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._wanted == self._shown:
            return
        self._shown = self._wanted
        self._last = asyncio.get_running_loop().time()
        try:
            self._callback(self._shown)
        except Exception:
            self._log.exception("the on_status callback failed")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def run_server(
    model,
    tokenizer,
    *,
    served_name: str,
    max_num_seqs: int,
    max_model_len: int,
    shutdown_timeout: float,
    unix_path: str | None = None,
    sock: "socket.socket | None" = None,
    host: str | None = None,
    port: int | None = None,
    on_ready: "Callable[[], None] | None" = None,
    on_status: "Callable[[str], None] | None" = None,
    health_info: "dict | Callable[[], dict] | None" = None,
    log: logging.Logger | None = None,
) -> int:
    """Serve MODEL until SIGTERM or SIGINT; returns the process exit code.

    Listens on exactly one of: ``unix_path`` (bound here, 0600, a stale socket
    replaced), ``sock`` (already bound, e.g. from systemd), or ``host`` and
    ``port`` (by hand). Warms the model up first; ``on_ready`` is called once
    the socket is listening and the model has generated, ``on_status`` with a
    one-line summary when it changes (about once a second at most). Must run
    on the main thread (signal handlers).
    """
    log = log or _log
    _check_listen_args(unix_path, sock, host, port)
    return asyncio.run(_serve(
        model, tokenizer, served_name=served_name, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        shutdown_timeout=shutdown_timeout, listen=(unix_path, sock, host, port), on_ready=on_ready,
        status=_StatusLine(on_status, log, STATUS_INTERVAL_S), health_info=health_info, log=log,
    ))


async def _serve(model, tokenizer, *, served_name, max_num_seqs, max_model_len, shutdown_timeout, listen,
                 on_ready, status: _StatusLine, health_info, log: logging.Logger) -> int:
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if not stop.is_set():
            log.info("%s received: shutting down gracefully (up to %gs for requests in flight)", name,
                     shutdown_timeout)
            stop.set()
        else:
            log.warning("%s received again: cancelling requests in flight now", name)
            hurry.set()

    handled = (signal.SIGTERM, signal.SIGINT)
    for signum in handled:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        status.set("warming up", now=True)
        try:
            await asyncio.to_thread(warm_up, model, tokenizer)
        except Exception:
            log.exception("the warm-up generation failed, so the model cannot serve; check the checkpoint, "
                          "its dtype and the device")
            return 1
        if stop.is_set():
            log.info("stopped before serving")
            return 0

        app = build_app(model, tokenizer, served_name=served_name, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, health_info=health_info, log=log)
        engine = app[ENGINE]
        engine.on_change = lambda: status.set(engine.summary())
        runner = web.AppRunner(app, handle_signals=False, access_log=None, handler_cancellation=True,
                               shutdown_timeout=CANCEL_GRACE_S)
        await runner.setup()
        try:
            listener = _listener(*listen, log)
        except (ListenError, OSError) as error:
            log.error("cannot listen: %s", error)
            await runner.cleanup()
            return 1
        site = web.SockSite(runner, listener.sock)
        await site.start()
        log.info("serving %s on %s (max_num_seqs=%d, max_model_len=%d)", served_name, listener.address,
                 max_num_seqs, max_model_len)
        if on_ready is not None:
            try:
                on_ready()
            except Exception:
                log.exception("the on_ready callback failed")
        status.set(engine.summary(), now=True)

        await stop.wait()

        engine.draining = True
        status.set(engine.summary(), now=True)
        await site.stop()  # closes the listening socket; open connections stay
        listener.release_path()
        if engine.in_flight:
            log.info("waiting for %d request(s) in flight", engine.in_flight)
        if not await _wait_idle(engine, shutdown_timeout, hurry):
            log.warning("%d request(s) still in flight after %gs; cancelling them", engine.in_flight,
                        shutdown_timeout)
            engine.runner.cancel_all()
        await runner.cleanup()  # closes connections, then stops the worker threads
        status.set("stopped", now=True)
        log.info("stopped")
        return 0
    finally:
        status.close()
        for signum in handled:
            loop.remove_signal_handler(signum)


async def _wait_idle(engine: _Engine, timeout: float, hurry: asyncio.Event) -> bool:
    """Wait until no generation request is in flight; False on timeout or a second signal."""
    if engine.in_flight == 0:
        return True
    idle = asyncio.ensure_future(engine.idle.wait())
    hurried = asyncio.ensure_future(hurry.wait())
    done, pending = await asyncio.wait({idle, hurried}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return idle in done
