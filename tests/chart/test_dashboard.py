"""The Grafana dashboard: generated from one list of metric names that the package really exports."""

from __future__ import annotations

import importlib.util
import json
import re
from types import ModuleType
from typing import Any

from .helm import CHART, REPO

GENERATOR = CHART / "files" / "grafana_dashboard.py"
# Histograms are queried through the series Prometheus derives from them.
DERIVED_SUFFIXES = ("_bucket", "_sum", "_count")


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_dashboard", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exprs(dashboard: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    out += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return out


def test_committed_json_is_generated() -> None:
    """Edit grafana_dashboard.py and run it; never the JSON."""
    assert (CHART / "files" / "grafana-dashboard.json").read_text() == generator().render()


def test_queries_use_only_the_listed_metrics() -> None:
    metrics = set(generator().METRICS.values())
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    used = set()
    for expr in exprs(dashboard):
        for name in re.findall(r"\bpacktrain_[a-z0-9_]+", expr):
            for suffix in DERIVED_SUFFIXES:
                if name.endswith(suffix) and name.removesuffix(suffix) in metrics:
                    name = name.removesuffix(suffix)
            used.add(name)
    assert used == metrics


def test_panels_cover_the_issue() -> None:
    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Throughput", "Padding ratio", "MFU", "GPU SM utilization", "Loss", "Jobs by phase"} <= titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    # Panels must not overlap on Grafana's 24-column grid.
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, panel["title"]
        cells |= area


def exported_metric_names() -> set[str]:
    """Names the trainer and the operator export: their registries, plus the GPU gauges (which exist
    only where NVML finds a GPU) and names written out in the sources."""
    import torch
    from prometheus_client import CollectorRegistry

    from packtrain.core import contract
    from packtrain.operator import metrics as operator_metrics
    from packtrain.trainer.metrics import TrainMetrics

    trainer = TrainMetrics(rank=0, device=torch.device("cpu"))
    trainer.enable_mfu(1.0)
    registries: list[CollectorRegistry] = [operator_metrics.REGISTRY, trainer.registry]
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    # The GPU gauges exist only where NVML finds a GPU: the trainer names them from the contract.
    names |= {
        contract.TRAIN_GPU_SM_UTILIZATION,
        contract.TRAIN_GPU_MEMORY_USED,
        contract.TRAIN_GPU_MEMORY_TOTAL,
    }
    for folder in ("trainer", "operator"):
        for path in (REPO / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](packtrain_[a-z0-9_]+)[\"']", path.read_text()))
    return names


def test_every_metric_is_exported_by_the_package() -> None:
    missing = sorted(set(generator().METRICS.values()) - exported_metric_names())
    assert not missing, f"the dashboard queries metrics no source declares: {missing}"
