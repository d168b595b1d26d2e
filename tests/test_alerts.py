"""The shipped Prometheus alert rules (deploy/prometheus-alerts.yaml) and the relay's /metrics
(issue 12): promtool accepts both, each alert fires on synthetic series made for it and not on
healthy ones (tests/alerts_test.yml), a rule that is wrong fails that test, and every metric
the rules name is one a running relay really exposes."""
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, wait_for
from relay_util import Relay, free_port, write_config

RULES = ROOT / "deploy" / "prometheus-alerts.yaml"
RULE_TESTS = ROOT / "tests" / "alerts_test.yml"


def promtool(*args, stdin=None):
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool not found: install Debian's prometheus (scripts/packages.txt)",
                    pytrace=False)
    return subprocess.run([exe, *map(str, args)], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_rules_are_valid():
    r = promtool("check", "rules", RULES)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 8 rules found" in r.stdout, r.stdout


def test_each_alert_fires_on_its_series_and_not_on_healthy_ones():
    r = promtool("test", "rules", RULE_TESTS)
    assert r.returncode == 0, r.stdout + r.stderr
    # every shipped alert has a case in the unit tests
    alerts = set(re.findall(r"^\s*- alert: (\w+)", RULES.read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert alerts and alerts == tested, (alerts, tested)


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
    used = set(re.findall(r"\b(outbox_relay_\w+)", RULES.read_text()))
    missing = sorted(m for m in used if m not in exposed)
    assert used and not missing, f"rules name metrics the relay does not expose: {missing}"
