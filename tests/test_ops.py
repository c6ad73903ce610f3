"""ops/: the Grafana dashboard and the Prometheus alert rules name only what /metrics exports.

Every PromQL expression of both files (panel targets, template variables, alert rules) is
parsed for the series names it selects, the labels its matchers and groupings use, and the
`code` values it matches. A real server (`xrec serve`'s uvicorn settings, the tiny demo
model, a default deadline) gets one good request, one malformed request, one failed catalog
load and one refused connection, so that every labelled series exists; its /metrics is the
reference. Names are compared with the sample names as scraped (`_bucket`, `_total`: what
Prometheus stores), so a histogram or counter named without its suffix is an error too.
With `promtool` on PATH (Debian's `prometheus` package) the rules are also checked by it and
each alert is run on synthetic series (`promtool test rules`).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import VALID, WAIT_S  # noqa: E402
from test_server_hostile import connect, limited_server, read_answer  # noqa: E402

from xrec import Engine  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.errors import XrecError  # noqa: E402
from xrec.server.metrics import ServerMetrics  # noqa: E402

OPS = Path(__file__).resolve().parents[1] / "ops"
DASHBOARD = OPS / "grafana" / "xrec-dashboard.json"
RULES = OPS / "prometheus" / "xrec-alerts.yml"
TARGET_LABELS = {"job", "instance"}     # added by Prometheus to every scraped series
PROMETHEUS_MADE = {"up"}                # series Prometheus makes for each target

# ---- PromQL, enough to name what an expression selects ---------------------------------

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
            "group_right", "offset", "bool", "inf", "nan"}
SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\s*\{([^{}]*)\}")
MATCHER = re.compile(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
NUMBER = re.compile(r"(?<![\w:.])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?")
NAME = re.compile(r"[A-Za-z_:][\w:]*")


def parse(expr: str) -> dict:
    """{"names": series names, "matchers": [(name or None, label, op, value)],
    "grouping": labels of by/without/on/ignoring/group_*} of one PromQL expression."""
    matchers = [(m.group(1), *found) for m in SELECTOR.finditer(expr)
                for found in MATCHER.findall(m.group(2))]
    rest = SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", expr)
    grouping = {label.strip() for m in GROUPING.finditer(rest) for label in m.group(1).split(",")
                if label.strip()}
    rest = GROUPING.sub(" ", rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)                 # ranges and subqueries
    rest = re.sub(r"\boffset\s+[\w.$]+", " ", rest)
    rest = STRING.sub(" ", rest)
    rest = re.sub(r"\$\{?\w+\}?", " ", rest)                # Grafana variables
    rest = NUMBER.sub(" ", rest)
    names = set()
    for m in NAME.finditer(rest):
        is_call = rest[m.end():].lstrip().startswith("(")    # a function or an aggregation
        if not is_call and m.group(0).lower() not in KEYWORDS:
            names.add(m.group(0))
    return {"names": names, "matchers": matchers, "grouping": grouping}


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str, str | None]]:
    """(where, PromQL, the label a `label_values` variable lists) of every query."""
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        m = re.fullmatch(r"\s*label_values\((.+),\s*(\w+)\)\s*", query)
        assert m, f"variable {variable['name']}: expected label_values(SELECTOR, LABEL), got {query!r}"
        found.append((f"variable {variable['name']}", m.group(1), m.group(2)))
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"], None))
    return found


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside (collapsed) rows too; rows themselves left out."""
    panels = []
    for panel in dashboard["panels"]:
        panels.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return panels


def rules(document: dict) -> list[dict]:
    return [rule for group in document["groups"] for rule in group["rules"]]


def rule_exprs(document: dict) -> list[tuple[str, str, str | None]]:
    return [(f"alert {rule['alert']}", rule["expr"], None) for rule in rules(document)]


def xrec_codes() -> dict[str, int]:
    """Every code a request can end with -> its HTTP status ("OK" -> 200)."""
    codes, classes = {"OK": 200}, [XrecError]
    while classes:
        cls = classes.pop()
        codes[cls.code] = cls.http_status
        classes.extend(cls.__subclasses__())
    return codes


