"""The gateway's Prometheus metrics, and the engine's, on one public /metrics.

One job: own every series the public /metrics shows. The gateway's own
series (hostd_gateway_*) live in this process, so they keep counting across
engine restarts and reloads. The model's facts (hostd_build_info,
hostd_limit, hostd_weights_retained: ModelFacts) are read at scrape time
from the gateway's config and the serving engine's /health, so a limit
gauge shows what the running engine runs, before and after a reload. The engine's series are fetched from the
engine's /metrics at scrape time and passed through unchanged, restricted to
the families its backend declares as its own (METRICS_PREFIXES: vllm:*,
sglang:*, hostd_engine_*): the engine's process_* and python_* series would
otherwise collide with nothing but mean another process.

Every series of the page carries model="NAME", the model's name (the NAME
of model@NAME, hostd_build_info's): the gateway's own through its registry
(ModelRegistry), the engine's added as they pass (engine_families), so one
dashboard and one set of alerts select a model by the same label whatever
its engine (vLLM's own model_name label is its served model name, which may
differ). A label the engine calls model itself is replaced. An engine counter
starts again from zero with a new engine, which Prometheus' rate() reads as
a counter reset; only one engine is scraped at a time, so two engines'
series never mix.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

import hostd
from hostd.engine import health as engine_health
from hostd.engine.health import EngineHealth

# Request durations of an LLM API: milliseconds (model info, tokenize) to
# minutes (long generations).
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Reloads: a drain plus an engine restart, seconds to tens of minutes.
RELOAD_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


MODEL_LABEL = "model"


def with_model(family: Metric, model: str) -> Metric:
    """FAMILY with MODEL_LABEL=MODEL on every sample (replacing one it had)."""
    labelled = Metric(family.name, family.documentation, family.type, family.unit)
    labelled.samples = [s._replace(labels={**s.labels, MODEL_LABEL: model}) for s in family.samples]
    return labelled


class ModelRegistry(CollectorRegistry):
    """A registry whose every sample carries model=MODEL: a constant label,
    which prometheus-client's metrics have no argument for."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model = model

    def collect(self):
        for family in super().collect():
            yield with_model(family, self.model)


