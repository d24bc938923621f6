"""The gateway's time to first token finds the first SSE event that carries
a token (not the headers, not a chat's opening event), the model's facts
follow the serving engine's /health, every series of the page (the
gateway's and the engine's) names the model, and the builtin engine's
latency histograms count what vLLM's count."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry

from hostd.engine.latency import Latency, RequestClock, token_buckets
from hostd.engine.health import EngineHealth
from hostd.gateway.metrics import FirstToken, Metrics, ModelFacts, engine_families


def event(body) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


CHAT_OPENING = event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
CHAT_TOKEN = event({"choices": [{"index": 0, "delta": {"content": "Hi"}}]})


def test_a_chat_streams_first_token_is_its_first_content_not_its_opening_event():
    scan = FirstToken()
    assert not scan.feed(CHAT_OPENING)
    assert not scan.feed(CHAT_TOKEN[:9])  # an event split across chunks
    assert scan.feed(CHAT_TOKEN[9:])
    assert not scan.feed(CHAT_TOKEN)  # once only


def test_a_completions_text_reasoning_and_tool_calls_carry_tokens_done_and_empty_text_do_not():
    for carrying in ({"choices": [{"text": "a"}]}, {"choices": [{"delta": {"reasoning_content": "so"}}]},
                     {"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}):
        assert FirstToken().feed(event(carrying))
    scan = FirstToken()
    assert not scan.feed(event({"choices": [{"text": "", "finish_reason": "length"}]}) + b"data: [DONE]\n\n")
    assert not scan.feed(b": a comment\r\n\r\ndata: not json\r\n\r\n")
    assert scan.feed(b"data: " + json.dumps({"choices": [{"text": "x"}]}).encode() + b"\r\n\r\n")


def test_a_stream_without_an_event_boundary_is_read_up_to_the_limit_only():
    scan = FirstToken()
    assert not scan.feed(b"data: " + b"x" * (FirstToken.LIMIT + 1))
    assert scan.done and not scan.buffer
    assert not scan.feed(CHAT_TOKEN)


def samples(metrics: Metrics) -> dict[str, float]:
    """{name + its labels but model: value}; every sample's model is "m"."""
    out = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model") == "m", s
            out[s.name + json.dumps(labels, sort_keys=True)] = s.value
    return out


def test_every_series_names_the_model_and_time_to_first_token_says_whether_it_streamed():
    gauges = {"hostd_gateway_in_flight": ("", lambda: 0)}
    metrics = Metrics(gauges, ModelFacts("m", "vllm", "vllm", {}))
    metrics.first_token(True, 0.2)
    metrics.first_token(False, 3.0)
    metrics.rejected.labels("draining").inc()
    shown = samples(metrics)  # asserts model="m" on every sample
    assert shown['hostd_gateway_time_to_first_token_seconds_count{"stream": "true"}'] == 1
    assert shown['hostd_gateway_time_to_first_token_seconds_sum{"stream": "false"}'] == 3.0
    assert shown['hostd_gateway_rejected_total{"reason": "draining"}'] == 1
    assert any(k.startswith("hostd_build_info") for k in shown)
    # The engine's families, relayed: model="m" added to each, an engine's own model label replaced.
    engine = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="served"} 2.0\n'
              '# TYPE vllm:e2e_request_latency_seconds histogram\n'
              'vllm:e2e_request_latency_seconds_bucket{le="+Inf",model="other"} 1.0\n'
              'vllm:e2e_request_latency_seconds_count{model="other"} 1.0\n'
              'vllm:e2e_request_latency_seconds_sum{model="other"} 0.5\n'
              '# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.0\n')
    relayed = engine_families(engine, ("vllm:",), "m")
    assert 'vllm:num_requests_running{model="m",model_name="served"} 2.0' in relayed
    assert 'vllm:e2e_request_latency_seconds_count{model="m"} 1.0' in relayed
    assert "process_cpu" not in relayed and "other" not in relayed
    assert engine_families("not { a page", ("vllm:",), "m") == ""


