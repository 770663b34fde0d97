"""The Prometheus rules in deploy/prometheus/rules and the Grafana dashboard's queries, checked by
the real `promtool` (Debian's `prometheus` package; `.ci/run` installs it): the rule files pass
`promtool check rules`, their unit tests (deploy/prometheus/tests/*.test.yml) pass `promtool test
rules` and fire every alert on synthetic series and leave it silent on healthy ones, and every
panel's query parses. Without promtool the tests are skipped, except in CI, where they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.telemetry.catalogue import catalogue
from tests.project.test_deploy import dashboard_exprs, load_yaml, promql_metrics

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = sorted((PROMETHEUS / "rules").glob("*.yml"))
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.test.yml"))
# The alerts the docs promise (docs/observability.md, "Prometheus rules, alerts and Grafana").
ALERTS = {
    "TailguardSLOBudgetBurnPage",
    "TailguardSLOBudgetBurnTicket",
    "TailguardRateLimitsDegraded",
    "TailguardLatencyStoreDegraded",
    "TailguardStoredResponsesDropped",
    "TailguardBreakerOpened",
}


def promtool() -> str:
    """The promtool binary; skips the test where there is none, but fails it in CI."""
    found = shutil.which("promtool")
    if found is not None:
        return found
    message = "promtool is missing: install Debian's `prometheus` package (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def run(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(
        [promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def rules() -> list[dict[str, Any]]:
    """Every rule of every rule file."""
    return [
        rule for path in RULES for group in load_yaml(path)["groups"] for rule in group["rules"]
    ]


def recorded() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def test_rule_files_pass_promtool_check() -> None:
    """`promtool check rules` accepts every rule file (syntax, PromQL, templates), and the
    Prometheus config loads them."""
    assert [p.name for p in RULES] == ["tailguard-alerts.yml", "tailguard-recording.yml"]
    output = run("check", "rules", *map(str, RULES))
    assert output.count("SUCCESS") == len(RULES), output
    config = run("check", "config", "prometheus.yml", cwd=PROMETHEUS)
    assert f"{len(RULES)} rule files found" in config, config


@pytest.mark.parametrize("path", UNIT_TESTS, ids=lambda path: path.name)
def test_rule_unit_tests_pass(path: Path) -> None:
    """`promtool test rules` on each unit-test file (one file per call: xdist spreads them)."""
    output = run("test", "rules", path.name, cwd=path.parent)
    assert "SUCCESS" in output, output


def test_unit_tests_evaluate_recordings_before_the_alerts_that_read_them() -> None:
    """promtool evaluates the groups of one evaluation in `group_eval_order`, else in an order
    of its own: an alert group run first would read the previous evaluation's recordings, out
    of the lookback window at a long test interval. Each unit-test file orders every group it
    loads, the recordings first."""
    for path in UNIT_TESTS:
        document = load_yaml(path)
        groups = [
            group
            for name in document["rule_files"]
            for group in load_yaml(path.parent / name)["groups"]
        ]
        recordings = [g["name"] for g in groups if all("record" in r for r in g["rules"])]
        alerts = [g["name"] for g in groups if all("alert" in r for r in g["rules"])]
        assert len(recordings) + len(alerts) == len(groups), path.name
        order = document.get("group_eval_order")
        assert order is not None, f"{path.name} sets no group_eval_order"
        assert sorted(order) == sorted(recordings + alerts), path.name
        assert order[: len(recordings)] == [g for g in order if g in recordings], path.name


def test_every_alert_is_fired_and_kept_silent_by_a_unit_test() -> None:
    """Each alert has a unit test in which it fires and one in which it stays silent; each
    recording rule the alerts and the dashboard read is evaluated by one."""
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert alerts == ALERTS
    fired: set[str] = set()
    silent: set[str] = set()
    evaluated: set[str] = set()
    for path in UNIT_TESTS:
        document = load_yaml(path)
        rule_files = {(path.parent / name).resolve() for name in document["rule_files"]}
        assert rule_files <= {p.resolve() for p in RULES}, path
        for test in document["tests"]:
            for case in test.get("alert_rule_test") or []:
                (fired if case.get("exp_alerts") else silent).add(case["alertname"])
            for case in test.get("promql_expr_test") or []:
                evaluated |= promql_metrics(case["expr"]) & recorded()
    assert fired == ALERTS, f"never fired: {sorted(ALERTS - fired)}"
    assert silent == ALERTS, f"never shown silent: {sorted(ALERTS - silent)}"
    latency = {name for name in recorded() if name.startswith("model:")}
    assert latency <= evaluated, f"not evaluated: {sorted(latency - evaluated)}"


def test_rules_read_only_metrics_the_gateway_exposes() -> None:
    """A renamed metric fails here, not as an alert that can never fire: every metric a rule
    reads is in the metrics catalogue (GET /metrics) or recorded by another rule."""
    exposed = set()
    for info in catalogue():
        exposed.add(info.name)
        if info.type == "histogram":
            exposed |= {info.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    known = exposed | recorded()
    for rule in rules():
        names = promql_metrics(rule["expr"])
        assert names <= known, f"unknown metrics {sorted(names - known)} in {rule['expr']}"


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every panel's query parses as PromQL: promtool has no parser command of its own, so each
    is checked as a recording rule (Grafana's variables replaced as Grafana would)."""
    substitutions = {"$model": ".*", "$__rate_interval": "1m", "$__interval": "1m"}
    group: list[dict[str, str]] = []
    for index, expr in enumerate(dashboard_exprs()):
        for variable, value in substitutions.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        group.append({"record": f"dashboard:panel_{index}", "expr": expr})
    assert len(group) >= 20
    path = tmp_path / "dashboard.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": group}]}))
    run("check", "rules", str(path))


def test_dashboard_shows_slo_attainment_and_burn_rates() -> None:
    """The dashboard reads the recorded attainment and burn rates, and every recorded name it
    reads is recorded by the rules."""
    used = set().union(*(promql_metrics(expr) for expr in dashboard_exprs()))
    reads = {name for name in used if ":" in name}
    assert reads <= recorded(), sorted(reads - recorded())
    for name in (
        "model_slo:tailguard_slo_attainment:ratio_rate1h",
        "model_slo:tailguard_slo_burn_rate:ratio_rate1h",
        "model_slo:tailguard_slo_burn_rate:ratio_rate6h",
        "tailguard:slo_objective:ratio",
    ):
        assert name in reads, name
