"""The builtin engine's OpenAI API, end to end.

Each engine is a real process serving a tiny random Qwen2 checkpoint on a Unix
socket; the tests talk to it over real HTTP with the official openai client
(and plain httpx2 for /health and /metrics) and assert what a client sees:
responses, error codes, the socket's mode, the process's exit code, metrics.

The random model seldom emits its end-of-sequence token, so every request
bounds its output with max_tokens. The launcher can slow each model step down
(``step_delay``) so that requests overlap for as long as a test needs; no
assertion depends on how fast anything runs (timeouts are safety nets only).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHECKOUT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
PROMPT = "Once upon a time there was a model"
SAFETY_TIMEOUT_S = 120  # nothing here should take near this long; it only keeps a broken run from hanging

# The engine process: load the checkpoint, serve it. It reports readiness by
# creating the file named in its arguments from on_ready, and each status line
# on stderr. step_delay sleeps before every model call, to make requests
# overlap in time.
_ENGINE_MAIN = textwrap.dedent("""
    import json, logging, sys, time
    from pathlib import Path
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from hostd.engine.server import Limits, run_server

    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    model = AutoModelForCausalLM.from_pretrained(args["checkpoint"])
    tokenizer = AutoTokenizer.from_pretrained(args["checkpoint"])
    if args.get("encode_gate"):
        # Encoding a text holding GATE waits until the file encode_gate exists
        # (on whichever thread encodes: the tests see whether that blocks the loop).
        cls, original = type(tokenizer), type(tokenizer).encode
        def gated_encode(self, text, *a, **kw):
            if isinstance(text, str) and "GATE" in text:
                Path(args["encode_gate"] + ".waiting").touch()
                while not Path(args["encode_gate"]).exists():
                    time.sleep(0.01)
            return original(self, text, *a, **kw)
        cls.encode = gated_encode
    if args["step_delay"]:
        forward = model.forward
        def slow_forward(*a, **kw):
            time.sleep(args["step_delay"])
            return forward(*a, **kw)
        model.forward = slow_forward
    limits = Limits(max_num_seqs=args["max_num_seqs"], max_model_len=args["max_model_len"],
                    shutdown_timeout=args["shutdown_timeout"])
    sys.exit(run_server(
        model, tokenizer, limits, served_name=args["name"],
        socket_path=args["socket"], on_ready=lambda: Path(args["ready"]).touch(),
        on_status=lambda line: print("STATUS:", line, file=sys.stderr, flush=True),
        health_info={"weights": "disk"},
    ))
""")


@dataclass
class Engine:
    proc: subprocess.Popen
    socket_path: Path
    log_path: Path

    def openai(self) -> openai.OpenAI:
        http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(self.socket_path)), timeout=SAFETY_TIMEOUT_S)
        return openai.OpenAI(base_url="http://engine/v1", api_key="unused", http_client=http, max_retries=0)

    def http(self) -> httpx2.Client:
        return httpx2.Client(transport=httpx2.HTTPTransport(uds=str(self.socket_path)), base_url="http://engine",
                             timeout=SAFETY_TIMEOUT_S)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        with self.http() as http:
            text = http.get("/metrics").raise_for_status().text
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(SAFETY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_engine(checkpoint: Path, workdir: Path, *, max_num_seqs: int, max_model_len: int = 256,
                 shutdown_timeout: float = 60.0, step_delay: float = 0.0, encode_gate: str | None = None) -> Engine:
    """Launch an engine process on workdir/engine.sock and wait until its on_ready has run.

    The one place that knows how an engine process is made: today it loads
    the checkpoint with transformers; with the weight daemon it becomes
    ``hostd engine`` attached to the daemon.
    """
    workdir.chmod(0o700)
    args = {
        "checkpoint": str(checkpoint), "name": MODEL, "socket": str(workdir / "engine.sock"),
        "ready": str(workdir / "ready"), "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
        "shutdown_timeout": shutdown_timeout, "step_delay": step_delay, "encode_gate": encode_gate,
    }
    log_path = workdir / "engine.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENGINE_MAIN, json.dumps(args)], cwd=CHECKOUT, stdout=log, stderr=log,
            env={**os.environ, "PYTHONPATH": str(CHECKOUT)},
        )
    engine = Engine(proc, Path(args["socket"]), log_path)
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while not Path(args["ready"]).exists():
        if proc.poll() is not None:
            raise AssertionError(f"the engine exited with {proc.returncode} before ready:\n{engine.log()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the engine was not ready after {SAFETY_TIMEOUT_S} s:\n{engine.log()}")
        time.sleep(0.05)
    return engine


@pytest.fixture
def make_engine(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """Start engines with the given limits; each is stopped (and must exit 0) at teardown."""
    engines: list[Engine] = []

    def make(**limits) -> Engine:
        engines.append(start_engine(tiny_checkpoint, tmp_path_factory.mktemp("engine"), **limits))
        return engines[-1]

    yield make
    for engine in engines:
        assert engine.stop() == 0, engine.log()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    """One engine shared by the API tests: max_num_seqs=2, max_model_len=256, slowed a little."""
    shared = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("engine"), max_num_seqs=2, max_model_len=256,
                          step_delay=0.01)
    yield shared
    assert shared.stop() == 0, shared.log()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint: Path):
    """The checkpoint's tokenizer, read with the tokenizers library: an independent count of prompt tokens."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))


