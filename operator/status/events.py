"""The Event a status change posts on its custom resource: what changed, Normal or Warning."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.status.conditions import get_condition

# Reasons that deserve a Warning event although the phase is not Failed.
WARNING_REASONS = frozenset(
    {
        R.PACKJOB_FAILED,
        R.PACKJOB_NOT_FOUND,
        R.PACKJOB_DELETED,
        R.UNSCHEDULABLE,
        R.STAGE_STALLED,
        R.TRAINER_FAILED,
        R.TRAINING_STALLED,
        R.NO_LIVE_PROGRESS,
    }
)


def event_reason(status: Mapping[str, Any] | None) -> str | None:
    """What an Event reports on: a passed deadline (`Degraded:<reason>`) first, else the current (Ready)
    reason.

    The Degraded prefix keeps a deadline passing apart from the wait it ends (both `Unschedulable`).
    """
    conds = (status or {}).get("conditions")
    degraded = get_condition(conds, "Degraded") or {}
    if degraded.get("status") == "True":
        return f"Degraded:{degraded.get('reason')}"
    data = get_condition(conds, "DataReady") or {}
    if data.get("reason") == R.PACKJOB_DELETED:
        return str(R.PACKJOB_DELETED)
    reason = (get_condition(conds, "Ready") or {}).get("reason")
    return None if reason is None else str(reason)


def transition_event(
    previous_phase: str | None, previous_reason: str | None, status: Mapping[str, Any]
) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event to post when the phase or its reason changed, else None."""
    phase = status.get("phase")
    key = event_reason(status) or str(phase)
    if not phase or (phase == previous_phase and key == previous_reason):
        return None
    conds = status.get("conditions")
    where, _, reason = key.rpartition(":")
    # The message of the condition that holds the reason now: a passed deadline, the failure, the data, Ready.
    said: Mapping[str, Any] = {}
    for ctype in (where or "Failed", "DataReady", "Ready"):
        c = get_condition(conds, ctype) or {}
        if c.get("reason") == reason and (ctype in ("DataReady", "Ready") or c.get("status") == "True"):
            said = c
            break
    kind = "Warning" if phase == "Failed" or reason in WARNING_REASONS else "Normal"
    return kind, reason, str(said.get("message") or phase)


def memory_plan_event(
    previous: Mapping[str, Any] | None, status: Mapping[str, Any]
) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event for the GPU memory plan an SFTJob's training job was
    created on, once: when `status.memoryPlan` first appears (a refused job's Event is its failure)."""
    plan = status.get("memoryPlan")
    if not isinstance(plan, Mapping) or (previous or {}).get("memoryPlan"):
        return None
    reason = R.MEMORY_PLANNED if plan.get("planned") else R.MEMORY_NOT_PLANNED
    return "Normal", str(reason), str(plan.get("message") or reason)
