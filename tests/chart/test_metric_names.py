"""Every metric the chart's alerts and dashboard query is one the package defines: the trainer's in
the pods' contract, the operator's in `operator/metrics.py`. A renamed metric fails here, not silently
in a Prometheus that alerts on nothing."""

from __future__ import annotations

import json
import re

import pytest

from packtrain.core import contract
from packtrain.operator import metrics as operator_metrics

from .helm import CHART, render

NAME = re.compile(r"\bpacktrain_[a-z0-9_]+")
# Histograms are queried through the series Prometheus derives from them.
DERIVED_SUFFIXES = ("_bucket", "_sum", "_count")
RULE_TEMPLATE = CHART / "templates" / "prometheusrule.yaml"
DASHBOARD = CHART / "files" / "grafana-dashboard.json"


def defined() -> set[str]:
    """The contract's metric names, and the names the operator's registry exposes (a counter's `_total`)."""
    names = {
        value
        for key, value in vars(contract).items()
        if key.isupper() and isinstance(value, str) and NAME.fullmatch(value)
    }
    names.discard(contract.TRAIN_METRIC_PREFIX)
    for family in operator_metrics.REGISTRY.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def undefined(text: str, known: set[str]) -> list[str]:
    used = {m for m in NAME.findall(text)}
    base = {next((n.removesuffix(s) for s in DERIVED_SUFFIXES if n.endswith(s)), n) for n in used}
    return sorted(n for n in base if n not in known)


def test_the_contract_names_the_trainer_gauges_the_operator_reads() -> None:
    names = defined()
    assert {contract.TRAIN_STEP, contract.TRAIN_DATA_WAIT, contract.TRAIN_GPU_SM_UTILIZATION} <= names
    assert operator_metrics.RECONCILES_TOTAL in names and operator_metrics.STAGE_DURATION in names


def test_the_prometheus_rule_queries_only_defined_metrics() -> None:
    """The template's text (every group, enabled or not) and the rules as Helm renders them."""
    on = {"metrics": {"prometheusRule": {"enabled": True}}}
    (rule,) = [o for o in render(on) if o["kind"] == "PrometheusRule"]
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert exprs and all(NAME.search(e) for e in exprs)
    known = defined()
    assert not undefined(RULE_TEMPLATE.read_text(), known)
    assert not undefined("\n".join(exprs), known)


def test_the_dashboard_queries_only_defined_metrics() -> None:
    text = DASHBOARD.read_text()
    assert NAME.search(text)
    assert not undefined(json.dumps(json.loads(text)), defined())


@pytest.mark.parametrize("renamed", ["packtrain_train_steps", "packtrain_operator_job"])
def test_a_name_nobody_defines_is_found(renamed: str) -> None:
    """The check itself: a misspelt or renamed metric in a query is reported."""
    assert undefined(f"max(changes({renamed}[5m])) == 0", defined()) == [renamed]
