"""Pure status mapping: child objects in, phase/conditions/stats out.

The handlers read Jobs, pods and Kubeflow jobs from the API and hand them here
as plain dicts; what a user sees in `kubectl get`/`describe` is decided by these
functions alone, so every transition is unit-tested without a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .api import PackJobSpec
from .builders import pack_job_name, pack_output_dir
from .commands import EXIT_CONFIG, PACK_STAGES, PackStage

STAGE_PHASE: dict[str, str] = {"convert": "Converting", "plan": "Planning", "materialize": "Materializing"}
TERMINAL = frozenset({"Succeeded", "Failed"})
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_MAX_MESSAGE = 1000


# Conditions


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
    cond = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:_MAX_MESSAGE],
        "lastTransitionTime": since,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


def get_condition(conditions: Sequence[Mapping[str, Any]] | None, type_: str) -> Mapping[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)


def _outcome_conditions(
    previous: Sequence[Mapping[str, Any]],
    phase: str,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
    ready: bool,
) -> list[dict[str, Any]]:
    """The standard trio: Ready, Succeeded, Failed, all carrying the current reason."""
    conds = set_condition(previous, "Ready", ready, reason, message, now, generation)
    conds = set_condition(conds, "Succeeded", phase == "Succeeded", reason, message, now, generation)
    return set_condition(conds, "Failed", phase == "Failed", reason, message, now, generation)


# Children the API server refuses

# 403: a ResourceQuota, an admission policy or webhook, RBAC; 422: an object the server finds invalid.
# Retrying would be refused the same way, so the parent fails with the server's own words.
REFUSED_CODES = frozenset({400, 403, 422})


def refusal_message(kind: str, name: str, code: int | None, reason: str | None, body: Any) -> str:
    """What the API server said when it refused to create a child (its Status message, else its reason)."""
    said = ""
    try:
        doc = json.loads(body) if isinstance(body, str | bytes) else body
    except ValueError:
        doc = None
    if isinstance(doc, Mapping):
        said = str(doc.get("message") or "")
    said = said or (body.decode(errors="replace") if isinstance(body, bytes) else str(body or ""))
    said = said.strip() or str(reason or "no message")
    return f"the API server refused to create {kind} {name} ({code} {reason or ''}".rstrip() + f"): {said}"


# Pods: termination messages


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


def parse_summary(message: str | None) -> dict[str, Any] | None:
    """The JSON object a stage wrote to its termination log, or None for plain text."""
    if not message:
        return None
    text = message.strip()
    if not text.startswith("{"):
        return None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def terminated(pod: Mapping[str, Any], container: str) -> Terminated | None:
    """The terminated state of `container` in `pod`, if it has ended."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    raw_index = annotations.get(COMPLETION_INDEX)
    index = int(raw_index) if raw_index is not None and str(raw_index).isdigit() else None
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != container:
            continue
        term = (status.get("state") or {}).get("terminated") or (status.get("lastState") or {}).get(
            "terminated"
        )
        if term:
            return Terminated(
                int(term.get("exitCode", 0)), term.get("message") or "", term.get("reason"), index
            )
    return None


def _detail(t: Terminated) -> str:
    """What went wrong, from a stage's JSON error report or else the log tail the kubelet kept."""
    summary = t.summary
    if summary and summary.get("error"):
        return str(summary["error"])[:600]
    return _tail(t.message)


def _tail(text: str, lines: int = 4) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-600:]


# Jobs


@dataclass(frozen=True)
class JobState:
    """A batch/v1 Job reduced to what the phase needs."""

    complete: bool
    failed: bool
    succeeded: int
    total: int
    reason: str = ""
    message: str = ""


