"""What to do for an SFTJob, from what the handler read: create its training job (on which data),
write a status instead (refused, waiting for data), or mirror the training job that exists.

Pure, like `pack.PackDecision`: the handler reads from the cache, calls these, and acts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packtrain.operator import builders, policy
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.builders import DataSource
from packtrain.operator.children import ChildKind
from packtrain.operator.deadlines import Stall
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.settings import OperatorDefaults
from packtrain.operator.status.conditions import TERMINAL
from packtrain.operator.status.memory import context_parallel_refusal, memory_verdict
from packtrain.operator.status.pods import pod_failure, terminated
from packtrain.operator.status.refused import failed_status, policy_status
from packtrain.operator.status.sft import (
    child_phase,
    data_readiness,
    sft_status,
    train_progress,
    waiting_status,
)


@dataclass(frozen=True)
class SFTDecision:
    """Before the training job exists: the status to write now (refused, waiting for data), or the
    data to create the training job on (`create`; its status is mirrored once it exists)."""

    status: dict[str, Any] | None = None
    create: DataSource | None = None
    memory_plan: dict[str, Any] | None = None  # status.memoryPlan of the job about to be created


def decide_start(
    body: Mapping[str, Any],
    spec: SFTJobSpec,
    defaults: OperatorDefaults,
    packjob: Mapping[str, Any] | None,
    evaljob: Mapping[str, Any] | None,
    now: str,
) -> SFTDecision:
    """The policy first, then context parallelism against the world (no use waiting for data a job
    cannot split), the training pack (`data.packJobRef`), the evaluation pack, the memory plan."""
    if violations := policy.check(spec, defaults):
        return SFTDecision(status=policy_status("SFTJob", body, violations, now))
    if (split := context_parallel_refusal(spec)) is not None:
        message = f"{split}. Fix it, then delete and re-create the SFTJob."
        return SFTDecision(status=failed_status(body, R.INVALID_CONFIGURATION, message, now))
    generation, prev = body["metadata"].get("generation"), body.get("status") or {}
    pack_spec, pack_status = None, None
    if (ref := spec.data.pack_job_ref) is not None:
        readiness = data_readiness(ref, packjob)
        if not readiness.ready or packjob is None:
            return SFTDecision(status=waiting_status(generation, readiness, prev, now, defaults.deadlines))
        pack_spec, pack_status = PackJobSpec.model_validate(packjob["spec"]), packjob.get("status")
    data = builders.data_source(spec, pack_spec, pack_status)
    if (eval_ref := spec.data.eval_pack_job_ref) is not None:
        readiness = data_readiness(eval_ref, evaljob)
        if not readiness.ready or evaljob is None:
            return SFTDecision(status=waiting_status(generation, readiness, prev, now, defaults.deadlines))
        evals = builders.eval_source(data, eval_ref, PackJobSpec.model_validate(evaljob["spec"]))
        data = dataclasses.replace(data, eval=evals)
    verdict = memory_verdict(spec, defaults.policy, pack_spec, pack_status)
    if verdict.invalid is not None:
        message = f"{verdict.invalid}. Fix it, then delete and re-create the SFTJob."
        return SFTDecision(status=failed_status(body, R.INVALID_CONFIGURATION, message, now))
    if verdict.refusal is not None:
        message = f"{verdict.refusal}. Fix it, then delete and re-create the SFTJob."
        return SFTDecision(status=failed_status(body, R.INSUFFICIENT_GPU_MEMORY, message, now))
    return SFTDecision(create=data, memory_plan=verdict.status)


def _new_failure(
    pods: Sequence[Mapping[str, Any]], container: str, prev: Mapping[str, Any], now: str
) -> dict[str, Any] | None:
    """A trainer pod's non-zero exit not yet in `status.lastFailure` (a recorded one keeps its first time)."""
    failure = next((f for f in (pod_failure(p, container, now) for p in pods) if f is not None), None)
    known = prev.get("lastFailure") or {}
    if failure and (failure["pod"], failure["exitCode"]) == (known.get("pod"), known.get("exitCode")):
        return None
    return failure


def _final_progress(
    spec: SFTJobSpec, pods: Sequence[Mapping[str, Any]], container: str, now: str
) -> dict[str, Any] | None:
    """A finished job's progress, from the first trainer summary its pods left."""
    found = None
    for p in pods:
        term = terminated(p, container)
        found = found or (train_progress(term.summary, now) if term else None)
    if found is not None and (max_steps := spec.training.fixed_steps()) is not None:
        found["maxSteps"] = max_steps
    return found


def mirror(
    body: Mapping[str, Any],
    spec: SFTJobSpec,
    kind: ChildKind,
    child: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    *,
    data_path: str,
    pack_present: bool,
    stall: Stall | None,
    defaults: OperatorDefaults,
    now: str,
) -> dict[str, Any]:
    """The status of an SFTJob whose training job exists: the child's state, what its pods said,
    whether its PackJob is still there (`pack_present`), and the training-stall deadline (`stall`)."""
    prev = body.get("status") or {}
    phase = child_phase(kind.kind, child)[0]
    terminal = phase in TERMINAL
    ref = spec.data.pack_job_ref
    data_gone = None
    if ref is not None and not terminal and not pack_present:
        data_gone = (
            f"PackJob {ref} was deleted while this SFTJob trains on its pack; the files stay on the claim "
            f"until removed, but re-creating PackJob {ref} now would rewrite them under a running job"
        )
    status = sft_status(
        body["metadata"].get("generation"),
        kind.kind,
        child,
        data_path,
        prev,
        now,
        _final_progress(spec, pods, kind.container, now) if terminal else None,
        pods=pods,
        deadlines=defaults.deadlines,
        failure_seen=_new_failure(pods, kind.container, prev, now),
        data_gone=data_gone,
        queued=spec.queue_name if phase == "Suspended" and not spec.suspend else None,
        stall=stall,
    )
    if prev.get("memoryPlan"):  # the plan the training job was created on
        status["memoryPlan"] = prev["memoryPlan"]
    if prev.get("scrapeError"):  # kept while it says something about a running trainer
        status["scrapeError"] = prev["scrapeError"] if status["phase"] == "Running" else None
    return status