def chat_prompt_tokens(tokenizer, messages: list[dict]) -> int:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return len(tokenizer.encode(text + "<|im_start|>assistant\n", add_special_tokens=False).ids)


def check_usage(usage, prompt_tokens: int, max_tokens: int, finish_reason: str) -> None:
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish_reason == "length":
        assert usage.completion_tokens == max_tokens
    else:
        assert finish_reason == "stop" and 1 <= usage.completion_tokens <= max_tokens


def refuses_new_connections(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return True
    return False


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + SAFETY_TIMEOUT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


# --- the API -----------------------------------------------------------------------


def test_completions_greedy_is_deterministic_and_streams_the_same_text(engine: Engine, tokenizer):
    client = engine.openai()
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)

    first = client.completions.create(**request)
    second = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    assert first.object == "text_completion" and first.model == MODEL and first.id.startswith("cmpl-")
    [choice] = first.choices
    assert choice.index == 0 and choice.text
    assert second.choices[0].text == choice.text
    check_usage(first.usage, len(tokenizer.encode(PROMPT).ids), 16, choice.finish_reason)

    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason] == [choice.finish_reason]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage == first.usage
    assert len({c.id for c in chunks}) == 1 and all(c.object == "text_completion" for c in chunks)


def test_chat_completions_greedy_is_deterministic_and_streams_the_same_text(engine: Engine, tokenizer):
    client = engine.openai()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world"}]
    request = dict(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)

    first = client.chat.completions.create(**request)
    second = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))

    assert first.object == "chat.completion" and first.model == MODEL and first.id.startswith("chatcmpl-")
    [choice] = first.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert second.choices[0].message.content == choice.message.content
    check_usage(first.usage, chat_prompt_tokens(tokenizer, messages), 12, choice.finish_reason)

    *delta_chunks, usage_chunk = chunks
    assert delta_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in delta_chunks) == choice.message.content
    assert delta_chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert usage_chunk.choices == [] and usage_chunk.usage == first.usage
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_seeded_sampling_repeats_itself(engine: Engine):
    client = engine.openai()
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    assert client.completions.create(**request).choices[0].text == client.completions.create(**request).choices[0].text


def test_stop_string_ends_the_completion_before_it(engine: Engine):
    client = engine.openai()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    # Two characters from the middle, starting with a letter or digit: the first
    # must be held back until the second shows whether the stop string is complete.
    start = next((i for i, c in enumerate(full) if i > 0 and c.isalnum() and c != full[0]), None)
    assert start is not None, f"pick another prompt: no usable stop string in {full!r}"
    stop = full[start:start + 2]
    expected = full[:full.index(stop)]

    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)

    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens < 24
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_prompt_and_max_tokens_beyond_max_model_len_is_context_length_exceeded(engine: Engine):
    client = engine.openai()
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=256, temperature=0)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 300}],
                                       max_tokens=8, temperature=0)

    assert completion.value.code == "context_length_exceeded" and completion.value.param == "max_tokens"
    assert "256 tokens" in completion.value.message
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"


