"""The optional PrometheusRule: rendered from the values, checked and unit-tested by Prometheus' own promtool.

`promtool test rules` evaluates the alerts with Prometheus' rule engine over synthetic series:
each alert fires on the trouble it names and stays quiet on a healthy run. The end-to-end test
(tests/e2e/test_prometheus.py) evaluates the same expressions against a real scrape.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from .helm import render

ALERTS = {"PacktrainTrainingStalled", "PacktrainDataWaitDominating", "PacktrainLowSMUtilization"}


def rules_of(values: dict[str, Any]) -> list[dict[str, Any]]:
    found = [o for o in render(values) if o["kind"] == "PrometheusRule"]
    assert len(found) == 1
    return list(found[0]["spec"]["groups"])


def enabled(**overrides: Any) -> dict[str, Any]:
    return {"metrics": {"prometheusRule": {"enabled": True, **overrides}}}


def test_off_by_default() -> None:
    assert not [o for o in render({}) if o["kind"] == "PrometheusRule"]


def test_values_reach_the_rules() -> None:
    groups = rules_of(
        enabled(
            labels={"release": "prom"},
            dataWait={"fraction": 0.3, "window": "7m"},
            smUtilization={"percent": 25, "severity": "critical"},
        )
    )
    rules = {r["alert"]: r for g in groups for r in g["rules"]}
    assert set(rules) == ALERTS
    assert "[7m]" in rules["PacktrainDataWaitDominating"]["expr"]
    assert rules["PacktrainDataWaitDominating"]["expr"].endswith("> 0.3")
    assert rules["PacktrainLowSMUtilization"]["expr"].endswith("< 25")
    assert rules["PacktrainLowSMUtilization"]["labels"] == {"severity": "critical"}
    # Alert templates reach Prometheus unrendered by Helm.
    assert "{{ $labels.namespace }}" in rules["PacktrainTrainingStalled"]["annotations"]["summary"]
    obj = next(o for o in render(enabled(labels={"release": "prom"})) if o["kind"] == "PrometheusRule")
    assert obj["metadata"]["labels"]["release"] == "prom"


def _promtool(promtool: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# Synthetic series, one sample a minute: a healthy trainer, and one with each trouble.
HEALTHY = 'namespace="team",pod="ok-master-0",rank="0"'
SICK = 'namespace="team",pod="bad-master-0",rank="0"'
UNIT_TESTS = {
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                {"series": f"packtrain_train_step{{{HEALTHY}}}", "values": "0+1x40"},
                {"series": f"packtrain_train_step{{{SICK}}}", "values": "5x40"},
                {"series": f"packtrain_train_data_wait_seconds{{{HEALTHY}}}", "values": "0.05x40"},
                {"series": f"packtrain_train_data_wait_seconds{{{SICK}}}", "values": "0.8x40"},
                {"series": f"packtrain_train_step_seconds{{{HEALTHY}}}", "values": "1x40"},
                {"series": f"packtrain_train_step_seconds{{{SICK}}}", "values": "1x40"},
                {
                    "series": f'packtrain_gpu_sm_utilization_percent{{{HEALTHY},gpu="0",source="gpm"}}',
                    "values": "85x40",
                },
                {
                    "series": f'packtrain_gpu_sm_utilization_percent{{{SICK},gpu="0",source="gpm"}}',
                    "values": "12x40",
                },
            ],
            "alert_rule_test": [],  # filled by unit_tests() from the rendered descriptions
        }
    ],
}


# What each alert says about the sick pod at 40m (its annotations render these templates).
EXPECTED = {
    "PacktrainTrainingStalled": ("warning", "Training in team/bad-master-0 made no optimizer step for 15m."),
    "PacktrainDataWaitDominating": (
        "warning",
        "Training in team/bad-master-0 spends 80% of each step waiting for data.",
    ),
    "PacktrainLowSMUtilization": ("info", "GPU SM utilization of team/bad-master-0 averages 12%."),
}


def unit_tests(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """promtool's test file: only the sick pod fires, each alert with its labels and rendered annotations."""
    descriptions = {r["alert"]: r["annotations"]["description"] for g in groups for r in g["rules"]}
    tests = copy.deepcopy(UNIT_TESTS)
    tests["tests"][0]["alert_rule_test"] = [
        {
            "eval_time": "40m",
            "alertname": name,
            "exp_alerts": [
                {
                    "exp_labels": {"severity": severity, "namespace": "team", "pod": "bad-master-0"},
                    "exp_annotations": {"summary": summary, "description": descriptions[name]},
                }
            ],
        }
        for name, (severity, summary) in EXPECTED.items()
    ]
    return {"rule_files": ["rules.yaml"], **tests}


def test_promtool_checks_and_unit_tests_the_rules(
    prometheus_tools: tuple[Path, Path], tmp_path: Path
) -> None:
    _, promtool = prometheus_tools
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules_of(enabled())}))
    checked = _promtool(promtool, "check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 3 rules found" in checked.stdout + checked.stderr
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(unit_tests(rules_of(enabled()))))
    tested = _promtool(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_promtool_test_fails_when_an_alert_would_not_fire(
    prometheus_tools: tuple[Path, Path], tmp_path: Path
) -> None:
    """The unit test above can fail: with a threshold the sick series does not cross, it does."""
    _, promtool = prometheus_tools
    rules = rules_of(enabled(dataWait={"fraction": 0.9}))
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rules}))
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(unit_tests(rules)))
    tested = _promtool(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert tested.returncode != 0
    assert "PacktrainDataWaitDominating" in tested.stdout + tested.stderr


@pytest.mark.parametrize(
    "bad",
    [
        {"dataWait": {"fraction": 2}},
        {"smUtilization": {"percent": -1}},
        {"stalledTraining": {"window": "ten minutes"}},
    ],
)
def test_schema_refuses_bad_thresholds(bad: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="schema|values"):
        render(enabled(**bad))
