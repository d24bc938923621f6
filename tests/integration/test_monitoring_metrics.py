"""packaging/monitoring against a running model: every metric name of
hostd's (every name but the vLLM and SGLang rows' vllm:*/sglang:*, which
tests/upstream/test_dashboard_names.py checks against upstream's source),
and every label value an equality matcher asks for, in the shipped dashboard
and alert rules exists in the /metrics of a real gateway in front of a real
builtin engine on the tiny checkpoint; every series there names the model;
and the new series say what they
promise: hostd_build_info, the limits of the engine that runs (they follow
an engine restarted on new limits), the weights retained, time to first
token for streaming and whole answers, the engine's vLLM-style histograms."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

import hostd
from harness.local import ModelTree, free_port, wait_for
from tests.promql_names import (SYNTHETIC, dashboard_exprs, equality_matchers, exposed_names, names_in, rule_exprs,
                                upstream_kind)

# Matchers on label values that only an event this test cannot cause cheaply
# makes: the reason says which.
EVENT_ONLY = {
    ("hostd_gateway_refused_total", "status", "503"): "a full body budget (gateway.body_bytes_in_flight)",
}
# Matchers on label values that only another backend's model shows: the
# test that shows it says where.
OTHER_BACKEND = {
    ("hostd_limit", "key", "engine.max_running_requests"): "sglang's limit (test_upstream_doubles.py shows it)",
}


def serve(root: Path, checkpoint: Path):
    port = free_port()
    tree = ModelTree(root)
    tree.write_config(checkpoint, fixed={"listen": f"127.0.0.1:{port}"}, max_num_seqs=6)
    tree.start_serving(port)
    return tree


@pytest.fixture
def served(tmp_path: Path, tiny_checkpoint: Path):
    tree = serve(tmp_path, tiny_checkpoint)
    yield tree
    tree.stop_all()


@pytest.fixture(scope="module")
def after_traffic(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> str:
    """The /metrics of a model that answered traffic() once."""
    tree = serve(tmp_path_factory.mktemp("monitoring"), tiny_checkpoint)
    try:
        traffic(tree)
        yield scrape(tree)
    finally:
        tree.stop_all()


def scrape(tree: ModelTree) -> str:
    response = httpx.get(tree.base_url + "/metrics", timeout=30)
    response.raise_for_status()
    return response.text


def samples(text: str) -> list[tuple[str, dict, float]]:
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels) -> float:
    found = [v for n, l, v in samples(text) if n == name and all(l.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def traffic(tree: ModelTree) -> None:
    """What makes every series exist: a streaming chat, a whole completion,
    a 404, a 503 during a drain, and reloads ending failed and rolled back."""
    client = openai.OpenAI(base_url=tree.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    assert [c for c in stream if c.choices and c.choices[0].delta.content]
    client.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    assert httpx.get(tree.base_url + "/nowhere").status_code == 404
    client.models.list()  # answered 200 by a route that generates nothing: no time to first token
    for outcome in ("failed", "rolled-back"):
        tree.control("drain", timeout=10)
        assert httpx.get(tree.base_url + "/v1/models").status_code == 503
        tree.control("resume", outcome=outcome)
    wait_for(lambda: tree.control("status")["state"] == "serving", 30, "gateway serving again")


def test_every_metric_the_dashboard_and_the_rules_name_exists_in_a_running_models_metrics(after_traffic: str):
    text = after_traffic
    exposed = exposed_names(text)
    exprs = {**{f"rule {k}": v for k, v in rule_exprs().items()}, **dashboard_exprs()}
    missing = {where: sorted(n for n in names_in(expr) - exposed - SYNTHETIC if not upstream_kind(n))
               for where, expr in exprs.items()}
    assert not {k: v for k, v in missing.items() if v}, "named but not in /metrics"
    shown = samples(text)
    absent = []
    for where, expr in exprs.items():
        for name, label, wanted in equality_matchers(expr):
            values = {l.get(label) for n, l, _ in shown if n == name}
            if upstream_kind(name) or (name, label, wanted) in OTHER_BACKEND:
                continue
            if (name, label, wanted) in EVENT_ONLY:
                assert label in {k for n, l, _ in shown if n == name for k in l}, (where, name, label)
            elif wanted not in values:
                absent.append(f"{where}: {name}{{{label}={wanted!r}}} (shown: {sorted(v for v in values if v)})")
    assert not absent


def test_new_series_say_what_runs_and_time_to_first_token_counts_generating_answers_only(after_traffic: str):
    text = after_traffic
    info = [l for n, l, v in samples(text) if n == "hostd_build_info" and v == 1]
    assert info == [{"model": "tiny", "version": hostd.__version__, "backend": "builtin",
                     "upstream": "transformers", "upstream_version": transformers.__version__}]
    assert value(text, "hostd_limit", key="engine.max_num_seqs") == 6
    assert value(text, "hostd_limit", key="gateway.max_connections") == 1024
    assert value(text, "hostd_weights_retained") == 1
    # One stream, one whole completion, apart: the models list, the 404 and the 503s are not counted.
    assert value(text, "hostd_gateway_time_to_first_token_seconds_count", stream="true") == 1
    assert value(text, "hostd_gateway_time_to_first_token_seconds_count", stream="false") == 1
    assert value(text, "hostd_gateway_time_to_first_byte_seconds_count", status="200") == 3
    assert value(text, "hostd_engine_time_to_first_token_seconds_count") == 2
    assert value(text, "hostd_engine_e2e_request_latency_seconds_count") == 2
    # 4 + 3 tokens (the engine's warm-up counts in hostd_engine_generation_tokens_total only);
    # every token but each request's first has a time per output token.
    assert value(text, "hostd_engine_request_generation_tokens_sum") == 7
    assert value(text, "hostd_engine_request_prompt_tokens_count") == 2
    assert value(text, "hostd_engine_time_per_output_token_seconds_count") == 5
    assert value(text, "hostd_gateway_reload_duration_seconds_count", outcome="rolled-back") == 1


def test_every_series_of_the_page_names_the_model_the_gateways_and_the_engines(after_traffic: str):
    unnamed = sorted({n for n, l, _ in samples(after_traffic) if l.get("model") != "tiny"})
    assert not unnamed
    assert {n for n, _, _ in samples(after_traffic) if n.startswith("hostd_engine_")}


def test_the_engine_limits_shown_follow_an_engine_restarted_on_new_limits(served: ModelTree, tiny_checkpoint: Path):
    engine = next(d for d in served.daemons if "engine" in d.log_path.name)
    engine.stop()
    wait_for(lambda: "hostd_limit" in scrape(served) and
             'key="engine.max_num_seqs"' not in scrape(served), 30, "the engine's limits gone with it")
    text = scrape(served)
    assert value(text, "hostd_limit", key="gateway.max_connections") == 1024
    assert "hostd_weights_retained" not in exposed_names(text)
    served.write_config(tiny_checkpoint, fixed={"listen": served.base_url.removeprefix("http://")}, max_num_seqs=3)
    served.start_engine()
    wait_for(lambda: 'hostd_limit{key="engine.max_num_seqs",model="tiny"} 3.0' in scrape(served), 30,
             "the new engine's limit")
    assert value(scrape(served), "hostd_weights_retained") == 1