def job_state(job: Mapping[str, Any]) -> JobState:
    """Complete/Failed from the Job's conditions (`SuccessCriteriaMet`/`FailureTarget` count too:
    the Job controller has decided, it is only waiting for pods to stop)."""
    status = job.get("status") or {}
    conds = {c.get("type"): c for c in status.get("conditions") or [] if c.get("status") == "True"}
    fail = conds.get("Failed") or conds.get("FailureTarget")
    total = int((job.get("spec") or {}).get("completions") or 1)
    return JobState(
        complete=bool(conds.get("Complete") or conds.get("SuccessCriteriaMet")) and not fail,
        failed=bool(fail),
        succeeded=int(status.get("succeeded") or 0),
        total=total,
        reason=(fail or {}).get("reason", ""),
        message=(fail or {}).get("message", ""),
    )


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> str | None:
    """The scheduler's message when a pod cannot be placed (missing claim, no node in the pool, too big)."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if (cond.get("type"), cond.get("status"), cond.get("reason")) == (
                "PodScheduled",
                "False",
                "Unschedulable",
            ):
                return str(cond.get("message") or "no node fits")
    return None


def _pod_results(pods: Sequence[Mapping[str, Any]], container: str) -> list[Terminated]:
    return [t for t in (terminated(p, container) for p in pods) if t is not None]


def failure(
    stage: str,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    container: str,
    program: str = "packer",
) -> tuple[str, str]:
    """(reason, message) for a failed stage, preferring what the failing pod said over the Job's summary."""
    state = job_state(job)
    job_name = (job.get("metadata") or {}).get("name", stage)
    namespace = (job.get("metadata") or {}).get("namespace", "default")
    results = [t for t in _pod_results(pods, container) if t.exit_code != 0]
    config = [t for t in results if t.exit_code == EXIT_CONFIG]
    if config:
        t = config[0]
        detail = _detail(t) or "no message"
        return (
            "InvalidConfiguration",
            f"the {program} rejected the configuration in the {stage} stage: {detail}. "
            "Fix the spec, then delete and re-create the resource.",
        )
    logs = f"kubectl logs -n {namespace} job/{job_name}"
    if results:
        t = results[-1]
        where = f" on index {t.index}" if t.index is not None else ""
        detail = _detail(t) or t.reason or "no message"
        return (
            f"{stage.capitalize()}Failed",
            f"{stage} failed with exit code {t.exit_code}{where}: {detail}. Details: {logs}",
        )
    why = ": ".join(x for x in (state.reason, state.message) if x) or "the Job failed"
    return f"{stage.capitalize()}Failed", f"{stage} Job {job_name} failed ({why}). Details: {logs}"


# PackJob


def pack_stats(
    previous: Mapping[str, Any] | None, summaries: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict:
    """Merge stage summaries into `status.stats`; values already recorded survive pods being cleaned up."""
    stats: dict[str, Any] = dict(previous or {})
    convert = _by_index(summaries.get("convert", ()))
    if convert:
        stats["samplesIn"] = sum(int(s.get("samples", 0)) for s in convert)
        stats["samplesRejected"] = sum(int(s.get("rejected", 0)) for s in convert)
        stats["tokens"] = sum(int(s.get("tokens", 0)) for s in convert)
    plan = list(summaries.get("plan", ()))
    if plan:
        p = plan[-1]
        for key, src in (
            ("samplesIn", "samples"),
            ("samplesPacked", "packed"),
            ("samplesRejected", "rejected"),
            ("tokens", "tokens"),
            ("sequences", "sequences"),
            ("shards", "shards"),
            ("fillRatio", "fillRatio"),
            ("paddingSaved", "paddingSaved"),
        ):
            if p.get(src) is not None:
                stats[key] = p[src]
    return stats


def _by_index(summaries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One summary per index (a retried index may have reported twice)."""
    seen: dict[Any, Mapping[str, Any]] = {}
    for s in summaries:
        seen[s.get("index", len(seen))] = s
    return list(seen.values())


def manifest_digest(summaries: Sequence[Mapping[str, Any]]) -> str | None:
    for s in summaries:
        if s.get("manifest") and s.get("manifestSha256"):
            return f"sha256:{s['manifestSha256']}"
    return None


@dataclass
class PackDecision:
    """The PackJob's new status and the stage Job to create next (None: nothing to create)."""

    status: dict[str, Any]
    create: PackStage | None = None
    stage_durations: dict[str, float] = field(default_factory=dict)


def pack_status(
    name: str,
    generation: int | None,
    spec: PackJobSpec,
    jobs: Mapping[str, Mapping[str, Any] | None],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    previous: Mapping[str, Any] | None,
    now: str,
) -> PackDecision:
    """Walk the stages in order: the first missing Job is the one to create; a failed Job ends the pack."""
    prev = dict(previous or {})
    if prev.get("phase") in TERMINAL:
        return PackDecision(status=prev)
    summaries = {
        stage: [
            t.summary for t in _pod_results(pods.get(stage, ()), "packer") if t.exit_code == 0 and t.summary
        ]
        for stage in PACK_STAGES
    }
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "startTime": prev.get("startTime") or now,
        "outputPath": pack_output_dir(name, spec),
        "stats": pack_stats(prev.get("stats"), summaries),
    }
    digest = manifest_digest(summaries["materialize"]) or prev.get("manifestDigest")
    if digest:
        status["manifestDigest"] = digest
    conditions = prev.get("conditions") or []
    create: PackStage | None = None
    phase, reason, message = "Succeeded", "PackReady", f"pack written to {status['outputPath']}"
    for stage in PACK_STAGES:
        job = jobs.get(stage)
        if job is None:
            create = stage
            total = spec.workers.count if stage != "plan" else 1
            phase, reason = STAGE_PHASE[stage], STAGE_PHASE[stage]
            status["stage"] = f"{stage} 0/{total}"
            message = f"created Job {pack_job_name(name, stage)}"
            break
        state = job_state(job)
        if state.failed:
            phase = "Failed"
            reason, message = failure(stage, job, pods.get(stage, ()), "packer")
            status["stage"] = f"{stage} failed"
            break
        if not state.complete:
            phase, reason = STAGE_PHASE[stage], STAGE_PHASE[stage]
            status["stage"] = f"{stage} {state.succeeded}/{state.total}"
            message = f"Job {pack_job_name(name, stage)}: {state.succeeded}/{state.total} done"
            stuck = unschedulable(pods.get(stage, ()))
            if stuck:
                reason = "Unschedulable"
                message = (
                    f"pods of Job {pack_job_name(name, stage)} cannot be scheduled: {stuck}. Check that claim "
                    f"{spec.output.claim_name} exists and that workers.nodeSelector/tolerations/resources fit "
                    "the CPU pool"
                )
            break
    else:
        status["stage"] = "done"
    status["phase"] = phase
    if phase in TERMINAL:
        status["completionTime"] = prev.get("completionTime") or now
    status["conditions"] = _outcome_conditions(
        conditions, phase, reason, message, now, generation, ready=phase == "Succeeded"
    )
    return PackDecision(status=status, create=create, stage_durations=stage_durations(jobs))


def stage_durations(jobs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, float]:
    """Seconds each finished stage Job ran (startTime → completionTime), for the stage-duration metric."""
    from datetime import datetime

    out: dict[str, float] = {}
    for stage, job in jobs.items():
        st = (job or {}).get("status") or {}
        if st.get("startTime") and st.get("completionTime"):
            start = datetime.fromisoformat(str(st["startTime"]).replace("Z", "+00:00"))
            end = datetime.fromisoformat(str(st["completionTime"]).replace("Z", "+00:00"))
            out[stage] = max((end - start).total_seconds(), 0.0)
    return out


# SFTJob


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
            "PackJobNotFound",
            f"waiting for PackJob {ref} to exist in this namespace (create it, or fix data.packJobRef)",
        )
    status = packjob.get("status") or {}
    phase = status.get("phase") or "Pending"
    if phase == "Succeeded":
        return DataReadiness(
            True, "PackJobSucceeded", f"PackJob {ref} succeeded: {status.get('outputPath', '')}"
        )
    if phase == "Failed":
        failed = get_condition(status.get("conditions"), "Failed") or {}
        return DataReadiness(
            False,
            "PackJobFailed",
            f"PackJob {ref} failed ({failed.get('reason', 'unknown')}: {failed.get('message', '')}); "
            "fix it and re-create it under the same name, and this SFTJob continues",
        )
    stage = status.get("stage")
    return DataReadiness(
        False, "PackJobNotReady", f"waiting for PackJob {ref}: {phase}" + (f" ({stage})" if stage else "")
    )


