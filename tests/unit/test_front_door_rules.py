"""The gateway's public-side rules as pure functions: path normalization and
route tables, API key checks, which engine metric families pass."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from hostd import backends
from hostd.config.schema import GatewayConfig
from hostd.gateway import keys, limits, routes
from hostd.gateway.metrics import Metrics, ReloadClock, engine_families

GATEWAY_DOC = Path(__file__).resolve().parents[2] / "docs" / "gateway.md"


@pytest.mark.parametrize("target, path", [
    ("/v1/models", "/v1/models"),
    ("/v1/../health", "/health"),
    ("/v1/%2e%2e/health", "/health"),
    ("/v1/%2E%2E/metrics", "/metrics"),
    ("/v1/..%2fhealth", "/health"),
    ("//health", "/health"),
    ("/v1/./models/", "/v1/models"),
    ("/../../../health", "/health"),
    ("/%68ealth?x=/../y", "/health"),
    ("/v1/%252e%252e/health", "/v1/%2e%2e/health"),  # decoded once: a literal segment, not '..'
])
def test_paths_are_decoded_once_and_dot_segments_removed(target: str, path: str):
    assert routes.normalize(target) == path


@pytest.mark.parametrize("target", ["v1/models", "http://evil/health", "/v1/%ff", "/v1/a%00b", "/v1\\..\\health"])
def test_targets_that_are_not_clean_absolute_paths_are_refused(target: str):
    with pytest.raises(routes.BadPath):
        routes.normalize(target)


def test_a_literal_percent_is_quoted_again_for_the_engine():
    assert routes.quoted("/v1/%2e%2e/health") == "/v1/%252e%252e/health"
    assert routes.quoted("/v1/models/Qwen 2") == "/v1/models/Qwen%202"


@pytest.mark.parametrize("name", sorted(backends.BACKENDS))
def test_no_backend_declares_an_internal_route_public(name: str):
    backend = backends.BACKENDS[name]
    paths = {path for _method, path in backend.public_routes}
    assert paths and not paths & {"/health", "/metrics", "/sleep", "/wake_up", "/flush_cache",
                                  "/get_server_info", "/server_info", "/health_generate", "/ping"}
    assert backend.metrics_prefixes


@pytest.mark.parametrize("name", sorted(backends.BACKENDS))
def test_docs_list_every_public_route_of_every_backend(name: str):
    # docs/gateway.md's route table is what users read; it must say what the
    # gateway does, route for route (a backend change fails here until the doc follows).
    doc = GATEWAY_DOC.read_text()
    row = next(line for line in doc.splitlines() if line.startswith(f"| {name} | "))
    listed = re.findall(r"`([A-Z]+) ([^`]+)`", row)
    assert listed == list(backends.BACKENDS[name].public_routes)


def test_docs_give_the_schemas_default_for_every_limit():
    doc = GATEWAY_DOC.read_text()
    section = doc.split("## Limits", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", section, re.M))
    defaults = GatewayConfig()
    shown = {}
    for key in rows:
        value = getattr(defaults, key)
        shown[key] = f"{value:g} s" if isinstance(value, float) else \
            f"{value >> 20} MiB" if value % (1 << 20) == 0 else str(value)
    assert {k: v.strip() for k, v in rows.items()} == shown
    assert set(rows) == {"max_connections", "max_connections_per_client", "header_timeout", "idle_timeout",
                         "write_timeout", "body_timeout", "max_body_bytes", "body_bytes_in_flight",
                         "body_bytes_per_client"}


def test_docs_list_every_gateway_metric_with_its_type_and_labels():
    doc = GATEWAY_DOC.read_text()
    listed = set(re.findall(r"^\| `(hostd_gateway_[a-z_]+(?:\{[a-z_]+\})?)` \| ([a-z]+) \|", doc, re.M))
    gauges = {name: ("", lambda: 0) for name in ("hostd_gateway_in_flight", "hostd_gateway_queued",
                                                  "hostd_gateway_connections", "hostd_gateway_body_bytes_held")}
    metrics = Metrics(gauges)
    labels = {m._name: m._labelnames for m in vars(metrics).values() if hasattr(m, "_labelnames")}
    exported = set()
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add((name + "".join(f"{{{k}}}" for k in labels.get(family.name, ())), family.type))
    assert listed == exported


def test_route_table_matches_one_segment_per_name_and_knows_methods():
    table = routes.Table(backends.BACKENDS["builtin"].public_routes)
    assert table.match("GET", "/v1/models/tiny")[0].template == "/v1/models/{model}"
    assert table.match("GET", "/v1/models/a/b") == (None, [])
    assert table.match("GET", "/v1/completions") == (None, ["POST"])
    assert table.match("POST", "/v1/completionsX") == (None, [])


def test_bearer_keys_are_compared_against_every_key():
    ring = [b"sk-one", b"sk-two"]
    assert keys.authorized(ring, "Bearer sk-two") and keys.authorized(ring, "bearer  sk-one")
    for header in (None, "", "Bearer", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one", "sk-one"):
        assert not keys.authorized(ring, header), header


def test_keys_come_from_the_systemd_credential_when_passed(tmp_path, monkeypatch):
    configured = tmp_path / "configured.keys"
    configured.write_text("sk-from-file\n")
    credentials = tmp_path / "creds"
    credentials.mkdir()
    (credentials / "api-keys").write_text("# comment\n  sk-from-credential  \n\n")
    assert keys.load(str(configured)) == [b"sk-from-file"]
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    assert keys.load(str(configured)) == [b"sk-from-credential"]
    assert keys.load(None) is None


def test_only_the_engines_own_metric_families_pass():
    text = (
        "# HELP process_cpu_seconds_total CPU\n# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 1.0\n"
        "# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m"} 2.0\n'
        "# EOF\n"
    )
    assert engine_families(text, ("vllm:",), "tiny") == (
        "# HELP vllm:num_requests_running Running\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model="tiny",model_name="m"} 2.0\n'
    )
    assert engine_families(text, ("sglang:",), "tiny") == ""


def test_the_reload_clock_counts_unavailable_time_until_serving_again():
    def observed(metrics: Metrics) -> list[tuple[str, float]]:
        text = metrics.exposition().decode()
        return sorted((line.split()[0], float(line.split()[1])) for line in text.splitlines()
                      if line.startswith("hostd_gateway_reload_") and ("_sum" in line or "_count" in line))

    metrics = Metrics({})
    clock = ReloadClock(metrics)
    clock.begin(10.0, serving=False)       # a drain: 503 from now
    clock.begin(11.0, serving=False, retry=True)  # a second drain while drained: the same reload
    clock.serving(14.0, serving=True)      # resumed
    clock.end(14.0, "done")
    assert observed(metrics) == [
        ('hostd_gateway_reload_duration_seconds_count{outcome="done"}', 1.0),
        ('hostd_gateway_reload_duration_seconds_sum{outcome="done"}', 4.0),
        ("hostd_gateway_reload_unavailable_seconds_count", 1.0),
        ("hostd_gateway_reload_unavailable_seconds_sum", 4.0),
    ]
    metrics = Metrics({})
    clock = ReloadClock(metrics)
    clock.begin(0.0, serving=True)         # an overlap: serving throughout
    clock.serving(2.0, serving=False)      # but the engine went down for a second
    clock.serving(3.0, serving=True)
    clock.end(5.0, "rolled-back")
    clock.begin(6.0, serving=False)        # a restart reload that resumes into engine-down...
    clock.serving(6.5, serving=False)
    clock.end(8.0, "failed")               # ...is counted until the next reload begins
    clock.begin(9.0, serving=True)         # an overlap whose switch back is refused: never ends...
    clock.begin(100.0, serving=False)      # ...and a later reload's drain starts afresh
    clock.serving(110.0, serving=True)
    clock.end(110.0, "done")
    assert observed(metrics) == [
        ('hostd_gateway_reload_duration_seconds_count{outcome="done"}', 1.0),
        ('hostd_gateway_reload_duration_seconds_count{outcome="failed"}', 1.0),
        ('hostd_gateway_reload_duration_seconds_count{outcome="rolled-back"}', 1.0),
        ('hostd_gateway_reload_duration_seconds_sum{outcome="done"}', 10.0),
        ('hostd_gateway_reload_duration_seconds_sum{outcome="failed"}', 2.0),
        ('hostd_gateway_reload_duration_seconds_sum{outcome="rolled-back"}', 5.0),
        ("hostd_gateway_reload_unavailable_seconds_count", 4.0),
        ("hostd_gateway_reload_unavailable_seconds_sum", 14.0),  # 1 + 3 + 0 (the open one) + 10
    ]


def body_request(body: bytes, complete: bool):
    """A chunked POST whose BODY has arrived (COMPLETE: and its end too)."""
    reader = streams.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    reader.feed_data(body)
    if complete:
        reader.feed_eof()
    return make_mocked_request("POST", "/v1/completions", headers={"Transfer-Encoding": "chunked"},
                               payload=reader)


@pytest.mark.parametrize("size, cap, budget, expected", [
    (1000, 1024, 4096, 1000),      # taken whole, holding its bytes
    (4096, 1024, 1 << 20, 413),    # over the size cap
    (2048, 4096, 1024, 503),       # over what the budget has left
])
def test_a_body_that_arrived_with_its_headers_keeps_the_cap_and_the_budget(size, cap, budget, expected):
    async def read():
        request = body_request(b"x" * size, complete=True)
        assert request.content.is_eof()  # the path without a read deadline
        held = limits.BodyBudget(budget)
        try:
            body = await limits.read_body(request, held, cap, timeout=5)
        except limits.BodyRefused as exc:
            return exc.status, held.used
        assert held.used == len(body.data)
        taken = len(body.data)
        body.release()
        return taken, held.used

    result, left = asyncio.run(read())
    assert result == expected
    assert left == 0  # released, or never held


def test_a_body_still_arriving_gets_its_deadline():
    async def read():
        request = body_request(b"x" * 10, complete=False)  # the end never comes
        held = limits.BodyBudget(1024)
        with pytest.raises(limits.BodyRefused) as refused:
            await limits.read_body(request, held, 1024, timeout=0.2)
        return refused.value.status, held.used

    assert asyncio.run(read()) == (408, 0)
