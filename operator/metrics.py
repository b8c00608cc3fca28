"""Operator metrics on `/metrics` (Prometheus): reconciles, errors, jobs by phase, stage durations."""

from __future__ import annotations

import threading
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from packtrain.core.contract import PACK_STAGES

# The names as Prometheus shows them (a counter's with `_total`): the chart's dashboard queries these.
RECONCILES_TOTAL: Final = "packtrain_operator_reconciles_total"
RECONCILE_ERRORS_TOTAL: Final = "packtrain_operator_reconcile_errors_total"
JOBS_BY_PHASE: Final = "packtrain_operator_jobs"
STAGE_DURATION: Final = "packtrain_operator_stage_duration_seconds"

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILES = Counter(
    RECONCILES_TOTAL,
    "Reconciliations run, by custom resource kind.",
    ["kind"],
    registry=REGISTRY,
)
ERRORS = Counter(
    RECONCILE_ERRORS_TOTAL,
    "Reconciliations that raised, by kind and error class.",
    ["kind", "error"],
    registry=REGISTRY,
)
JOBS = Gauge(
    JOBS_BY_PHASE,
    "Custom resources this operator tracks, by kind and phase.",
    ["kind", "phase"],
    registry=REGISTRY,
)
STAGE_SECONDS = Histogram(
    STAGE_DURATION,
    "Wall time of finished PackJob stages (Job start to completion).",
    ["stage"],
    buckets=(10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400, 28800, 86400),
    registry=REGISTRY,
)
# Every labelled series exists from 0 at start: a stage observed once per pack would otherwise
# appear already at 1, and rate()/histogram_quantile() would never see its first observation.
for _stage in PACK_STAGES:
    STAGE_SECONDS.labels(_stage)
for _kind in ("PackJob", "SFTJob"):
    RECONCILES.labels(_kind)


class PhaseTracker:
    """Phase of every resource seen, so `packtrain_operator_jobs` counts each resource once."""

    def __init__(self, gauge: Gauge = JOBS) -> None:
        self._gauge = gauge
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, key: str, phase: str | None) -> None:
        with self._lock:
            old = self._phases.get((kind, key))
            if old == phase:
                return
            if old is not None:
                self._gauge.labels(kind, old).dec()
            if phase is None:
                self._phases.pop((kind, key), None)
            else:
                self._phases[(kind, key)] = phase
                self._gauge.labels(kind, phase).inc()

    def forget(self, kind: str, key: str) -> None:
        self.record(kind, key, None)


PHASES = PhaseTracker()


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics HTTP server in a daemon thread (port 0: disabled)."""
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