def waiting_status(
    generation: int | None, readiness: DataReadiness, previous: Mapping[str, Any] | None, now: str
) -> dict[str, Any]:
    """Phase WaitingForData, with a DataReady condition saying on what."""
    prev = dict(previous or {})
    conds = set_condition(
        prev.get("conditions") or [], "DataReady", False, readiness.reason, readiness.message, now, generation
    )
    conds = _outcome_conditions(
        conds, "WaitingForData", readiness.reason, readiness.message, now, generation, ready=False
    )
    return {"phase": "WaitingForData", "observedGeneration": generation, "conditions": conds}


def _true(conditions: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in conditions or () if c.get("status") == "True"}


def child_phase(kind: str, child: Mapping[str, Any]) -> tuple[str, str, str]:
    """(phase, reason, message) of a PyTorchJob or TrainJob from its conditions."""
    status = child.get("status") or {}
    conds = _true(status.get("conditions"))
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
                c.get("reason") or f"{kind}{phase}",
                c.get("message") or f"{kind} {name} {phase.lower()}",
            )
    if "Running" in conds or "Restarting" in conds:
        c = conds.get("Running") or conds["Restarting"]
        return "Running", c.get("reason") or f"{kind}Running", c.get("message") or f"{kind} {name} is running"
    active = sum(int(j.get("active") or 0) for j in status.get("jobsStatus") or [])
    if active:
        return "Running", f"{kind}Running", f"{kind} {name} has {active} active jobs"
    return "Pending", f"{kind}Created", f"{kind} {name} created; waiting for its pods to start"


