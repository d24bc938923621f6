"""packaging/monitoring: the alert rules pass promtool's checks and its unit
tests on recorded series (hostd.rules.test.yml), the dashboard is one valid
Grafana document, and the PromQL reader the metrics-vs-/metrics check uses
(tests/promql_names.py) reads what it should. Debian's prometheus package
ships promtool (packaging/setup.sh installs it): without it these fail."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.promql_names import DASHBOARD, MONITORING, RULES, dashboard_exprs, equality_matchers, names_in, rule_exprs


def promtool(*args: str, cwd=MONITORING) -> subprocess.CompletedProcess:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: packaging/setup.sh installs it with Debian's prometheus package"
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


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


def test_the_fleet_scrape_config_is_valid_with_its_token_and_keeps_the_job_the_alerts_name(tmp_path):
    """Issue 55, item 5: a central Prometheus scrapes each host's metrics
    listener with the token file (promtool checks that the file exists: a
    copy names one in TMP_PATH)."""
    fleet = yaml.safe_load((MONITORING / "prometheus-fleet.yml").read_text())
    [job] = fleet["scrape_configs"]
    assert job["job_name"] == "hostd" and set(job["authorization"]) == {"credentials_file"}
    assert all(not t.startswith(("127.", "[::1]")) for t in job["static_configs"][0]["targets"])
    (tmp_path / "token").write_text("a-token\n")
    job["authorization"]["credentials_file"] = str(tmp_path / "token")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(fleet))
    shutil.copy(RULES, tmp_path / RULES.name)
    result = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout


def test_every_alert_of_the_brief_has_a_rule_and_a_promtool_test():
    alerts = set(rule_exprs())
    assert {"HostdModelNotServing", "HostdModelStarting", "HostdReloadFailed", "HostdReloadRolledBack",
            "Hostd503Rate", "HostdWeightsNotRetained"} <= alerts
    tested = (MONITORING / "hostd.rules.test.yml").read_text()
    for alert in alerts:
        assert f"alertname: {alert}\n" in tested, f"{alert} has no promtool test"


def test_every_alert_names_its_model_and_only_a_long_start_warns_of_starting():
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    for rule in rules:
        for key, text in rule["annotations"].items():
            assert "$labels.model" in text and not re.search(r"\bMODEL\b", text), (rule["alert"], key)
    by_name = {rule["alert"]: rule for rule in rules}
    assert "starting" not in by_name["HostdModelNotServing"]["expr"]
    starting = by_name["HostdModelStarting"]
    assert starting["labels"]["severity"] == "warning" and 'state="starting"' in starting["expr"]
    assert int(starting["for"].removesuffix("m")) > int(by_name["HostdModelNotServing"]["for"].removesuffix("m"))


def test_the_dashboard_is_one_grafana_document_with_unique_panel_ids():
    board = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    assert board["uid"] == "hostd-models" and board["title"] == "hostd"
    exprs = dashboard_exprs()
    assert len(exprs) > 20
    for where, expr in exprs.items():
        assert names_in(expr), f"{where}: {expr!r} names no metric"
        assert 'job="' not in expr, f"{where} names a scrape job: use $job"
        if where.startswith("panel"):
            assert 'job=~"$job", instance=~"$instance", model=~"$model"' in expr, f"{where} is not per host and model"
    # Issue 55, item 5: a fleet's Prometheus scrapes many hosts; instance is the host.
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert list(variables) == ["datasource", "job", "instance", "model"]
    assert variables["job"]["definition"] == "label_values(hostd_build_info, job)"
    assert variables["instance"]["definition"] == 'label_values(hostd_build_info{job=~"$job"}, instance)'
    assert variables["instance"]["multi"] and variables["instance"]["includeAll"]
    assert variables["model"]["definition"] == 'label_values(hostd_build_info{job=~"$job", instance=~"$instance"}, model)'
    for name in ("instance", "model"):
        assert variables[name]["query"]["query"] == variables[name]["definition"]


def test_every_dashboard_panel_uses_the_data_source_variable_and_names_its_models():
    board = json.loads(DASHBOARD.read_text())
    assert "__inputs" not in board  # nothing to import: the datasource variable picks it
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
            if target.get("format") != "table":
                assert target["legendFormat"].startswith("{{model}}"), (panel["title"], target["refId"])


def test_the_dashboard_has_an_engine_row_per_backend_with_the_same_panels():
    board = json.loads(DASHBOARD.read_text())
    rows, current = {}, None
    for panel in board["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], [])
        elif current is not None:
            current.append(panel["title"].split(" (")[0])
    engines = {title: panels for title, panels in rows.items() if title.startswith("Engine: ")}
    assert [t.split(" (")[0] for t in engines] == ["Engine: builtin", "Engine: vLLM", "Engine: SGLang"]
    for panels in engines.values():
        assert {"Time to first token", "End-to-end latency", "Running and waiting", "KV cache usage"} <= set(panels)
        assert {"Time per output token", "Inter-token latency"} & set(panels)


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
