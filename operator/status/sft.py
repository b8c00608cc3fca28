"""An SFTJob's status: waiting for its data, then mirroring its training job (PyTorchJob or TrainJob)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packtrain.core.contract import TrainSummary
from packtrain.operator.deadlines import Deadlines, Stall, blocked_since, seconds_between
from packtrain.operator.deadlines import duration as _duration
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.status.conditions import (
    TERMINAL,
    Outcome,
    get_condition,
    lifecycle_conditions,
    set_condition,
    true_conditions,
)
from packtrain.operator.status.pods import unschedulable, unschedulable_too_long

# Reasons a job cannot move on by itself; their time is bounded by `Deadlines`.
BLOCKING_REASONS = frozenset({R.PACKJOB_NOT_FOUND, R.PACKJOB_FAILED, R.UNSCHEDULABLE, R.QUEUED})


# Waiting for the data


@dataclass(frozen=True)
class DataReadiness:
    ready: bool
    reason: str
    message: str


def data_readiness(ref: str, packjob: Mapping[str, Any] | None) -> DataReadiness:
    """Is the referenced PackJob's pack there? The reason says what the SFTJob waits on."""
    if packjob is None:
        return DataReadiness(
            False,
            R.PACKJOB_NOT_FOUND,
            f"waiting for PackJob {ref} to exist in this namespace (create it, or fix data.packJobRef)",
        )
    status = packjob.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Succeeded":
        return DataReadiness(
            True, R.PACKJOB_SUCCEEDED, f"PackJob {ref} succeeded: {status.get('outputPath', '')}"
        )
    if phase == "Failed":
        failed = get_condition(status.get("conditions"), "Failed") or {}
        return DataReadiness(
            False,
            R.PACKJOB_FAILED,
            f"PackJob {ref} failed ({failed.get('reason', 'unknown')}: {failed.get('message', '')}); "
            "fix it and re-create it under the same name, and this SFTJob continues",
        )
    stage = status.get("stage")
    waiting = f"waiting for PackJob {ref}: {phase}" + (f" ({stage})" if stage else "")
    ready = get_condition(status.get("conditions"), "Ready") or {}
    degraded = get_condition(status.get("conditions"), "Degraded") or {}
    # The PackJob's own blocking reason (unschedulable pods, a queue, a stalled stage), not only its phase.
    blocking = degraded if degraded.get("status") == "True" else ready
    if blocking is degraded or ready.get("reason") in BLOCKING_REASONS:
        return DataReadiness(
            False, R.PACKJOB_NOT_READY, f"{waiting}: {blocking.get('reason')}: {blocking.get('message')}"
        )
    return DataReadiness(False, R.PACKJOB_NOT_READY, waiting)


def waiting_status(
    generation: int | None,
    readiness: DataReadiness,
    previous: Mapping[str, Any] | None,
    now: str,
    deadlines: Deadlines | None = None,
) -> dict[str, Any]:
    """Phase WaitingForData, with a DataReady condition saying on what; Failed once a missing or
    failed PackJob has been waited on longer than `deadlines.data_wait`."""
    deadlines = deadlines or Deadlines()
    prev = dict(previous or {})
    conds = set_condition(
        prev.get("conditions") or [], "DataReady", False, readiness.reason, readiness.message, now, generation
    )
    status: dict[str, Any] = {"phase": "WaitingForData", "observedGeneration": generation}
    hopeless = readiness.reason in (R.PACKJOB_NOT_FOUND, R.PACKJOB_FAILED)
    blocked = blocked_since(prev, readiness.reason if hopeless else None, now)
    outcome = Outcome("WaitingForData", readiness.reason, readiness.message)
    if blocked is not None:
        status["blocked"] = blocked
        waited = seconds_between(blocked["since"], now)
        if waited > deadlines.data_wait:
            status["phase"] = "Failed"
            status["completionTime"] = now
            outcome = Outcome(
                "Failed",
                readiness.reason,
                f"gave up after {_duration(waited)} (deadline {_duration(deadlines.data_wait)}): "
                f"{readiness.message}. Delete and re-create the SFTJob once the data is there.",
            )
    status["conditions"] = lifecycle_conditions(conds, outcome, now, generation)
    return status


# The training job


def child_phase(kind: str, child: Mapping[str, Any]) -> tuple[str, str, str]:
    """(phase, reason, message) of a PyTorchJob or TrainJob from its conditions."""
    status = child.get("status") or {}
    conds = true_conditions(status.get("conditions"))
    name = (child.get("metadata") or {}).get("name", "")
    for ctype, phase in (
        ("Failed", "Failed"),
        ("Succeeded", "Succeeded"),
        ("Complete", "Succeeded"),
        ("Suspended", "Suspended"),
    ):
        if ctype in conds:
            c = conds[ctype]
            return (
                phase,
                c.get("reason") or R.of_child(kind, phase),
                c.get("message") or f"{kind} {name} {phase.lower()}",
            )
    if "Running" in conds or "Restarting" in conds:
        c = conds.get("Running") or conds["Restarting"]
        running = R.of_child(kind, "Running")
        return "Running", c.get("reason") or running, c.get("message") or f"{kind} {name} is running"
    active = sum(int(j.get("active") or 0) for j in status.get("jobsStatus") or [])
    if active:
        return "Running", R.of_child(kind, "Running"), f"{kind} {name} has {active} active jobs"
    return "Pending", R.of_child(kind, "Created"), f"{kind} {name} created; waiting for its pods to start"