def test_work_is_bounded_before_it_is_done_prompts_too_long_to_fit_and_stop_strings(engine: Engine):
    client = engine.openai()
    with engine.http() as http:
        cap = http.get("/health").json()["max_body_bytes"]
    # Half the engine's body cap (a refusal by size is the next test's), and
    # many times what any tokenization of 256 tokens can hold.
    huge = "hello " * (cap // 12)
    with pytest.raises(openai.BadRequestError) as prompt:
        client.completions.create(model=MODEL, prompt=huge, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}], max_tokens=4)
    with pytest.raises(openai.BadRequestError) as many:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stop=[f"s{i}" for i in range(17)])
    with pytest.raises(openai.BadRequestError) as long_stop:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stop=["x" * 5000])

    # Refused unread: counted in characters, not tokens.
    assert prompt.value.code == "context_length_exceeded" and prompt.value.param == "prompt"
    assert f"{len(huge)} characters" in prompt.value.message
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
    # Capped while decoding (issue 52: msgspec's words): the 17th string is never built.
    assert many.value.param == "stop" and "length <= 16" in many.value.message
    assert long_stop.value.param == "stop" and "at most 4096" in long_stop.value.message
    sixteen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stop=[f"s{i}" for i in range(16)])
    assert sixteen.choices[0].finish_reason in ("length", "stop")


def test_tokenizing_a_prompt_leaves_the_event_loop_free_for_health(make_engine, tmp_path: Path):
    gate = tmp_path / "release-encoding"
    engine = make_engine(max_num_seqs=1, encode_gate=str(gate))
    answers: list = []

    def send() -> None:
        answers.append(engine.openai().completions.create(model=MODEL, prompt="GATE " + PROMPT, max_tokens=2))

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(lambda: Path(str(gate) + ".waiting").exists(), "the prompt's encoding has begun")
    with httpx2.Client(transport=httpx2.HTTPTransport(uds=str(engine.socket_path)), base_url="http://engine",
                       timeout=10) as http:
        health = http.get("/health")  # times out if encoding holds the loop
    assert health.status_code == 200 and not answers
    gate.touch()
    sender.join(SAFETY_TIMEOUT_S)
    assert answers and answers[0].choices[0].text is not None


def test_a_chat_is_counted_by_every_string_its_template_receives_and_one_token_a_message(engine: Engine):
    # Issue 33, H2: roles went into the template uncounted and unbounded, and
    # empty messages counted as nothing although each adds the template's delimiters.
    client = engine.openai()
    with pytest.raises(openai.BadRequestError) as long_role:
        client.chat.completions.create(model=MODEL, messages=[{"role": "u" * 65, "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as many:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}] * 2049, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as empty:  # 300 messages cannot fit in 256 tokens
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ""}] * 300, max_tokens=2)

    assert long_role.value.param == "messages" and "messages[0].role" in long_role.value.message
    assert "length <= 64" in long_role.value.message
    assert many.value.param == "messages" and "length <= 2048" in many.value.message
    assert empty.value.code == "context_length_exceeded" and "characters" in empty.value.message  # refused unread


def test_a_long_prompt_being_prepared_does_not_hold_up_a_short_one(make_engine, tmp_path: Path):
    # Issue 33, H2: one preparation thread let one client's long prompts stall everyone.
    gate = tmp_path / "release-encoding"
    engine = make_engine(max_num_seqs=2, max_model_len=4096, encode_gate=str(gate))
    answers: list = []
    long_prompt = "GATE " + "hello " * 1500  # over SHORT_PREPARE_CHARS, within what 4096 tokens can hold

    def send() -> None:
        answers.append(engine.openai().completions.create(model=MODEL, prompt=long_prompt, max_tokens=1))

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(lambda: Path(str(gate) + ".waiting").exists(), "the long prompt's encoding has begun")
    short = engine.openai().with_options(timeout=30).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert short.choices[0].text is not None and not answers  # answered while the long one still waits
    gate.touch()
    sender.join(SAFETY_TIMEOUT_S)
    assert answers and answers[0].usage.prompt_tokens > 1000