def problems(exprs: list[tuple[str, str, str | None]], exported: dict[str, set[str]]) -> list[str]:
    """What in `exprs` the server does not export: series names, label names, code values."""
    found, codes = [], xrec_codes()
    for where, expr, listed_label in exprs:
        parsed = parse(expr)
        labels_in_expr = set(TARGET_LABELS)
        for name in parsed["names"]:
            if name in exported:
                labels_in_expr |= exported[name]
            elif name not in PROMETHEUS_MADE and not (name.startswith("process_")
                                                      and sys.platform != "linux"):
                found.append(f"{where}: no series {name} in /metrics")
        for name, label, _, value in parsed["matchers"]:
            known = exported.get(name, set()) | TARGET_LABELS if name else labels_in_expr
            if label not in known:
                found.append(f"{where}: {name} has no label {label!r} (has {sorted(known)})")
            if label == "code":
                found += [f"{where}: code {code!r} is not an xrec code" for code in value.split("|")
                          if code not in codes]
        for label in parsed["grouping"] | ({listed_label} if listed_label else set()):
            if label not in labels_in_expr:
                found.append(f"{where}: label {label!r} is on none of its series "
                             f"({sorted(labels_in_expr)})")
    return found


def test_parse_names_matchers_and_grouping():
    expr = ('histogram_quantile(0.99, sum by (job, instance, le) (rate(xrec_request_latency_seconds_bucket'
            '{job=~"$job", code!="OK"}[$__rate_interval]))) > on (job, instance) group_left '
            "(xrec_request_timeout_seconds or on (job, instance) (xrec_ready * 0 + 1e3)) "
            'unless xrec_catalog_info offset 15m and max without (le) (up{job="xrec"})')
    parsed = parse(expr)
    assert parsed["names"] == {"xrec_request_latency_seconds_bucket", "xrec_request_timeout_seconds",
                               "xrec_ready", "xrec_catalog_info", "up"}
    assert parsed["matchers"] == [("xrec_request_latency_seconds_bucket", "job", "=~", "$job"),
                                  ("xrec_request_latency_seconds_bucket", "code", "!=", "OK"),
                                  ("up", "job", "=", "xrec")]
    assert parsed["grouping"] == {"job", "instance", "le"}


# ---- the files' shape ----------------------------------------------------------------

def test_dashboard_imports_as_grafana_10_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "instance"} <= set(variables)
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels, cells = all_panels(dashboard), set()
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels
                                                      if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps another panel"
                cells.add((x, y))
    for panel in panels:
        assert panel["datasource"] == source and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == source and target["refId"], panel["title"]
            selected = {}
            for name, label, op, value in parse(target["expr"])["matchers"]:
                selected.setdefault(name, set()).add((label, op, value))
            for name in parse(target["expr"])["names"]:   # every series follows the variables
                assert {("job", "=~", "$job"), ("instance", "=~", "$instance")} <= \
                    selected.get(name, set()), f"{panel['title']!r}: {name} ignores $job/$instance"


def test_rules_have_the_standard_shape():
    document = yaml.safe_load(RULES.read_text())
    names = [rule["alert"] for rule in rules(document)]
    assert len(names) == len(set(names)) and document["groups"][0]["name"]
    assert set(names) == {"XrecHighErrorRate", "XrecLatencyP99OverDeadline", "XrecQueueFull",
                          "XrecRequestsRefused", "XrecCatalogChangeFailed", "XrecNotReady"}
    for rule in rules(document):
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert re.fullmatch(r"\d+[smh]", rule.get("for", "0s")), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_error_share_counts_exactly_the_5xx_codes():
    server_errors = {code for code, status in xrec_codes().items() if status >= 500}
    rule = next(r for r in rules(yaml.safe_load(RULES.read_text())) if r["alert"] == "XrecHighErrorRate")
    panel = next(p for p in all_panels(json.loads(DASHBOARD.read_text()))
                 if p["title"] == "Server-error (5xx) share")
    for expr in (rule["expr"], panel["targets"][0]["expr"]):
        matched = [value for _, label, op, value in parse(expr)["matchers"] if label == "code"]
        assert [set(value.split("|")) for value in matched] == [server_errors]


# ---- against a real server -------------------------------------------------------------

@pytest.fixture(scope="module")
def scraped(tmp_path_factory) -> dict[str, str]:
    """/metrics of a real server after traffic that makes every labelled series ("serving"),
    and its metrics once the engine is closed ("closed")."""
    model_dir = write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                                   num_items=500)
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                                    request_timeout_ms=30_000)
    served = limited_server(engine, max_header_bytes=1024)
    try:
        with httpx.Client(base_url=served.url, timeout=WAIT_S) as client:
            assert client.post("/v1/rec/completions", json=VALID).status_code == 200
            assert client.post("/v1/rec/completions", content=b"{").status_code == 400
            # a failed catalog load (400 a missing file; 404 where loads are off)
            refused = client.post("/v1/admin/catalog", json={"path": "missing.bin"})
            assert refused.status_code in (400, 404), refused.text
            with connect(served.port) as sock:   # a head over the limit, still unfinished
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 2048)
                assert read_answer(sock)[0] == 431
            serving = client.get("/metrics").text
    finally:
        served.stop()
        engine.close(5)
    return {"serving": serving, "closed": served.server.config.app.state.xrec.metrics.render().decode()}


