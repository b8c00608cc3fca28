"""What pods say: a container's termination (exit code, JSON summary or log tail), and the scheduler's
refusal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packtrain.core.contract import parse_summary
from packtrain.operator.deadlines import Deadlines, duration, seconds_between
from packtrain.operator.names import COMPLETION_INDEX
from packtrain.operator.reasons import ConditionReason as R

# The reason the scheduler gives on PodScheduled=False (Kubernetes' word, which ours repeats).
SCHEDULER_UNSCHEDULABLE = "Unschedulable"


@dataclass(frozen=True)
class Terminated:
    """A terminated container: exit code, and its message as JSON summary or text (the log tail)."""

    exit_code: int
    message: str
    reason: str | None = None
    index: int | None = None

    @property
    def summary(self) -> dict[str, Any] | None:
        return parse_summary(self.message)


def terminated(pod: Mapping[str, Any], container: str) -> Terminated | None:
    """The terminated state of `container` in `pod`, if it has ended."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw_index = annotations.get(COMPLETION_INDEX)
    index = int(raw_index) if raw_index is not None and str(raw_index).isdigit() else None
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != container:
            continue
        state, last = status.get("state") or {}, status.get("lastState") or {}
        term = state.get("terminated") or last.get("terminated")
        if term:
            return Terminated(
                int(term.get("exitCode", 0)), term.get("message") or "", term.get("reason"), index
            )
    return None


def pod_results(pods: Sequence[Mapping[str, Any]], container: str) -> list[Terminated]:
    return [t for t in (terminated(p, container) for p in pods) if t is not None]


def detail(t: Terminated) -> str:
    """What went wrong, from a stage's JSON error report or else the log tail the kubelet kept."""
    summary = t.summary
    if summary and summary.get("error"):
        return str(summary["error"])[:600]
    return _tail(t.message)


def _tail(text: str, lines: int = 4) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-600:]


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """The scheduler's message when a pod cannot be placed (missing claim, no node in the pool, too big)."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            said = (cond.get("type"), cond.get("status"), cond.get("reason"))
            if said == ("PodScheduled", "False", SCHEDULER_UNSCHEDULABLE):
                return str(cond.get("message") or "no node fits")
    return None


def unschedulable_too_long(
    blocked: Mapping[str, Any], message: str, now: str, deadlines: Deadlines
) -> tuple[str, str] | None:
    """Degraded's (reason, message) once pods have been unschedulable past `deadlines.unschedulable`."""
    if seconds_between(blocked["since"], now) <= deadlines.unschedulable:
        return None
    limit = duration(deadlines.unschedulable)
    return R.UNSCHEDULABLE, f"pods unschedulable for longer than the {limit} deadline: {message}"


def pod_failure(pod: Mapping[str, Any], container: str, now: str) -> dict[str, Any] | None:
    """`status.lastFailure` from a trainer pod whose container exited non-zero (kept before the pod is
    gone)."""
    term = terminated(pod, container)
    if term is None or term.exit_code == 0:
        return None
    meta = pod.get("metadata") or {}
    return {
        "pod": meta.get("name", ""),
        "exitCode": term.exit_code,
        "reason": term.reason or "Error",
        "message": detail(term) or term.reason or "no message",
        "time": now,
    }
