"""The metric names that PromQL expressions use, and those a /metrics page shows.

For the monitoring tests: packaging/monitoring's dashboard and alert rules
name series, and each must exist in a running model's /metrics. Part of the
tests (import it as tests.promql_names). The PromQL reading is lexical, which
is enough for expressions that write every metric name bare (no {__name__=}):
strings, label matchers, ranges and the label lists of by/without/on/
ignoring/group_* are removed first, then every identifier that is not a
function call, a keyword or a Grafana variable is a metric name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parent.parent / "packaging" / "monitoring"
RULES = MONITORING / "hostd.rules.yml"
DASHBOARD = MONITORING / "hostd-dashboard.json"

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
            "unless", "inf", "nan"}
# Series Prometheus makes itself for every target, not the target's /metrics.
SYNTHETIC = {"up"}

# The upstream engines' families, by the prefix of their names: the
# dashboard's vLLM and SGLang rows read them, a builtin model's /metrics has
# none (tests/upstream/test_dashboard_names.py checks them against upstream's
# source instead).
UPSTREAM_PREFIXES = {"vllm": "vllm:", "sglang": "sglang:"}


def upstream_kind(name: str) -> str | None:
    """The upstream engine whose family NAME is ('vllm', 'sglang'), None for hostd's own."""
    return next((kind for kind, prefix in UPSTREAM_PREFIXES.items() if name.startswith(prefix)), None)


_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def names_in(expr: str) -> set[str]:
    """The metric names EXPR reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\$\{?\w+\}?", "1", text)  # Grafana's $__rate_interval, ${datasource}
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\w+", " ", text)
    found = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        rest = text[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in KEYWORDS or re.fullmatch(r"\d.*", word):
            continue
        if match.start() and (text[match.start() - 1].isdigit() or text[match.start() - 1] == "."):
            continue  # the tail of a number such as 1e3 or a duration
        found.add(word)
    return found


def rule_exprs() -> dict[str, str]:
    """{alert or record name: expr} of the alert rules."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule.get("alert") or rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def dashboard_exprs() -> dict[str, str]:
    """{where: expr} of every panel target and query variable of the dashboard."""
    board = json.loads(DASHBOARD.read_text())
    found = {}

    def panels(items):
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(board["panels"]):
        for target in panel.get("targets") or []:
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            # label_values(SELECTOR, label): the selector is PromQL
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", query)
            found[f"variable {variable['name']!r}"] = inner.group(1) if inner else query
    return found


def exposed_names(text: str) -> set[str]:
    """The sample names of a Prometheus text page (histograms as _bucket, _sum, _count)."""
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
# Labels Prometheus adds to every series of a target: not in its /metrics.
TARGET_LABELS = {"job", "instance"}


def equality_matchers(expr: str) -> set[tuple[str, str, str]]:
    """(metric, label, value) of every NAME{label="value"} matcher in EXPR,
    but the target's own labels (job, instance)."""
    found = set()
    for name, body in _SELECTOR.findall(expr):
        for label, op, value in _MATCHER.findall(body):
            if op == "=" and label not in TARGET_LABELS:
                found.add((name, label, value))
    return found