@pytest.fixture(scope="module")
def exported(scraped) -> dict[str, set[str]]:
    """Sample name -> its label names, as the serving server exports them."""
    samples: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(scraped["serving"]):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def values(text: str) -> dict[str, float]:
    """Unlabelled sample name -> value."""
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


def test_the_server_exports_what_ops_needs(exported, scraped):
    assert {"xrec_requests_total", "xrec_catalog_changes_total", "xrec_catalog_changes_created",
            "xrec_http_refusals_total", "xrec_request_latency_seconds_bucket"} <= set(exported)
    if sys.platform == "linux":
        assert "process_resident_memory_bytes" in exported
    serving, closed = values(scraped["serving"]), values(scraped["closed"])
    assert serving["xrec_ready"] == 1 and closed["xrec_ready"] == 0
    assert serving["xrec_request_queue_limit"] == 1024            # request_queue_size's default
    assert serving["xrec_request_timeout_seconds"] == 30.0


def test_a_loading_server_is_not_ready_and_names_no_limits():
    """While loading the queue gauges read 0: without a limit, XrecQueueFull (0 >= 0.9 * 0)
    cannot fire."""
    loading = values(ServerMetrics().render().decode())
    assert loading["xrec_ready"] == 0 and loading["xrec_requests_waiting"] == 0
    assert "xrec_request_queue_limit" not in loading and "xrec_request_timeout_seconds" not in loading


def test_every_metric_the_dashboard_names_is_exported(exported):
    assert problems(dashboard_exprs(json.loads(DASHBOARD.read_text())), exported) == []


def test_every_metric_the_alerts_name_is_exported(exported):
    assert problems(rule_exprs(yaml.safe_load(RULES.read_text())), exported) == []


def test_a_panel_naming_what_is_not_exported_is_reported(exported):
    dashboard = json.loads(DASHBOARD.read_text())
    panel = copy.deepcopy(all_panels(dashboard)[0])
    panel["title"] = "bogus"
    panel["targets"] = [{"refId": "A", "expr": 'sum by (status) (rate(xrec_bogus_total{job=~"$job"}'
                                               '[5m])) + xrec_request_latency_seconds'},
                        {"refId": "B", "expr": 'xrec_requests_total{code="TEAPOT", route="x"}'}]
    dashboard["panels"].append(panel)
    found = problems(dashboard_exprs(dashboard), exported)
    assert sorted(found) == sorted([
        "panel 'bogus' A: no series xrec_bogus_total in /metrics",
        "panel 'bogus' A: no series xrec_request_latency_seconds in /metrics",   # no suffix
        "panel 'bogus' A: label 'status' is on none of its series (['instance', 'job'])",
        "panel 'bogus' B: code 'TEAPOT' is not an xrec code",
        "panel 'bogus' B: xrec_requests_total has no label 'route' (has ['api', 'code', 'instance', 'job'])",
    ])


# ---- promtool ----------------------------------------------------------------------------

PROMTOOL = shutil.which("promtool")
if PROMTOOL is None and os.environ.get("XREC_REQUIRE_PROMTOOL"):   # .ci/run installs it
    raise RuntimeError("XREC_REQUIRE_PROMTOOL is set and promtool is not on PATH")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not on PATH "
                                    "(Debian: apt-get install prometheus)")


def _series(instance: str, name: str, values: str, **labels: str) -> dict:
    labels = {"job": "xrec", "instance": instance, **labels}
    return {"series": name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
            "values": values}


def _firing(alert: str, eval_time: str, *alerts: dict) -> dict:
    return {"alertname": alert, "eval_time": eval_time,
            "exp_alerts": [{"exp_labels": labels} for labels in alerts]}


def _on(instance: str, severity: str, **labels: str) -> dict:
    return {"job": "xrec", "instance": instance, "severity": severity, **labels}


def _latency(instance: str) -> list[dict]:
    """10 requests a minute, all between 1 s and 2.5 s: p99 = 2.485 s."""
    return [_series(instance, "xrec_request_latency_seconds_bucket", values, api="native", le=le)
            for le, values in (("1.0", "0x30"), ("2.5", "0+10x30"), ("+Inf", "0+10x30"))]


