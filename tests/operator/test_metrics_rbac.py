"""Operator metrics and the RBAC rules the chart grants."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from packtrain.operator import metrics, rbac
from packtrain.operator.metrics import PhaseTracker


def test_phase_tracker_counts_each_resource_once() -> None:
    gauge = Gauge("jobs", "test", ["kind", "phase"], registry=CollectorRegistry())
    tracker = PhaseTracker(gauge)
    tracker.record("PackJob", "ml/a", "Converting")
    tracker.record("PackJob", "ml/b", "Converting")
    tracker.record("PackJob", "ml/a", "Converting")
    assert gauge.labels("PackJob", "Converting")._value.get() == 2
    tracker.record("PackJob", "ml/a", "Planning")
    tracker.forget("PackJob", "ml/b")
    assert gauge.labels("PackJob", "Converting")._value.get() == 0
    assert gauge.labels("PackJob", "Planning")._value.get() == 1
    tracker.forget("PackJob", "ml/a")


def test_metric_names_are_exposed() -> None:
    metrics.RECONCILES.labels("PackJob").inc()
    metrics.STAGE_SECONDS.labels("convert").observe(12.0)
    text = generate_latest(metrics.REGISTRY).decode()
    for name in (
        "packtrain_operator_reconciles_total",
        "packtrain_operator_reconcile_errors_total",
        "packtrain_operator_jobs",
        "packtrain_operator_stage_duration_seconds_bucket",
    ):
        assert name in text


def test_rbac_rules_are_least_privilege() -> None:
    for rule in rbac.RULES:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
        # Children are deleted by the garbage collector; the operator deletes only the training job
        # of an SFTJob it failed for a training stall.
        assert "delete" not in rule["verbs"] or rule["resources"] in (["pytorchjobs"], ["trainjobs"]), rule
    assert not rbac.allows(rbac.RULES, "", "secrets", "get")
    assert rbac.allows(rbac.RULES, "batch", "jobs", "create")
    assert rbac.allows(rbac.RULES, "packtrain.dev", "sftjobs/status", "patch")
    assert rbac.RULES == rbac.NAMESPACED_RULES + rbac.CLUSTER_RULES
