"""packaging/monitoring's vLLM and SGLang rows read families that the
installed vLLM and SGLang register, read from their source: vLLM's
PrometheusStatLogger (vllm/v1/metrics/loggers.py) and SGLang's collectors
(sglang/srt/observability/metrics_collector.py), each family with its type,
so a histogram is read as NAME_bucket/_sum/_count and a counter as
NAME_total. tests/integration/test_monitoring_metrics.py checks hostd's own
names against a running model's /metrics; SGLang's test double serves no
/metrics, so its source is the only witness here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.promql_names import dashboard_exprs, names_in, rule_exprs, upstream_kind

# Where each upstream constructs its Prometheus families, and the
# constructors it calls there: vLLM through its _gauge_cls/_counter_cls/
# _histogram_cls hooks, SGLang through prometheus_client's classes.
SOURCES = {
    "vllm": "vllm/v1/metrics/loggers.py",
    "sglang": "sglang/srt/observability/metrics_collector.py",
}
TYPES = {"_gauge_cls": "gauge", "Gauge": "gauge", "_counter_cls": "counter", "Counter": "counter",
         "_histogram_cls": "histogram", "Histogram": "histogram"}
SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def registered(env: Path, kind: str) -> dict[str, str]:
    """{family name: type} that KIND's source in ENV constructs."""
    (source,) = env.glob(f"lib/python3*/site-packages/{SOURCES[kind]}")
    found = re.findall(rf'(\w+)\(\s*name="({kind}:[a-zA-Z0-9_]+)"', source.read_text())
    return {name: TYPES[ctor] for ctor, name in found if ctor in TYPES}


def sample_names(families: dict[str, str]) -> set[str]:
    names = set()
    for family, kind in families.items():
        if kind == "counter":
            family = family.removesuffix("_total")  # prometheus_client adds it to a counter's samples
        names |= {family + suffix for suffix in SUFFIXES[kind]}
    return names


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_dashboards_engine_row_reads_families_the_installed_upstream_registers(kind, request):
    env = request.getfixturevalue(f"{kind}_env")
    families = registered(env, kind)
    assert len(families) > 20, f"{SOURCES[kind]} no longer constructs its families where this test reads them"
    known = sample_names(families)
    exprs = {**{f"rule {k}": v for k, v in rule_exprs().items()}, **dashboard_exprs()}
    named = {where: {n for n in names_in(expr) if upstream_kind(n) == kind} for where, expr in exprs.items()}
    assert any(named.values()), f"the dashboard reads nothing of {kind}'s"
    unknown = {where: sorted(names - known) for where, names in named.items() if names - known}
    assert not unknown, f"not registered by {kind} {env.name}"