# each test: (input series, alert evaluations); one minute between samples and evaluations
ALERT_TESTS = [
    # a: 10% INTERNAL; b: 33% INVALID_ARGUMENT (a 4xx) and no 5xx
    ([_series("a", "xrec_requests_total", "0+90x20", api="native", code="OK"),
      _series("a", "xrec_requests_total", "0+10x20", api="native", code="INTERNAL"),
      _series("b", "xrec_requests_total", "0+100x20", api="native", code="OK"),
      _series("b", "xrec_requests_total", "0+50x20", api="native", code="INVALID_ARGUMENT")],
     [_firing("XrecHighErrorRate", "3m"),       # not yet 5 minutes
      _firing("XrecHighErrorRate", "10m", _on("a", "critical"))]),
    # p99 2.485 s: over a's fallback 1 s, under b's configured 5 s
    (_latency("a") + _latency("b")
     + [_series("a", "xrec_ready", "1x30"), _series("b", "xrec_ready", "1x30"),
        _series("b", "xrec_request_timeout_seconds", "5x30")],
     [_firing("XrecLatencyP99OverDeadline", "8m"),
      _firing("XrecLatencyP99OverDeadline", "15m", _on("a", "warning"))]),
    ([_series("a", "xrec_requests_waiting", "950x10"),      # >= 90% of 1024
      _series("a", "xrec_request_queue_limit", "1024x10"),
      _series("b", "xrec_requests_waiting", "900x10"),
      _series("b", "xrec_request_queue_limit", "1024x10")],
     [_firing("XrecQueueFull", "1m"), _firing("XrecQueueFull", "5m", _on("a", "warning"))]),
    ([_series("a", "xrec_requests_total", "0+90x20", api="native", code="OK"),
      _series("a", "xrec_requests_total", "0+10x20", api="native", code="RESOURCE_EXHAUSTED"),
      _series("b", "xrec_requests_total", "0+1000x20", api="native", code="OK"),
      _series("b", "xrec_requests_total", "0+5x20", api="native", code="RESOURCE_EXHAUSTED")],
     [_firing("XrecRequestsRefused", "10m", _on("a", "warning"))]),
    # a: the first failed load at 5 m makes its series (value 1, never grows; `_created` says
    # when); c: a failure an hour before the test, a second at 6 m; b: only OK loads
    ([_series("a", "xrec_catalog_changes_total", "_x5 1x25", action="load", code="INVALID_ARGUMENT"),
      _series("a", "xrec_catalog_changes_created", "_x5 300x25", action="load",
              code="INVALID_ARGUMENT"),
      _series("b", "xrec_catalog_changes_total", "0+1x30", action="load", code="OK"),
      _series("b", "xrec_catalog_changes_created", "0x30", action="load", code="OK"),
      _series("c", "xrec_catalog_changes_total", "1x5 2x25", action="load", code="INVALID_ARGUMENT"),
      _series("c", "xrec_catalog_changes_created", "-3600x30", action="load",
              code="INVALID_ARGUMENT")],
     [_firing("XrecCatalogChangeFailed", "4m"),
      _firing("XrecCatalogChangeFailed", "6m",
              _on("a", "warning", action="load", code="INVALID_ARGUMENT"),
              _on("c", "warning", action="load", code="INVALID_ARGUMENT")),
      _firing("XrecCatalogChangeFailed", "25m")]),
    # a: never loads; b: ready; c: not scraped; d: ready after 3 minutes
    ([_series("a", "xrec_ready", "0x10"), _series("a", "up", "1x10"),
      _series("b", "xrec_ready", "1x10"), _series("b", "up", "1x10"),
      _series("c", "up", "0x10"),
      _series("d", "xrec_ready", "0x2 1x10"), _series("d", "up", "1x10")],
     [_firing("XrecNotReady", "3m"),
      _firing("XrecNotReady", "6m", _on("a", "critical"), _on("c", "critical"))]),
]


@needs_promtool
def test_promtool_checks_the_scraped_metrics(scraped):
    """`promtool check metrics` (its parser and its lint) on both scrapes: the workspace
    budget was a gauge named `xrec_workspace_bytes_total`, and promtool exits 3 on a
    `_total` suffix that is not a counter's."""
    for state, text in scraped.items():
        result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, (state, result.stdout + result.stderr)


@needs_promtool
def test_promtool_checks_the_rules():
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path):
    """Each query as a recording rule (Grafana's $__rate_interval as 5m), for promtool's parser."""
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    records = [{"record": f"xrec_dashboard:query{i}", "expr": expr.replace("$__rate_interval", "5m")}
               for i, (_, expr, _) in enumerate(exprs)]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "dashboard", "rules": records}]}))
    result = subprocess.run([PROMTOOL, "check", "rules", "queries.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout


@needs_promtool
def test_each_alert_fires_when_it_should(tmp_path):
    """promtool compares annotations too; they are prose (README), so a copy of the rules
    without them is what runs here."""
    document = yaml.safe_load(RULES.read_text())
    for rule in rules(document):
        rule.pop("annotations")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(document))
    tests = [{"interval": "1m", "input_series": series, "alert_rule_test": evaluations}
             for series, evaluations in ALERT_TESTS]
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
