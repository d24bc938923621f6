"""A generation request's preparation: the checks done before any work, tokenizing, the Job.

One job: turn a decoded completions or chat request (openai_api.py's types)
into a Job that fits the engine's max_model_len, or an OpenAIError saying
which field to change. Work is bounded before it is done, and never done on
the event loop: a prompt (or a chat's messages) longer in characters than
``max_model_len`` times the tokenizer's longest token cannot fit and is
refused unread (a chat counts every string its template receives, roles
included, and at least one token per message); tokenizing and applying the
chat template run on two preparation lanes, each a thread with its own copy
of the tokenizer (Hugging Face tokenizers are not thread-safe; the loop's
copy decodes completions): texts up to SHORT_PREPARE_CHARS on one, longer
ones on the other, so that one client's long prompts never hold up
everyone's short ones. Stop strings are capped in count (while decoding:
openai_api.MAX_STOP_STRINGS) and total length (here: MAX_STOP_CHARS), since
each generated token is checked against all of them on the loop.

Trusts nothing of the request: every field it reads was typed by
openai_api.read_request, and every size is checked here before it costs.
"""

from __future__ import annotations

import asyncio
import copy
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hostd.engine.generate import SamplingParams
from hostd.engine.openai_api import (
    COMPLETIONS,
    ChatMessage,
    CommonFields,
    Job,
    MAX_STOP_CHARS,
    OpenAIError,
)

# Texts up to this many characters are prepared on the short lane: any tokenizer
# and template takes milliseconds for them, so a queue of long prompts (each up to
# max_model_len times the longest token, seconds of work) cannot stall them.
SHORT_PREPARE_CHARS = 8192

# The largest request body this engine reads (issue 52): what a request that
# can fit in max_model_len takes to write. Every character the checks below
# count (at most max_prompt_chars) is at most 12 bytes of JSON (one beyond
# U+FFFF, escaped as a surrogate pair: \ud83d\ude00); each token's worth of
# structure around it (a message object, a content part, a token id with its
# comma, indentation) at most BODY_BYTES_PER_TOKEN; the other fields
# (sampling, stop strings, the model's name) at most BODY_FIELDS_BYTES. A
# body over that holds more than the model can take, and is refused by its
# length before it is read. Without a vocabulary to measure: BODY_CEILING.
JSON_BYTES_PER_CHAR = 12
BODY_BYTES_PER_TOKEN = 128
BODY_FIELDS_BYTES = 1 << 20
BODY_CEILING = 64 << 20


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


def max_body_bytes(max_prompt_chars: int | None, max_model_len: int) -> int:
    """The largest body a request that fits in MAX_MODEL_LEN tokens takes to
    write (the comment above BODY_CEILING); BODY_CEILING at most."""
    if max_prompt_chars is None:
        return BODY_CEILING
    need = max_prompt_chars * JSON_BYTES_PER_CHAR + max_model_len * BODY_BYTES_PER_TOKEN + BODY_FIELDS_BYTES
    return min(need, BODY_CEILING)


class _PrepareLane:
    """One preparation thread and the copy of the tokenizer only it uses."""

    def __init__(self, tokenizer, name: str) -> None:
        self.tokenizer = copy.deepcopy(tokenizer)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def close(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)



class Preparer:
    """The checks and the tokenizing of one engine's requests: its tokenizer
    (a copy per lane), its max_model_len, its served name and vocabulary size."""

    def __init__(self, tokenizer, max_model_len: int, served_name: str, vocab_size: int | None) -> None:
        self.max_model_len, self.served_name, self.vocab_size = max_model_len, served_name, vocab_size
        # Each lane's own tokenizer: the loop's decodes completions meanwhile.
        self._short_lane = _PrepareLane(tokenizer, "hostd-prepare-short")
        self._long_lane = _PrepareLane(tokenizer, "hostd-prepare-long")
        self.longest_token = longest_token_chars(tokenizer)
        self.max_prompt_chars = None if self.longest_token is None else max_model_len * self.longest_token
        self.max_body_bytes = max_body_bytes(self.max_prompt_chars, max_model_len)

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
            limit = self.max_model_len
            raise OpenAIError(
                400,
                f"This model's maximum context length is {limit} tokens, and your {what} is {chars} characters "
                f"long: more than {limit} tokens of this model's tokenizer can hold ({bound} characters). "
                f"Shorten the {what}.",
                param=param, code="context_length_exceeded",
            )

    def check_stop(self, stop: str | list[str] | None) -> None:
        """Stop strings are checked against the completion at every token, on the loop: bounded."""
        # Their count is capped while decoding (openai_api.MAX_STOP_STRINGS).
        stops = [stop] if isinstance(stop, str) else list(stop or ())
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
        return Job(
            id=fmt.id_prefix + uuid.uuid4().hex,
            prompt_ids=prompt_ids, params=params, stream=bool(body.stream), include_usage=include_usage,
        )