class Metrics:
    """The gateway's own series; with FACTS, the model's, and every series
    labelled with FACTS' model (ModelRegistry)."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]], facts: Optional["ModelFacts"] = None):
        self.registry = ModelRegistry(facts.model) if facts is not None else CollectorRegistry()
        r = self.registry
        self.facts = facts
        if facts is not None:
            r.register(facts)
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(read)
        self.admitted = Counter("hostd_gateway_admitted", "Requests admitted", registry=r)
        self.rejected = Counter("hostd_gateway_rejected", "Requests answered 503, by reason", ["reason"], registry=r)
        self.refused = Counter("hostd_gateway_refused", "Requests refused before admission (401, 404, 405, "
                               "408, 413, 503 for a full body budget), by status", ["status"], registry=r)
        self.proxied_bytes = Counter("hostd_gateway_proxied_bytes", "Response bytes passed to clients", registry=r)
        self.drains = Counter("hostd_gateway_drains", "Drains requested", registry=r)
        self.state = Gauge("hostd_gateway_state", "1 for the current state", ["state"], registry=r)
        self.errors = Counter("hostd_gateway_upstream_errors", "Requests the engine failed mid-way", registry=r)
        self.failovers = Counter(
            "hostd_gateway_failovers", "Times new requests moved to the warm standby because the engine "
            "serving them stopped answering (standby: true)", registry=r)
        self.connections_refused = Counter(
            "hostd_gateway_connections_refused", "Connections answered 503 at the connection cap", registry=r)
        self.connections_timed_out = Counter(
            "hostd_gateway_connections_timed_out", "Connections closed for slow or oversized headers, "
            "idleness, or a client that stopped reading its response, by phase", ["phase"], registry=r)
        self.connections_evicted = Counter(
            "hostd_gateway_connections_evicted", "Idle keep-alive connections closed to make room at a "
            "connection cap", registry=r)
        self.duration = Histogram(
            "hostd_gateway_request_duration_seconds", "Admitted requests: from admission to the last byte, "
            "by status", ["status"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttfb = Histogram(
            "hostd_gateway_time_to_first_byte_seconds", "Admitted requests: from admission to the engine's "
            "response headers, by status", ["status"], buckets=REQUEST_BUCKETS, registry=r)
        self.ttft = Histogram(
            "hostd_gateway_time_to_first_token_seconds", "Completions and chat completions answered 200: from "
            "admission to the first SSE event carrying a token (stream=\"true\") or to the whole body "
            "(stream=\"false\": a time to last token, kept apart)", ["stream"], buckets=REQUEST_BUCKETS,
            registry=r)
        self.admission_wait = Histogram(
            "hostd_gateway_admission_wait_seconds", "Time a request waited for admission (queue mode) "
            "before it was admitted or refused", buckets=REQUEST_BUCKETS, registry=r)
        self.reload_duration = Histogram(
            "hostd_gateway_reload_duration_seconds", "A reload as the gateway sees it: from the drain (restart) "
            "or the switch to the second engine (overlap) to the resume or the switch back, by outcome",
            ["outcome"], buckets=RELOAD_BUCKETS, registry=r)
        self.reload_unavailable = Histogram(
            "hostd_gateway_reload_unavailable_seconds", "Per reload: seconds new requests were answered 503, "
            "from its start until serving again after its end (0 for an overlap reload that never stopped "
            "serving)", buckets=(0,) + RELOAD_BUCKETS, registry=r)

    def connection_event(self, event: str) -> None:
        """limits.Connections' on_event: a connection refused, evicted or timed out (its phase)."""
        if event == "refused":
            self.connections_refused.inc()
        elif event == "evicted":
            self.connections_evicted.inc()
        else:
            self.connections_timed_out.labels(event).inc()

    def first_token(self, stream: bool, seconds: float) -> None:
        """A generating answer's time to first token: its first SSE event with
        a token (STREAM), or its whole body."""
        self.ttft.labels("true" if stream else "false").observe(seconds)

    def set_state(self, current: str, states: Iterable[str]) -> None:
        for s in states:
            self.state.labels(s).set(1 if s == current else 0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ModelFacts:
    """hostd_build_info, hostd_limit and hostd_weights_retained, at scrape time.

    The gateway's limits are its config's (they change with a restart of
    model@NAME only); the engine's are the engine_config that the serving
    engine's /health reports (update()), so after a reload or a rollback
    they are what runs, and they are absent while no engine answers.
    upstream_version is the last one an engine reported ('' before any)."""

    def __init__(self, model: str, backend: str, upstream: str, gateway_limits: dict[str, float],
                 gpus: str = ""):
        self.model, self.backend, self.upstream = model, backend, upstream
        self.gateway_limits = gateway_limits
        self.gpus = gpu_labels(gpus)
        self.upstream_version = ""
        self.engine_limits: dict[str, float] = {}
        self.weights: Optional[str] = None  # "daemon" | "disk" from the engine's /health

    def update(self, health: Optional[EngineHealth]) -> None:
        """The serving engine's /health, None when it did not answer."""
        if health is None:
            self.engine_limits, self.weights = {}, None
            return
        self.engine_limits = numeric_fields(engine_health.sent(health.engine_config))
        self.weights = engine_health.sent(health.weights)  # "daemon" | "disk": the type admits no other
        if health.upstream_version:
            self.upstream_version = health.upstream_version

    def collect(self):
        info = GaugeMetricFamily(
            "hostd_build_info", "1, labelled with hostd's version, the model's backend and the version of the "
            "upstream package its engine runs ('' until an engine answered); its model label, as every "
            "series', is Metrics' registry's",
            labels=["version", "backend", "upstream", "upstream_version"])
        info.add_metric([hostd.__version__, self.backend, self.upstream, self.upstream_version], 1)
        yield info
        limits = GaugeMetricFamily(
            "hostd_limit", "A configured limit, by its key in the model's YAML: gateway.* from the gateway's "
            "start, engine.* as the serving engine runs them (absent while none answers)", labels=["key"])
        for prefix, values in (("gateway.", self.gateway_limits), ("engine.", self.engine_limits)):
            for key, value in sorted(values.items()):
                limits.add_metric([prefix + key], value)
        yield limits
        if self.gpus:
            gpus = GaugeMetricFamily(
                "hostd_gpu_info", "1 for each GPU the model's units may use, as NVML named it at the last "
                "daemon-reload: gpu its index, UUID its 'GPU-…' and, for a MIG slice, mig_uuid its 'MIG-…' and "
                "GPU_I_ID its GPU instance (DCGM-exporter's label names, so that `* on(UUID)` joins them)",
                labels=["gpu", "UUID", "mig_uuid", "GPU_I_ID"])
            for labels in self.gpus:
                gpus.add_metric(labels, 1)
            yield gpus
        if self.weights is not None:
            yield GaugeMetricFamily(
                "hostd_weights_retained", "1 when the serving engine maps the weight daemon's copy (kept across "
                "engine restarts), 0 when it loaded the weights from disk (weights_not_retained: hostctl status "
                "says why)", value=1 if self.weights == "daemon" else 0)


def gpu_labels(described: str) -> list[list[str]]:
    """HOSTD_GPUS as the generator writes it (INDEX/UUID/MIG_UUID/GPU_I_ID,
    comma-separated) as hostd_gpu_info's label values; [] when it is unset
    (a model on no GPU, or NVML unreadable at the daemon-reload)."""
    return [(entry.split("/") + ["", "", "", ""])[:4] for entry in described.split(",") if entry]


def numeric_fields(section) -> dict[str, float]:
    """The numbers of a config section as builtins (msgspec.to_builtins): ints
    and floats, not booleans, not unset (None) ones."""
    if not isinstance(section, dict):
        return {}
    return {k: float(v) for k, v in section.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class FirstToken:
    """Finds the first event of a completions or chat completions SSE stream
    that carries a token: choices[].text, or choices[].delta's content,
    reasoning or tool calls, not empty. A chat stream's first event (the role,
    empty content) carries none. Reads only until it found it, and at most
    LIMIT bytes of events without one (then gives up)."""

    LIMIT = 1 << 20

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        """True once: for the chunk that completes the first event with a token."""
        if self.done:
            return False
        self.buffer += chunk
        events = self.buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events[:-1]:
            if _event_carries_token(event):
                self.done = True
                self.buffer = bytearray()
                return True
        self.buffer = bytearray(events[-1])
        if len(self.buffer) > self.LIMIT:
            self.done, self.buffer = True, bytearray()
        return False


TOKEN_DELTA_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


def _event_carries_token(event: bytes) -> bool:
    data = b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not data or data == b"[DONE]":
        return False
    try:
        body = json.loads(data)
    except ValueError:
        return False
    choices = body.get("choices") if isinstance(body, dict) else None
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict) and any(delta.get(f) for f in TOKEN_DELTA_FIELDS):
            return True
    return False


class ReloadClock:
    """One reload as the gateway sees it, for the two reload histograms.

    begin() at the drain (restart strategy) or the switch to the second
    engine (overlap), end(outcome) at the resume or the switch back;
    serving(bool) at every state change in between. Seconds not serving are
    summed from begin() until serving again after end(), so a restart's 503
    window and an overlap's zero are measured the same way."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics
        self.started: Optional[float] = None
        self.ended = False
        self.down_since: Optional[float] = None
        self.unavailable = 0.0

    def begin(self, now: float, serving: bool, retry: bool = False) -> None:
        """A reload starts; RETRY: a second drain while the gateway is still
        drained, which is the same reload."""
        if self.started is not None:
            if retry and not self.ended:
                return
            # One left open: it never ended (a switch back that was refused, a
            # drain nobody resumed), or it ended not serving and never served
            # since. Its unavailable time counts; a duration it never had does not.
            if self.down_since is not None:
                self.unavailable += now - self.down_since
            self._close()
        self.started, self.ended, self.unavailable = now, False, 0.0
        self.down_since = None if serving else now

    def serving(self, now: float, serving: bool) -> None:
        if self.started is None:
            return
        if serving and self.down_since is not None:
            self.unavailable += now - self.down_since
            self.down_since = None
            if self.ended:
                self._close()
        elif not serving and self.down_since is None:
            self.down_since = now

    def end(self, now: float, outcome: str) -> None:
        if self.started is None or self.ended:
            return  # a resume without a reload (by hand, or after a gateway restart)
        self.metrics.reload_duration.labels(outcome).observe(now - self.started)
        self.ended = True
        if self.down_since is None:
            self._close()

    def _close(self) -> None:
        self.metrics.reload_unavailable.observe(self.unavailable)
        self.started, self.ended = None, False


def engine_families(text: str, prefixes: tuple[str, ...], model: str) -> str:
    """The families of Prometheus TEXT named with PREFIXES, every sample
    labelled model=MODEL; '' for a page that does not parse (Prometheus would
    refuse the whole scrape for it, the gateway's own series with it)."""
    kept = CollectorRegistry(auto_describe=False)
    try:
        families = [with_model(f, model) for f in text_string_to_metric_families(text) if f.name.startswith(prefixes)]
    except ValueError:
        return ""
    kept.register(_Fixed(families))
    return generate_latest(kept).decode()


class _Fixed:
    """A collector of families already read (engine_families)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families
