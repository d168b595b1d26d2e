"""The shipped Prometheus alert rules (deploy/prometheus-alerts.yaml), the Grafana dashboard
(deploy/grafana-dashboard.json) and the relay's /metrics (issue 12): promtool accepts the rules
and /metrics, each alert fires on synthetic series made for it and not on healthy ones
(tests/alerts_test.yml), a rule that is wrong fails that test, and every metric the rules and
the dashboard name is one a running relay really exposes."""
import json
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, wait_for
from relay_util import Relay, free_port, write_config

RULES = ROOT / "deploy" / "prometheus-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"


def dashboard_exprs():
    d = json.loads(DASHBOARD.read_text())
    out = []
    for p in d["panels"]:
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            out.append(t["expr"])
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            out.append(v["definition"])
    return d, out


def metric_names(text):
    """outbox_relay_* names in PromQL text, histogram series reduced to their family."""
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"\b(outbox_relay_\w+)", text)}


@pytest.mark.build_independent
def test_dashboard_structure():
    d, exprs = dashboard_exprs()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 30
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " ".join(p["title"].lower() for p in d["panels"])
    for topic in ("backlog", "oldest", "relayed", "failures", "latency", "end-to-end", "dead",
                  "connections"):
        assert topic in titles, f"no panel about {topic}"
    for e in exprs:
        assert e.count("(") == e.count(")"), e
        if "histogram_quantile" in e:
            assert "_bucket" in e and "le)" in e, e


def promtool(*args, stdin=None):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found: install Debian's prometheus (scripts/packages.txt)",
                    pytrace=False)
    return subprocess.run([exe, *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.build_independent
def test_rules_are_valid():
    r = promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 14 rules found" in r.stdout, r.stdout


@pytest.mark.build_independent
def test_each_alert_fires_on_its_series_and_not_on_healthy_ones():
    r = promtool("test", "rules", RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr
    # every shipped alert has a case in the unit tests
    alerts = set(re.findall(r"^\s*- alert: (\w+)", RULES.read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert alerts and alerts == tested, (alerts, tested)


@pytest.mark.build_independent
@pytest.mark.parametrize("old,new", [
    ("max by (outbox) (outbox_relay_backlog) > 0", "max by (outbox) (outbox_relay_backlog) > 100"),
    ("outbox_relay_oldest_pending_age_seconds) > 600", "outbox_relay_oldest_pending_age_seconds) > 6000"),
    ("max by (outbox) (outbox_relay_takeovers_total) > 0", "max by (outbox) (outbox_relay_takeovers_total) >= 0"),
])
def test_a_wrong_rule_fails_the_rule_tests(tmp_path, old, new):
    """The rule tests can fail: a threshold moved, or the competing-mode guard of
    OutboxNoLeader dropped, makes promtool test rules report the difference."""
    text = RULES.read_text()
    assert old in text
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / RULES.name).write_text(text.replace(old, new))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    r = promtool("test", "rules", tmp_path / "tests" / RULE_TESTS.name)
    assert r.returncode != 0, r.stdout


def test_relay_metrics_pass_promtool_and_cover_the_rules(services, pgdb, relay_bin, tmp_path):
    from test_relay import init_schema
    port = free_port()
    cfg = write_config(tmp_path / "r.ini", services, pgdb,
                       relay={"name": "alerts", "http_listen": f"127.0.0.1:{port}"})
    init_schema(relay_bin, cfg)
    r = Relay(relay_bin, cfg, tmp_path / "r.log", http_port=port)
    try:
        wait_for(lambda: r.metric("outbox_relay_source_up") == 1, 20, desc="source up",
                 ignore=(OSError,))
        text = r.metrics()
    finally:
        r.assert_clean_exit(r.stop())
    c = promtool("check", "metrics", stdin=text)
    assert c.returncode == 0, c.stdout + c.stderr
    exposed = set(re.findall(r"^# TYPE (\w+) ", text, re.M))
    assert 'outbox_relay_build_info{version="' in text
    # the SQL Server gauges a PostgreSQL outbox has not: tests/test_odbc_health.py shows a
    # `source = sqlserver` relay exposing them
    exposed |= {"outbox_relay_table_used_bytes", "outbox_relay_version_store_bytes"}
    used = metric_names(RULES.read_text())
    missing = sorted(m for m in used if m not in exposed)
    assert used and not missing, f"rules name metrics the relay does not expose: {missing}"
    used = metric_names(" ".join(dashboard_exprs()[1]))
    missing = sorted(m for m in used if m not in exposed)
    assert len(used) >= 15 and not missing, f"the dashboard uses metrics the relay does not expose: {missing}"
    for fam in ("confirm_latency_seconds", "settle_latency_seconds", "claim_latency_seconds"):
        assert f"# TYPE outbox_relay_{fam} histogram" in text