# TrainSummary key (packer.contract) -> status.progress key.
_TRAIN_PROGRESS: dict[str, str] = {
    "steps": "step",
    "final_loss": "loss",
    "tokens_per_second": "tokensPerSecond",
    "eval_loss": "evalLoss",
}


def train_progress(summary: TrainSummary | Mapping[str, Any] | None, now: str) -> dict[str, Any] | None:
    """The trainer's JSON summary (a termination message) reduced to `status.progress`."""
    if not summary:
        return None
    said: Mapping[str, Any] = summary  # read by key name: the TypedDict's keys are _TRAIN_PROGRESS's
    out = {dst: said[src] for src, dst in _TRAIN_PROGRESS.items() if said.get(src) is not None}
    if not out:
        return None
    out["updatedAt"] = now
    return out


def _replicas(child: Mapping[str, Any]) -> Any:
    """The training job's replica statuses (a TrainJob's `jobsStatus` keyed by job name)."""
    child_status = child.get("status") or {}
    replicas = child_status.get("replicaStatuses")
    if replicas is None and child_status.get("jobsStatus"):
        replicas = {
            j.get("name", f"job{i}"): {k: v for k, v in j.items() if k != "name"}
            for i, j in enumerate(child_status["jobsStatus"])
        }
    return replicas


def _trainer_failed(
    kind: str, name: str, reason: str, message: str, last_failure: Mapping[str, Any] | None
) -> tuple[str, str]:
    """A failed training job's (reason, message): the trainer's own exit when a pod's was seen."""
    if not last_failure:
        return reason, f"{message}. Details: kubectl describe {kind.lower()} {name}"
    return R.TRAINER_FAILED, (
        f"the trainer exited with code {last_failure['exitCode']} in pod {last_failure['pod']}: "
        f"{last_failure['message']} ({kind}: {message})"
    )


def _data_ready(
    prev: Mapping[str, Any], data_gone: str | None, data_path: str, now: str, generation: int | None
) -> list[dict[str, Any]]:
    """DataReady: the pack trained on, or the PackJob deleted under a running job."""
    conds = prev.get("conditions") or []
    if data_gone:
        return set_condition(conds, "DataReady", False, R.PACKJOB_DELETED, data_gone, now, generation)
    return set_condition(
        conds, "DataReady", True, R.DATA_AVAILABLE, f"training on {data_path}", now, generation
    )


def _unschedulable_message(stuck: str) -> str:
    return (
        f"training pods cannot be scheduled: {stuck}. Check spec.resources (GPUs, cpu, memory, "
        "nodeSelector, tolerations) against the GPU pool, and that the claims exist"
    )


def sft_status(
    generation: int | None,
    kind: str,
    child: Mapping[str, Any],
    data_path: str,
    previous: Mapping[str, Any] | None,
    now: str,
    progress: Mapping[str, Any] | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
    *,
    deadlines: Deadlines | None = None,
    failure_seen: Mapping[str, Any] | None = None,
    data_gone: str | None = None,
    queued: str | None = None,
    stall: Stall | None = None,
) -> dict[str, Any]:
    """Mirror the child training job's state into the SFTJob's phase, conditions and replica statuses.

    `failure_seen`: a trainer pod's exit seen now (`pod_failure`); kept in `status.lastFailure`
    so the Failed condition quotes the trainer even after the child deleted the pod.
    `data_gone`: the referenced PackJob was deleted while this job uses its pack.
    `queued`: the queue name, when the child waits for the queue to admit (unsuspend) it.
    `stall`: the training-stall deadline passed (`deadlines.training_stall`): Degraded, or Failed.
    """
    deadlines = deadlines or Deadlines()
    prev = dict(previous or {})
    phase, reason, message = child_phase(kind, child)
    name = (child.get("metadata") or {}).get("name", "")
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "startTime": prev.get("startTime") or now,
        "dataPath": data_path,
        "trainingJob": {"apiVersion": child.get("apiVersion", ""), "kind": kind, "name": name},
    }
    if last_failure := failure_seen or prev.get("lastFailure"):
        status["lastFailure"] = dict(last_failure)
    suspended = None
    if phase == "Suspended":
        suspended = (reason, message)
        if queued:
            suspended = reason, message = (R.QUEUED, f"{kind} {name} waits for queue {queued} to admit it")
    degraded = None
    if stuck := unschedulable(pods) if phase in ("Pending", "Running") else None:
        reason, message = R.UNSCHEDULABLE, _unschedulable_message(stuck)
        status["blocked"] = blocked_since(prev, R.UNSCHEDULABLE, now)
        degraded = unschedulable_too_long(status["blocked"], message, now, deadlines)
    if replicas := _replicas(child):
        status["replicaStatuses"] = replicas
    if phase in TERMINAL:
        done = (child.get("status") or {}).get("completionTime")
        status["completionTime"] = prev.get("completionTime") or done or now
    if phase == "Failed":
        reason, message = _trainer_failed(kind, name, reason, message, last_failure)
    if stall is not None and degraded is None and phase == "Running":
        if stall.fail:
            phase, reason, message = "Failed", stall.reason, stall.message
            status.update(phase=phase, completionTime=prev.get("completionTime") or now)
        else:
            degraded = (stall.reason, stall.message)
    created = (R.of_child(kind, "Created"), f"{kind} {name} created")
    outcome = Outcome(phase, reason, message, created=created, suspended=suspended, degraded=degraded)
    conds = _data_ready(prev, data_gone, data_path, now, generation)
    status["conditions"] = lifecycle_conditions(conds, outcome, now, generation)
    if progress or prev.get("progress"):
        status["progress"] = dict(progress) if progress else prev["progress"]
    return status