def train_progress(summary: Mapping[str, Any] | None, now: str) -> dict[str, Any] | None:
    """The trainer's JSON summary (a termination message) reduced to `status.progress`."""
    if not summary:
        return None
    keys = {
        "step": "step",
        "steps": "step",
        "maxSteps": "maxSteps",
        "max_steps": "maxSteps",
        "loss": "loss",
        "final_loss": "loss",
        "tokensPerSecond": "tokensPerSecond",
        "tokens_per_second": "tokensPerSecond",
        "evalLoss": "evalLoss",
        "eval_loss": "evalLoss",
    }
    out = {dst: summary[src] for src, dst in keys.items() if summary.get(src) is not None}
    if not out:
        return None
    out["updatedAt"] = now
    return out


# The rank-0 gauges the trainer serves on its metrics port (packtrain.trainer.metrics).
PROGRESS_GAUGES = {
    "packtrain_train_step": "step",
    "packtrain_train_loss": "loss",
    "packtrain_train_tokens_per_second": "tokensPerSecond",
    "packtrain_train_eval_loss": "evalLoss",
}


def progress_from_metrics(text: str, max_steps: int | None, now: str) -> dict[str, Any] | None:
    """`status.progress` from the trainer's /metrics text (rank 0), None before the first step."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = PROGRESS_GAUGES.get(sample.name)
                if key is not None and sample.labels.get("rank", "0") == "0":
                    out[key] = int(sample.value) if key == "step" else float(sample.value)
    except (ValueError, OverflowError):  # not Prometheus text (the endpoint is the CR author's image)
        return None
    if "step" not in out:
        return None
    if max_steps is not None:
        out["maxSteps"] = max_steps
    out["updatedAt"] = now
    return out


def master_pod(pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The running rank-0 pod of a training job: PyTorchJob's master, or index 0 of a TrainJob's node job."""
    for pod in pods:
        status = pod.get("status") or {}
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        rank0 = labels.get("training.kubeflow.org/replica-type") in ("master", "Master") or (
            labels.get(COMPLETION_INDEX, annotations.get(COMPLETION_INDEX)) == "0"
            and labels.get("jobset.sigs.k8s.io/job-index", "0") == "0"
        )
        if rank0 and status.get("phase") == "Running" and status.get("podIP"):
            return pod
    return None


def sft_status(
    generation: int | None,
    kind: str,
    child: Mapping[str, Any],
    data_path: str,
    previous: Mapping[str, Any] | None,
    now: str,
    progress: Mapping[str, Any] | None = None,
    pods: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Mirror the child training job's state into the SFTJob's phase, conditions and replica statuses."""
    prev = dict(previous or {})
    phase, reason, message = child_phase(kind, child)
    stuck = unschedulable(pods) if phase in ("Pending", "Running") else None
    if stuck:
        reason = "Unschedulable"
        message = (
            f"training pods cannot be scheduled: {stuck}. Check spec.resources (GPUs, cpu, memory, "
            "nodeSelector, tolerations) against the GPU pool, and that the claims exist"
        )
    meta = child.get("metadata") or {}
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": generation,
        "startTime": prev.get("startTime") or now,
        "dataPath": data_path,
        "trainingJob": {
            "apiVersion": child.get("apiVersion", ""),
            "kind": kind,
            "name": meta.get("name", ""),
        },
    }
    child_status = child.get("status") or {}
    replicas = child_status.get("replicaStatuses")
    if replicas is None and child_status.get("jobsStatus"):
        replicas = {
            j.get("name", f"job{i}"): {k: v for k, v in j.items() if k != "name"}
            for i, j in enumerate(child_status["jobsStatus"])
        }
    if replicas:
        status["replicaStatuses"] = replicas
    if phase in TERMINAL:
        status["completionTime"] = prev.get("completionTime") or child_status.get("completionTime") or now
    if phase == "Failed":
        message = f"{message}. Details: kubectl describe {kind.lower()} {meta.get('name', '')}"
    conds = set_condition(
        prev.get("conditions") or [],
        "DataReady",
        True,
        "DataAvailable",
        f"training on {data_path}",
        now,
        generation,
    )
    status["conditions"] = _outcome_conditions(
        conds, phase, reason, message, now, generation, ready=phase == "Succeeded"
    )
    if progress:
        status["progress"] = dict(progress)
    elif prev.get("progress"):
        status["progress"] = prev["progress"]
    return status


# Reasons that deserve a Warning event although the phase is not Failed.
WARNING_REASONS = frozenset({"PackJobFailed", "PackJobNotFound"})


def transition_event(
    previous_phase: str | None, previous_reason: str | None, status: Mapping[str, Any]
) -> tuple[str, str, str] | None:
    """(type, reason, message) of the Event to post when the phase or its reason changed, else None."""
    phase = status.get("phase")
    ready = get_condition(status.get("conditions"), "Ready") or {}
    reason = str(ready.get("reason") or phase)
    if not phase or (phase == previous_phase and reason == previous_reason):
        return None
    kind = "Warning" if phase == "Failed" or reason in WARNING_REASONS else "Normal"
    return kind, reason, str(ready.get("message") or phase)
