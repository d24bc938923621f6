"""packaging/monitoring: the alert rules pass promtool's checks and its unit
tests on recorded series (hostd.rules.test.yml), the dashboard is one valid
Grafana document, and the PromQL reader the metrics-vs-/metrics check uses
(tests/promql_names.py) reads what it should. Debian's prometheus package
ships promtool (packaging/setup.sh installs it): without it these fail."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.promql_names import DASHBOARD, MONITORING, RULES, dashboard_exprs, equality_matchers, names_in, rule_exprs


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: packaging/setup.sh installs it with Debian's prometheus package"
    return subprocess.run([tool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_alert_rules():
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass_on_recorded_series():
    result = promtool("test", "rules", "hostd.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_sample_scrape_config_is_valid_and_loads_the_rules():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_every_alert_of_the_brief_has_a_rule_and_a_promtool_test():
    alerts = set(rule_exprs())
    assert {"HostdModelNotServing", "HostdReloadFailed", "HostdReloadRolledBack", "Hostd503Rate",
            "HostdWeightsNotRetained"} <= alerts
    tested = (MONITORING / "hostd.rules.test.yml").read_text()
    for alert in alerts:
        assert f"alertname: {alert}\n" in tested, f"{alert} has no promtool test"


def test_the_dashboard_is_one_grafana_document_with_unique_panel_ids():
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "hostd-models" and board["title"] == "hostd"
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    for where, expr in exprs.items():
        assert names_in(expr), f"{where}: {expr!r} names no metric"
        if where.startswith("panel"):
            assert 'job="hostd"' in expr and 'instance=~"$instance"' in expr, f"{where} is not per model"


@pytest.mark.parametrize("expr, names", [
    ('sum by (job, instance) (rate(hostd_gateway_rejected_total{reason="a b"}[5m])) / 2 > 0.05',
     {"hostd_gateway_rejected_total"}),
    ('histogram_quantile(0.99, sum by (le) (rate(x_bucket{job="hostd", instance=~"$instance"}[$__rate_interval])))',
     {"x_bucket"}),
    ('a unless b offset 15m or up{job="hostd"} == 0', {"a", "b", "up"}),
    ("max(hostd_limit{key=\"engine.max_num_seqs\"}) * 1e3", {"hostd_limit"}),
])
def test_the_promql_reader_finds_the_metric_names(expr, names):
    assert names_in(expr) == names


def test_the_promql_reader_finds_equality_matchers_but_the_targets_labels():
    expr = 'max(hostd_limit{job="hostd", key="engine.max_num_seqs", instance=~"$i"}) + x{state!="serving"}'
    assert equality_matchers(expr) == {("hostd_limit", "key", "engine.max_num_seqs")}