def test_an_encoded_body_is_never_inflated_by_the_engine(engine: Engine):
    # Issue 33, M3: the engine's server inflated gzip bodies (a 1 MB bomb is 1 GiB on its loop).
    import gzip

    body = gzip.compress(json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 2}).encode())
    with engine.http() as http:
        answer = http.post("/v1/completions", content=body,
                           headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert "not valid JSON" in answer.json()["error"]["message"]


def test_unknown_model_is_not_found_and_unsupported_fields_are_refused(engine: Engine):
    client = engine.openai()
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as two_choices:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, n=2)
    with pytest.raises(openai.BadRequestError) as logprobs:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True)

    assert unknown.value.code == "model_not_found" and f"'{MODEL}'" in unknown.value.message
    assert two_choices.value.param == "n"
    assert logprobs.value.param == "logprobs"


def test_hostile_bodies_are_refused_while_decoding_naming_the_field_and_echoing_nothing(engine: Engine):
    """Issue 52, H2 and S3: the body is decoded straight into the request type.
    Empty lists where messages belong, in an unknown field and in a refused
    one are refused with 400 (the refused field by name, its type and size,
    never its value: a 32 MiB logit_bias came back whole); a body nested too
    deeply is a 400 and one journal line, not a 500 and a traceback."""
    lists = b"[" + b"[]," * 200_000 + b"[]]"  # 600 KB: under this model's body cap (the next test's)
    chat = b'{"model": "%s", "max_tokens": 2, ' % MODEL.encode()
    bodies = {
        "messages": chat + b'"messages": ' + lists + b"}",
        "unknown": chat + b'"messages": [{"role": "user", "content": "hi"}], "later_field": ' + lists + b"}",
        "logit_bias": chat + b'"messages": [{"role": "user", "content": "hi"}], "logit_bias": ' + lists + b"}",
        "deep": chat + b'"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 100_000 + b"]" * 100_000
        + b"}",
    }
    answers = {}
    with engine.http() as http:
        for name, body in bodies.items():
            answers[name] = http.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert answers["messages"].status_code == 400 and answers["messages"].json()["error"]["param"] == "messages"
    assert answers["unknown"].status_code == 200  # an unknown field is skipped, never built
    refused = answers["logit_bias"].json()["error"]
    assert answers["logit_bias"].status_code == 400 and refused["param"] == "logit_bias"
    assert refused["code"] == "unsupported_parameter" and f"a JSON array of {len(lists)} bytes" in refused["message"]
    assert len(answers["logit_bias"].content) < 1000  # the value is not echoed
    assert answers["deep"].status_code == 400 and "nested too deeply" in answers["deep"].json()["error"]["message"]
    log = engine.log()
    assert "refused a request body: the request body is nested too deeply" in log and "Traceback" not in log


