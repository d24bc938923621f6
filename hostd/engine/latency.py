"""The builtin engine's Prometheus families: latency histograms and the runner's gauges.

One job: what GET /metrics of the builtin engine exports, under hostd_engine_
names that mean what vLLM's vllm: families mean, so one dashboard reads
both. Reads the engine's counters at scrape time; trusts nothing from a
client (a request only advances its own RequestClock).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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



class RunnerCollector:
    """Exports the runner's counters and the engine's limits at scrape time."""

    def __init__(self, engine) -> None:  # app.Engine, handed in (no import back)
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