def test_model_facts_show_the_serving_engines_limits_and_weights_and_keep_its_upstream_version():
    facts = ModelFacts("m", "builtin", "transformers", {"max_connections": 1024.0})
    metrics = Metrics({}, facts)
    facts.update(EngineHealth(engine_config={"max_num_seqs": 8, "enforce_eager": True, "kv_cache_mib": None,
                                             "shutdown_timeout": 30.0, "batching": "continuous"},
                              weights="daemon", upstream_version="5.0.0"))
    shown = samples(metrics)
    assert shown['hostd_limit{"key": "engine.max_num_seqs"}'] == 8
    assert shown['hostd_limit{"key": "engine.shutdown_timeout"}'] == 30
    assert shown['hostd_limit{"key": "gateway.max_connections"}'] == 1024
    assert not [k for k in shown if "enforce_eager" in k or "kv_cache_mib" in k or "batching" in k]
    assert shown["hostd_weights_retained{}"] == 1
    info = [k for k in shown if k.startswith("hostd_build_info")]
    assert len(info) == 1 and '"upstream_version": "5.0.0"' in info[0] and '"backend": "builtin"' in info[0]
    facts.update(None)  # the engine does not answer: its limits and weights are not known
    shown = samples(metrics)
    assert 'hostd_limit{"key": "engine.max_num_seqs"}' not in shown and "hostd_weights_retained{}" not in shown
    assert shown['hostd_limit{"key": "gateway.max_connections"}'] == 1024
    assert any('"upstream_version": "5.0.0"' in k for k in shown)
    facts.update(EngineHealth(engine_config={}, weights="disk"))
    assert samples(metrics)["hostd_weights_retained{}"] == 0


def test_the_engines_clock_observes_one_ttft_a_tpot_per_later_token_and_the_finished_request():
    latency = Latency(CollectorRegistry(), max_model_len=64)
    clock = RequestClock(latency, arrived=0.0, prompt_tokens=5)
    clock.tokens(0)  # a delta without a token (the chat's opening)
    clock.tokens(1)
    clock.tokens(1)
    clock.tokens(4)  # three tokens in one delta share its gap
    clock.finished()
    assert latency.ttft._sum.get() > 0 and sum(b.get() for b in latency.ttft._buckets) == 1
    assert sum(b.get() for b in latency.tpot._buckets) == 3
    assert sum(b.get() for b in latency.e2e._buckets) == 1
    assert latency.prompt_tokens._sum.get() == 5 and latency.generation_tokens._sum.get() == 4


def test_token_buckets_are_vllms_1_2_5_steps_up_to_max_model_len():
    assert token_buckets(64) == (1, 2, 5, 10, 20, 50)
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_the_gpus_the_generator_resolved_are_series_that_join_with_dcgm_exporters_uuid_label():
    """Issue 55, item 3: HOSTD_GPUS (the generator's NVML reading, in the
    gateway's environment) becomes hostd_gpu_info, one series a GPU, with
    DCGM-exporter's label names; none without it (no GPU, no NVML)."""
    whole, parent, mig = ("GPU-8f3e0000-0000-4000-8000-000000000000", "GPU-8f3e0000-0000-4000-8000-000000000001",
                          "MIG-5a1b2c3d-0000-4000-8000-00000000abcd")
    facts = ModelFacts("m", "vllm", "vllm", {}, f"0/{whole}//,1/{parent}/{mig}/3")
    shown = samples(Metrics({}, facts))
    assert shown['hostd_gpu_info{"GPU_I_ID": "", "UUID": "%s", "gpu": "0", "mig_uuid": ""}' % whole] == 1
    assert shown['hostd_gpu_info{"GPU_I_ID": "3", "UUID": "%s", "gpu": "1", "mig_uuid": "%s"}' % (parent, mig)] == 1
    assert not [k for k in samples(Metrics({}, ModelFacts("m", "vllm", "vllm", {}))) if "gpu_info" in k]
