"""The OpenAI wire format of the builtin engine: request, response and error shapes.

One job: say what a valid OpenAI completions or chat completions request is
for this engine, and how its answers and errors look, so that the application
(app.py) only decides what to do with a request. Nothing here touches the
model, the tokenizer or a socket.

Trust: request bodies come from the engine's peers (the gateway, the manager,
root) and are still validated field by field: a malformed one costs a 400 in
OpenAI's error format, never the process. Fields this engine does not
implement are refused (REFUSED_FIELDS) rather than silently ignored.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from aiohttp import web

from hostd.engine.generate import SamplingParams

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
GENERATION_PATHS = (COMPLETIONS, CHAT_COMPLETIONS)

RETRY_AFTER_S = 5  # what a 503 during shutdown tells clients; a restarted engine is usually up by then


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
            status=self.status, body=encode(self.body()), content_type="application/json", headers=self.headers
        )


def shutting_down_error(what: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"{what}: the engine is shutting down. Retry in a few seconds; a restarted engine will take it.",
        type="server_error",
        code="engine_shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"},
    )


def encode(value: Any) -> bytes:
    return msgspec.json.encode(value)


# Characters JSON leaves raw but Python's str.splitlines (and the line
# iterators of some HTTP clients built on it) takes for line ends: raw inside an
# SSE data line, they cut the JSON mid-string. Their UTF-8 bytes occur nowhere
# else in UTF-8, so replacing the bytes escapes exactly these characters.
_SSE_ESCAPES = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def sse_event(value: Any) -> bytes:
    """VALUE as one server-sent event: a data line of JSON that every line splitter reads as one line."""
    data = encode(value)
    for raw, escaped in _SSE_ESCAPES:
        data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


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


# Stop strings: each generated token's text is searched for every one of them on
# the event loop (generate.TextDecoder), so one request with a million of them
# stalls every stream. OpenAI's API documents up to 4; 16 leaves room for
# clients that send a few more, and keeps the per-token search small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096  # all of one request's stop strings together

# A chat's role goes into the template as text, and each message adds the
# template's delimiters even when empty: an unbounded role (30 MiB) or a
# million empty messages cost a preparation thread minutes while counting as
# no content. Roles are short words (system, user, assistant, tool,
# developer); OpenAI's API takes at most 2048 messages.
MAX_ROLE_CHARS = 64
MAX_MESSAGES = 2048


# A request is decoded straight into its type (msgspec, in C): every cap
# holds while decoding, a field no type names is skipped without being
# built, and a refused field is kept as its raw JSON (msgspec.Raw) and
# decoded for its check only when it is this short: every value such a field
# accepts ("off": null, false, 0, "", [], {}, 1, {"type": "text"}) is.
# Decoding the body into generic Python objects first cost 8.4 s of the only
# event loop for 31 MiB of empty lists (issue 52).
REFUSED_VALUE_BYTES = 64
MAX_CONTENT_PARTS = 2048  # of one chat message


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


# REFUSED_FIELDS, each as its raw JSON (empty: not sent): made from that
# table, so a field refused is a field kept raw.
RefusedFields = msgspec.defstruct("RefusedFields", [(name, msgspec.Raw, msgspec.Raw()) for name in REFUSED_FIELDS],
                                  kw_only=True)


class CommonFields(RefusedFields, kw_only=True):
    model: str | None = None  # optional for by-hand use: the one served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's extension, for benchmarks and tests


class CompletionRequest(CommonFields, kw_only=True):
    # A string, [string], [token ids] or [[token ids]] (their checks: prepare.py);
    # nothing deeper is even decoded.
    prompt: str | list[str | int | list[int]]


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: Annotated[str, msgspec.Meta(max_length=MAX_ROLE_CHARS)]
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_CONTENT_PARTS)] | None = None


class ChatRequest(CommonFields, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = None


_DECODERS = {kind: msgspec.json.Decoder(kind) for kind in (CompletionRequest, ChatRequest)}
_PATH_PARAM = re.compile(r"at `\$\.(\w+)|missing required field `(\w+)`")
_JSON_KINDS = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean", ord("f"): "boolean",
               ord("n"): "null"}


def _refused(name: str, raw: msgspec.Raw, why: str) -> OpenAIError:
    """The refusal of field NAME: its JSON type and size, never its value."""
    first = memoryview(raw)[:1].tobytes()
    kind = _JSON_KINDS.get(first[0], "number") if first else "null"
    return OpenAIError(
        400,
        f"'{name}' (a JSON {kind} of {len(raw)} bytes) is not supported by the builtin engine: {why}. "
        f"Remove the field, or serve this model with the vllm or sglang backend.",
        param=name,
        code="unsupported_parameter",
    )


def decode_request(body: bytes, kind: type) -> Any:
    """BODY decoded as KIND (CompletionRequest, ChatRequest); OpenAIError 400
    naming the field for anything else: not JSON, nested too deeply, a field
    of the wrong type or over its cap, a refused field set."""
    try:
        request = _DECODERS[kind].decode(body)
    except msgspec.ValidationError as error:
        match = _PATH_PARAM.search(str(error))
        param = (match.group(1) or match.group(2)) if match else None
        raise OpenAIError(400, f"invalid request: {error}; send one JSON object", param=param) from None
    except msgspec.DecodeError as error:
        raise OpenAIError(400, f"the request body is not valid JSON ({error}); send one JSON object") from None
    except RecursionError:
        raise OpenAIError(400, "the request body is nested too deeply; send one JSON object") from None
    for name, (accepted, why) in REFUSED_FIELDS.items():
        raw = getattr(request, name)
        if not len(raw):
            continue
        if len(raw) > REFUSED_VALUE_BYTES or not accepted(msgspec.json.decode(raw)):
            raise _refused(name, raw, why)
    return request


def body_too_large(size: int | str, limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"the request body is {size} bytes; this engine takes at most {limit} (what a request that fits "
        "in its max_model_len can take to write): shorten the prompt or messages",
        code="body_too_large", headers={"Connection": "close"})


async def read_request(request: web.Request, kind: type, limit: int, log=None) -> Any:
    """The request's body as KIND, refused by its length when over LIMIT
    bytes (413, unread); a refusal is one line in LOG (the journal)."""
    try:
        length = request.content_length
        if length is not None and length > limit:
            raise body_too_large(length, limit)
        try:
            body = await request.read()  # the application's client_max_size is LIMIT: a chunked body stops there
        except web.HTTPRequestEntityTooLarge:
            raise body_too_large(f"more than {limit}", limit) from None
        return decode_request(body, kind)
    except OpenAIError as error:
        if log is not None:
            log.info("%s: refused a request body: %.300s", request.path, error.message)
        raise


@dataclass(frozen=True)
class Job:
    """One validated generation request."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))


# --- OpenAI wire format: responses -------------------------------------------


class CompletionFormat:
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


class ChatFormat:
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


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(job: Job, obj: str, choices: list[dict], served_name: str) -> dict:
    return {"id": job.id, "object": obj, "created": job.created, "model": served_name, "choices": choices}

