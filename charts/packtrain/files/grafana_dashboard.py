"""Generates grafana-dashboard.json beside this file: `python charts/packtrain/files/grafana_dashboard.py`.

The metric names come from where they are defined: the trainer's from the pods' contract
(`packtrain.core.contract`), the operator's from `packtrain.operator.metrics`. METRICS
only gives them the short keys the panels use; tests/chart/test_dashboard.py fails when the
committed JSON differs from what this script generates, so a renamed metric reaches the JSON.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from packtrain.core import contract
from packtrain.operator import metrics as operator

METRICS: dict[str, str] = {
    "tokens_per_second": contract.TRAIN_TOKENS_PER_SECOND,
    "effective_tokens_per_second": contract.TRAIN_EFFECTIVE_TOKENS_PER_SECOND,
    "padding_ratio": contract.TRAIN_PADDING_RATIO,
    "mfu": contract.TRAIN_MFU,
    "sm_utilization_percent": contract.TRAIN_GPU_SM_UTILIZATION,
    "loss": contract.TRAIN_LOSS,
    "jobs": operator.JOBS_BY_PHASE,
    "reconciles": operator.RECONCILES_TOTAL,
    "reconcile_errors": operator.RECONCILE_ERRORS_TOTAL,
    "stage_duration": operator.STAGE_DURATION,
}

OUTPUT = Path(__file__).with_name("grafana-dashboard.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NS = 'namespace=~"$namespace"'


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(
    pid: int,
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    grid: tuple[int, int, int, int],
    *,
    unit: str = "short",
    stacked: bool = False,
    max_value: float | None = None,
) -> dict[str, Any]:
    x, y, w, h = grid
    defaults: dict[str, Any] = {
        "unit": unit,
        "min": 0,
        "custom": {
            "drawStyle": "line",
            "fillOpacity": 20 if stacked else 10,
            "lineWidth": 1,
            "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        },
    }
    if max_value is not None:
        defaults["max"] = max_value
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [_target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)],
    }


def _row(pid: int, title: str, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def build() -> dict[str, Any]:
    m = METRICS
    by_pod = "sum by (namespace, pod)"
    panels = [
        _row(1, "Training", 0),
        _panel(
            2,
            "Throughput",
            "Tokens per second per trainer pod: all tokens, and effective (non-padding) tokens.",
            [
                (f"{by_pod} ({m['tokens_per_second']}{{{NS}}})", "{{namespace}}/{{pod}} total"),
                (f"{by_pod} ({m['effective_tokens_per_second']}{{{NS}}})", "{{namespace}}/{{pod}} effective"),
            ],
            (0, 1, 12, 8),
            unit="short",
        ),
        _panel(
            3,
            "Padding ratio",
            "Share of each packed batch that is padding (0 to 1).",
            [(f"max by (namespace, pod) ({m['padding_ratio']}{{{NS}}})", "{{namespace}}/{{pod}}")],
            (12, 1, 12, 8),
            unit="percentunit",
            max_value=1,
        ),
        _panel(
            4,
            "MFU",
            "Model FLOPs utilization: achieved over peak bf16 FLOP/s (0 to 1).",
            [(f"avg by (namespace, pod) ({m['mfu']}{{{NS}}})", "{{namespace}}/{{pod}}")],
            (0, 9, 8, 8),
            unit="percentunit",
            max_value=1,
        ),
        _panel(
            5,
            "GPU SM utilization",
            "Streaming-multiprocessor utilization per GPU, from NVML (percent).",
            [
                (
                    f"avg by (namespace, pod, gpu) ({m['sm_utilization_percent']}{{{NS}}})",
                    "{{namespace}}/{{pod}} gpu {{gpu}}",
                )
            ],
            (8, 9, 8, 8),
            unit="percent",
            max_value=100,
        ),
        _panel(
            6,
            "Loss",
            "Training loss.",
            [(f"avg by (namespace, pod) ({m['loss']}{{{NS}}})", "{{namespace}}/{{pod}}")],
            (16, 9, 8, 8),
        ),
        _row(7, "Operator", 17),
        _panel(
            8,
            "Jobs by phase",
            "PackJobs and SFTJobs the operator tracks, by kind and phase.",
            [(f"sum by (kind, phase) ({m['jobs']})", "{{kind}} {{phase}}")],
            (0, 18, 8, 8),
            stacked=True,
        ),
        _panel(
            9,
            "Reconciles",
            "Reconcile rate and reconcile error rate, by kind.",
            [
                (f"sum by (kind) (rate({m['reconciles']}[$__rate_interval]))", "{{kind}}"),
                # An error counter has no series before its first error: draw those kinds at 0.
                (
                    f"sum by (kind) (rate({m['reconcile_errors']}[$__rate_interval])) "
                    f"or 0 * sum by (kind) (rate({m['reconciles']}[$__rate_interval]))",
                    "{{kind}} errors",
                ),
            ],
            (8, 18, 8, 8),
            unit="ops",
        ),
        _panel(
            10,
            "Stage duration (p50, p95)",
            "Duration of PackJob and SFTJob stages.",
            [
                (
                    "histogram_quantile(0.5, sum by (le, stage) "
                    f"(rate({m['stage_duration']}_bucket[$__rate_interval])))",
                    "{{stage}} p50",
                ),
                (
                    "histogram_quantile(0.95, sum by (le, stage) "
                    f"(rate({m['stage_duration']}_bucket[$__rate_interval])))",
                    "{{stage}} p95",
                ),
            ],
            (16, 18, 8, 8),
            unit="s",
        ),
    ]
    return {
        "uid": "packtrain",
        "title": "packtrain",
        "description": "Packed SFT throughput, padding, MFU and SM utilization, and operator job phases.",
        "tags": ["packtrain"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "options": [],
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {
                        "query": f"label_values({m['tokens_per_second']}, namespace)",
                        "refId": "namespace",
                    },
                    "definition": f"label_values({m['tokens_per_second']}, namespace)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {},
                    "hide": 0,
                    "refresh": 2,
                    "sort": 1,
                    "options": [],
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


if __name__ == "__main__":
    OUTPUT.write_text(render())
