"""metav1.Conditions: upserted one at a time, and the lifecycle set every PackJob and SFTJob carries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packtrain.operator.reasons import ConditionReason as R

TERMINAL = frozenset({"Succeeded", "Failed"})
RUNNING_PHASES = frozenset({"Converting", "Planning", "Materializing", "Running"})
_MAX_MESSAGE = 1000


def set_condition(
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: bool,
    reason: str,
    message: str,
    now: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """Upsert a metav1.Condition; `lastTransitionTime` moves only when the status flips."""
    value = "True" if status else "False"
    out: list[dict[str, Any]] = []
    found = False
    for cond in conditions:
        if cond.get("type") != type_:
            out.append(dict(cond))
            continue
        found = True
        since = cond.get("lastTransitionTime") if cond.get("status") == value else now
        out.append(_condition(type_, value, reason, message, since or now, generation))
    if not found:
        out.append(_condition(type_, value, reason, message, now, generation))
    return out


def _condition(type_: str, value: str, reason: str, message: str, since: str, generation: int | None) -> dict:
    cond: dict[str, Any] = {
        "type": type_,
        "status": value,
        "reason": str(reason),  # a plain str (a ConditionReason member dumps as one everywhere)
        "message": message[:_MAX_MESSAGE],
        "lastTransitionTime": since,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def get_condition(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def true_conditions(conditions: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """The conditions whose status is True, by type."""
    return {c.get("type", ""): c for c in conditions or () if c.get("status") == "True"}


@dataclass(frozen=True)
class Outcome:
    """What the conditions say: the phase, why, and the side facts each condition reports on its own."""

    phase: str
    reason: str
    message: str
    created: tuple[str, str] | None = None  # (reason, message) once a child exists
    suspended: tuple[str, str] | None = None  # (reason, message) while suspended or queued
    degraded: tuple[str, str] | None = None  # (reason, message) once a deadline has passed


def lifecycle_conditions(
    previous: Sequence[Mapping[str, Any]], outcome: Outcome, now: str, generation: int | None
) -> list[dict[str, Any]]:
    """Created, Running, Suspended, Succeeded, Failed and Degraded as Kubeflow jobs carry them, plus Ready.

    Each says its own thing: Created why the child exists, Running what runs (or why not),
    Succeeded/Failed the outcome. Ready mirrors the phase's current reason for tools that read one
    condition (Argo CD's health checks, `kubectl wait --for=condition=Ready`).
    """
    o = outcome
    conds = set_condition(previous, "Ready", o.phase == "Succeeded", o.reason, o.message, now, generation)
    created = o.created or (R.NOT_CREATED, f"nothing created yet: {o.message}")
    conds = set_condition(conds, "Created", o.created is not None, *created, now, generation)
    conds = set_condition(conds, "Running", *_running(o), now, generation)
    suspended = o.suspended or (R.NOT_SUSPENDED, "")
    conds = set_condition(conds, "Suspended", o.suspended is not None, *suspended, now, generation)
    succeeded = o.phase == "Succeeded"
    not_succeeded = R.FAILED if o.phase == "Failed" else R.NOT_FINISHED
    conds = set_condition(
        conds,
        "Succeeded",
        succeeded,
        o.reason if succeeded else not_succeeded,
        o.message if succeeded else "",
        now,
        generation,
    )
    failed = o.phase == "Failed"
    conds = set_condition(
        conds,
        "Failed",
        failed,
        o.reason if failed else R.NO_FAILURE,
        o.message if failed else "",
        now,
        generation,
    )
    degraded = o.degraded or (R.AS_EXPECTED, "")
    return set_condition(conds, "Degraded", o.degraded is not None, *degraded, now, generation)


def _running(o: Outcome) -> tuple[bool, str, str]:
    """(status, reason, message) of Running: what runs, else why not (suspended, stuck, or the phase)."""
    stuck = o.reason == R.UNSCHEDULABLE  # nothing runs while no pod can be placed
    running = o.phase in RUNNING_PHASES and o.suspended is None and not stuck
    if running:
        return True, o.reason, o.message
    message = o.message if stuck else ""
    if o.suspended and o.phase not in TERMINAL:
        return False, o.suspended[0], message
    return False, o.reason if stuck else o.phase, message