def test_a_body_larger_than_a_request_of_this_model_can_take_is_refused_by_its_length_unread(engine: Engine,
                                                                                            tokenizer):
    """Issue 52: the engine's body cap follows from the model. The longest
    prompt its character bound lets through (max_model_len times the longest
    token), every character written as an escaped surrogate pair (12 bytes),
    fits under it, and is answered for what it is (too many tokens); a body one
    byte over it is 413 by its Content-Length, and a chunked one over it 413
    too, both naming the cap."""
    with engine.http() as http:
        cap = http.get("/health").json()["max_body_bytes"]
        longest = max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))
        prompt = "\U0001F600" * (256 * longest)
        widest = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()  # ensure_ascii
        assert len(widest) >= 12 * 256 * longest and len(widest) <= cap < 32 << 20
        fits = http.post("/v1/completions", content=widest, headers={"Content-Type": "application/json"})
        padded = b'{"model": "%s", "prompt": "hi", "max_tokens": 1}' % MODEL.encode()
        over = padded + b" " * (cap + 1 - len(padded))
        too_large = http.post("/v1/completions", content=over, headers={"Content-Type": "application/json"})
        chunked = http.post("/v1/completions", content=iter([over[:cap // 2], over[cap // 2:]]),
                            headers={"Content-Type": "application/json"})
        after = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})

    assert fits.status_code == 400 and fits.json()["error"]["code"] == "context_length_exceeded", fits.text[:300]
    for refused, size in ((too_large, str(cap + 1)), (chunked, f"more than {cap}")):
        assert refused.status_code == 413, refused.text[:300]
        error = refused.json()["error"]
        assert error["code"] == "body_too_large" and f"is {size} bytes; this engine takes at most {cap}" in error["message"]
    assert after.status_code == 200, after.text
    assert "refused a request body: the request body is" in engine.log()


def test_models_health_and_a_private_socket(engine: Engine):
    assert [m.id for m in engine.openai().models.list().data] == [MODEL]
    with engine.http() as http:
        health = http.get("/health")
    expected = {"status": "ok", "model": MODEL, "max_num_seqs": 2, "max_model_len": 256, "weights": "disk"}
    assert health.status_code == 200
    assert {key: health.json().get(key) for key in expected} == expected  # weights: from health_info (an EngineHealth field)
    assert stat.S_IMODE(engine.socket_path.stat().st_mode) == 0o600
    assert "STATUS: serving: 0 running, 0 waiting" in engine.log()


def test_max_num_seqs_makes_excess_requests_wait_and_rejects_none(engine: Engine):
    before = engine.metrics()
    clients = [engine.openai() for _ in range(6)]
    start = threading.Barrier(len(clients))
    results: list = [None] * len(clients)

    def stream(i: int) -> None:
        start.wait()
        chunks = list(clients[i].completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
        results[i] = chunks[-1].usage

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SAFETY_TIMEOUT_S)
    after = engine.metrics()

    assert all(usage is not None and usage.completion_tokens > 0 for usage in results)
    ok = ("hostd_engine_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    assert after[ok] - before.get(ok, 0) == 6
    assert {key for key in after if key[0] == "hostd_engine_requests_total" and after[key] != before.get(key)} == {ok}
    assert after[("hostd_engine_requests_running_max", ())] == 2  # the limit was reached, never passed
    assert after[("hostd_engine_requests_waiting_max", ())] >= 1  # the others waited their turn
    assert after[("hostd_engine_requests_running", ())] == 0


# --- one engine each ---------------------------------------------------------------------


def test_client_disconnect_mid_stream_stops_generation_and_frees_the_slot(make_engine):
    engine = make_engine(max_num_seqs=1, max_model_len=512, step_delay=0.02)
    client = engine.openai()

    abandoned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=400, temperature=0, stream=True)
    chunks = iter(abandoned)
    next(chunks), next(chunks)
    abandoned.close()
    # One slot: this waits until the abandoned generation has stopped.
    after = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    metrics = engine.metrics()

    assert after.usage.completion_tokens == 4
    assert metrics[("hostd_engine_generation_tokens_total", ())] < 400  # the 400-token stream was cut short
    assert metrics[("hostd_engine_requests_total", (("endpoint", "/v1/completions"), ("status", "499")))] == 1
    assert metrics[("hostd_engine_requests_running", ())] == 0


def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_and_exits_0(make_engine, tokenizer):
    engine = make_engine(max_num_seqs=2, step_delay=0.05, shutdown_timeout=60)
    client = engine.openai()
    idle = engine.http()
    assert idle.get("/health").status_code == 200  # a kept-alive connection, open before the signal

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = iter(stream)
    first = next(chunks)
    engine.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: refuses_new_connections(engine.socket_path), "the engine stops listening")
    health = idle.get("/health")
    refused = idle.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})  # then closed
    rest = list(chunks)

    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "engine_shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "shutting_down"
    *text_chunks, usage_chunk = [first, *rest]
    [finish] = [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason]
    check_usage(usage_chunk.usage, len(tokenizer.encode(PROMPT).ids), 40, finish)  # all of it, then [DONE]
    assert engine.proc.wait(SAFETY_TIMEOUT_S) == 0
    assert "waiting for 1 request(s) in flight" in engine.log()  # the stream was running when the signal came
    assert not engine.socket_path.exists()


def test_sigterm_cancels_streams_still_running_at_shutdown_timeout_and_exits_0(make_engine):
    engine = make_engine(max_num_seqs=1, step_delay=0.05, shutdown_timeout=0.5)
    client = engine.openai()

    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    engine.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError) as cancelled:
        list(chunks)

    assert "shutting down" in cancelled.value.message
    assert engine.proc.wait(SAFETY_TIMEOUT_S) == 0
    assert "still in flight after 0.5s; cancelling them" in engine.log()
