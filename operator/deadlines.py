"""Bounded waits: how long a job may stay blocked, and since when it has been.

Pure functions of RFC 3339 timestamps, so the status mapping stays testable without a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Deadlines:
    """How long a job may stay blocked before it turns Failed or Degraded (seconds; the chart's `deadlines`).

    dataWait: an SFTJob whose PackJob is missing or failed turns Failed.
    unschedulable: pods the scheduler cannot place turn the job Degraded (an autoscaler may still help).
    stall: a PackJob stage without progress (no index finished) turns the PackJob Degraded.
    """

    data_wait: float = 24 * 3600
    unschedulable: float = 3600
    stall: float = 6 * 3600

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Deadlines:
        keys = {"dataWaitSeconds": "data_wait", "unschedulableSeconds": "unschedulable", "stallSeconds": "stall"}
        unknown = set(raw) - set(keys)
        if unknown:
            raise ValueError(f"unknown deadline(s) {sorted(unknown)}; expected {sorted(keys)}")
        values = {keys[k]: float(v) for k, v in raw.items()}
        if any(v <= 0 for v in values.values()):
            raise ValueError(f"deadlines must be positive seconds, got {dict(raw)}")
        return cls(**values)


def seconds_between(since: str | None, now: str) -> float:
    """Seconds from `since` to `now` (RFC 3339 strings); 0 when `since` is unknown."""
    if not since:
        return 0.0
    start = datetime.fromisoformat(since.replace("Z", "+00:00"))
    end = datetime.fromisoformat(now.replace("Z", "+00:00"))
    return max((end - start).total_seconds(), 0.0)


def blocked_since(previous: Mapping[str, Any] | None, reason: str | None, now: str) -> dict[str, str] | None:
    """`status.blocked`: since when the job has been blocked for `reason` (reset when the reason changes)."""
    if reason is None:
        return None
    prev = (previous or {}).get("blocked") or {}
    if prev.get("reason") == reason and prev.get("since"):
        return {"reason": reason, "since": str(prev["since"])}
    return {"reason": reason, "since": now}


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g}h"
    if seconds >= 60:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
