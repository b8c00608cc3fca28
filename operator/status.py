"""Pure status mapping: child objects in, phase/conditions/stats out.

The handlers read Jobs, pods and Kubeflow jobs from the API and hand them here
as plain dicts; what a user sees in `kubectl get`/`describe` is decided by these
functions alone, so every transition is unit-tested without a cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packtrain.operator.api import PackJobSpec
from packtrain.operator.builders import PACKJOB_LABEL, pack_job_name, pack_output_dir
from packtrain.operator.commands import EXIT_CONFIG, PACK_STAGES, PackStage
from packtrain.operator.deadlines import (
    NO_LIVE_PROGRESS,
    TRAINING_STALLED,
    Deadlines,
    Stall,
    blocked_since,
    seconds_between,
)
from packtrain.operator.deadlines import duration as _duration
from packtrain.packer.core.contract import TrainSummary, parse_summary

STAGE_PHASE: dict[str, str] = {"convert": "Converting", "plan": "Planning", "materialize": "Materializing"}
TERMINAL = frozenset({"Succeeded", "Failed"})
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_MAX_MESSAGE = 1000
_REASON = re.compile(r"[A-Z][A-Za-z0-9]{0,63}")


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


RUNNING_PHASES = frozenset({"Converting", "Planning", "Materializing", "Running"})


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
    done = o.phase in TERMINAL
    conds = set_condition(previous, "Ready", o.phase == "Succeeded", o.reason, o.message, now, generation)
    created = o.created or ("NotCreated", f"nothing created yet: {o.message}")
    conds = set_condition(conds, "Created", o.created is not None, *created, now, generation)
    stuck = o.reason == "Unschedulable"  # nothing runs while no pod can be placed
    running = o.phase in RUNNING_PHASES and o.suspended is None and not stuck
    why_not = o.suspended[0] if o.suspended and not done else (o.reason if stuck else o.phase)
    conds = set_condition(
        conds,
        "Running",
        running,
        o.reason if running else why_not,
        o.message if running or stuck else "",
        now,
        generation,
    )
    conds = set_condition(
        conds, "Suspended", o.suspended is not None, *(o.suspended or ("NotSuspended", "")), now, generation
    )
    conds = set_condition(
        conds,
        "Succeeded",
        o.phase == "Succeeded",
        o.reason if o.phase == "Succeeded" else ("Failed" if o.phase == "Failed" else "NotFinished"),
        o.message if o.phase == "Succeeded" else "",
        now,
        generation,
    )
    conds = set_condition(
        conds,
        "Failed",
        o.phase == "Failed",
        o.reason if o.phase == "Failed" else "NoFailure",
        o.message if o.phase == "Failed" else "",
        now,
        generation,
    )
    return set_condition(
        conds, "Degraded", o.degraded is not None, *(o.degraded or ("AsExpected", "")), now, generation
    )


def _outcome_conditions(
    previous: Sequence[Mapping[str, Any]],
    phase: str,
    reason: str,
    message: str,
    now: str,
    generation: int | None,
    ready: bool = False,
) -> list[dict[str, Any]]:
    """The conditions of a status with no side facts (a spec refused before anything was created)."""
    return lifecycle_conditions(previous, Outcome(phase, reason, message), now, generation)


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
    suspended: bool = False


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
        suspended=bool((job.get("spec") or {}).get("suspend")),
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
        said = t.summary or {}
        reason = str(said.get("reason") or "")
        if _REASON.fullmatch(
            reason
        ):  # a stage that knows why the pack is useless (NoSamples, TooManyRejected)
            return reason, f"the {stage} stage failed: {_detail(t)}"
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

# Stage summary key (packer.contract, snake_case) -> status.stats key.
_CONVERT_STATS = {"samples": "samplesIn", "rejected": "samplesRejected", "tokens": "tokens"}
_PLAN_STATS = {
    "samples": "samplesIn",
    "packed": "samplesPacked",
    "rejected": "samplesRejected",
    "rejected_by_reason": "rejectedByReason",
    "tokens": "tokens",
    "sequences": "sequences",
    "shards": "shards",
    "fill_ratio": "fillRatio",
    "padding_saved": "paddingSaved",
}


def pack_stats(
    previous: Mapping[str, Any] | None, summaries: Mapping[str, Sequence[Mapping[str, Any]]]
) -> dict:
    """Merge stage summaries into `status.stats`; values already recorded survive pods being cleaned up."""
    stats: dict[str, Any] = dict(previous or {})
    convert = _by_index(summaries.get("convert", ()))
    if convert:
        for src, dst in _CONVERT_STATS.items():
            stats[dst] = sum(int(s.get(src, 0)) for s in convert)
    plan = list(summaries.get("plan", ()))
    if plan:
        p = plan[-1]
        stats.update({dst: p[src] for src, dst in _PLAN_STATS.items() if p.get(src) is not None})
    # The worker that wrote the manifest reports the final counts (`PackCounts`): plan's, less the
    # samples materialize rejected (a video whose frames do not decode), and the sequences written.
    final = [s["pack"] for s in summaries.get("materialize", ()) if isinstance(s.get("pack"), Mapping)]
    if final:
        stats.update(
            {dst: final[-1][src] for src, dst in _PLAN_STATS.items() if final[-1].get(src) is not None}
        )
    return stats


def _by_index(summaries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """One summary per index (a retried index may have reported twice)."""
    seen: dict[Any, Mapping[str, Any]] = {}
    for s in summaries:
        seen[s.get("index", len(seen))] = s
    return list(seen.values())


def manifest_digest(summaries: Sequence[Mapping[str, Any]]) -> str | None:
    for s in summaries:
        if s.get("manifest") and s.get("manifest_sha256"):
            return f"sha256:{s['manifest_sha256']}"
    return None


@dataclass
class PackDecision:
    """The PackJob's new status, the stage Job to create next (None: nothing to create), and the stages
    that finished in this status (their durations, observed once: when this status is written)."""

    status: dict[str, Any]
    create: PackStage | None = None
    finished: dict[str, float] = field(default_factory=dict)


def _stage_units(spec: PackJobSpec, stage: str) -> int:
    return 1 if stage == "plan" else spec.workers.count


def percent_done(spec: PackJobSpec, done_units: int) -> int:
    """Share of all stage indexes finished (convert and materialize count one per worker, plan one)."""
    total = sum(_stage_units(spec, stage) for stage in PACK_STAGES)
    return int(100 * done_units / total)


def pack_status(
    name: str,
    generation: int | None,
    spec: PackJobSpec,
    jobs: Mapping[str, Mapping[str, Any] | None],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    previous: Mapping[str, Any] | None,
    now: str,
    deadlines: Deadlines | None = None,
) -> PackDecision:
    """Walk the stages in order: the first missing Job is the one to create; a failed Job ends the pack.

    A stage recorded in `status.stageSeconds` is done even when its Job is gone (deleted by
    `ttlSecondsAfterFinished`), so it is never created again.
    """
    deadlines = deadlines or Deadlines()
    prev = dict(previous or {})
    if prev.get("phase") in TERMINAL:
        return PackDecision(status=prev)
    # Counts come from the stages that finished, and from a plan or materialize that refused the pack
    # (NoSamples, TooManyRejected: materialize's final counts under `pack`).
    summaries = {
        stage: [
            t.summary
            for t in _pod_results(pods.get(stage, ()), "packer")
            if t.summary and ("error" not in t.summary or "samples" in t.summary or "pack" in t.summary)
        ]
        for stage in PACK_STAGES
    }
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "startTime": prev.get("startTime") or now,
        "outputPath": pack_output_dir(name, spec),
        "claimName": spec.output.claim_name,
        "subPath": (spec.output.sub_path or name).strip("/"),
        "stats": pack_stats(prev.get("stats"), summaries),
    }
    digest = manifest_digest(summaries["materialize"]) or prev.get("manifestDigest")
    if digest:
        status["manifestDigest"] = digest
    done_before: dict[str, float] = dict(prev.get("stageSeconds") or {})
    durations = stage_durations(jobs)
    stage_seconds = dict(done_before)
    create: PackStage | None = None
    phase, reason, message = "Succeeded", "PackReady", f"pack written to {status['outputPath']}"
    suspended: tuple[str, str] | None = None
    blocked: str | None = None
    stuck_message = ""
    done_units = 0
    for stage in PACK_STAGES:
        job = jobs.get(stage)
        if stage in done_before:
            done_units += _stage_units(spec, stage)
            continue
        if job is None:
            create = stage
            phase, reason = STAGE_PHASE[stage], STAGE_PHASE[stage]
            status["stage"] = f"{stage} 0/{_stage_units(spec, stage)}"
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
            done_units += min(state.succeeded, state.total)
            status["stage"] = f"{stage} {state.succeeded}/{state.total}"
            message = f"Job {pack_job_name(name, stage)}: {state.succeeded}/{state.total} done"
            if state.suspended:
                queue = spec.queue_name or "none"
                suspended = (
                    "Queued",
                    f"Job {pack_job_name(name, stage)} is suspended until its queue ({queue}) admits it",
                )
                reason, message = suspended
            stuck = unschedulable(pods.get(stage, ()))
            if stuck:
                blocked = reason = "Unschedulable"
                message = stuck_message = (
                    f"pods of Job {pack_job_name(name, stage)} cannot be scheduled: {stuck}. Check that claim "
                    f"{spec.output.claim_name} exists and that workers.nodeSelector/tolerations/resources fit "
                    "the CPU pool"
                )
            break
        done_units += _stage_units(spec, stage)
        stage_seconds[stage] = durations.get(stage, 0.0)
    else:
        status["stage"] = "done"
    status["percentDone"] = 100 if phase == "Succeeded" else percent_done(spec, done_units)
    # Progress: the stage line or the share done moved. A stalled stage is one where neither did.
    moved = (status.get("stage"), status["percentDone"]) != (prev.get("stage"), prev.get("percentDone"))
    status["lastProgressTime"] = (
        now if moved or not prev.get("lastProgressTime") else prev["lastProgressTime"]
    )
    if stage_seconds:
        status["stageSeconds"] = stage_seconds
    degraded = None
    if blocked is not None:
        status["blocked"] = blocked_since(prev, blocked, now)
        waited = seconds_between(status["blocked"]["since"], now)
        if waited > deadlines.unschedulable:
            degraded = (
                "Unschedulable",
                f"pods unschedulable for longer than the "
                f"{_duration(deadlines.unschedulable)} deadline: {stuck_message}",
            )
    elif phase in RUNNING_PHASES and suspended is None and create is None:
        idle = seconds_between(status["lastProgressTime"], now)
        if idle > deadlines.stall:
            degraded = (
                "StageStalled",
                f"no progress in {status.get('stage')} for longer than the "
                f"{_duration(deadlines.stall)} deadline: look at the pods' logs "
                f"(kubectl logs -l {PACKJOB_LABEL}={name})",
            )
    status["phase"] = phase
    if phase in TERMINAL:
        status["completionTime"] = prev.get("completionTime") or now
    created = None
    if any(jobs.get(stage) for stage in PACK_STAGES) or done_before or create is not None:
        created = ("StageJobCreated", f"stage Jobs {name}-<stage> created in order: {', '.join(PACK_STAGES)}")
    outcome = Outcome(phase, reason, message, created=created, suspended=suspended, degraded=degraded)
    status["conditions"] = lifecycle_conditions(prev.get("conditions") or [], outcome, now, generation)
    finished = {stage: secs for stage, secs in stage_seconds.items() if stage not in done_before}
    return PackDecision(status=status, create=create, finished=finished)


def stage_durations(jobs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, float]:
    """Seconds each finished stage Job ran (startTime → completionTime), for the stage-duration metric."""
    out: dict[str, float] = {}
    for stage, job in jobs.items():
        st = (job or {}).get("status") or {}
        if st.get("startTime") and st.get("completionTime"):
            out[stage] = seconds_between(str(st["startTime"]), str(st["completionTime"]))
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
    waiting = f"waiting for PackJob {ref}: {phase}" + (f" ({stage})" if stage else "")
    ready = get_condition(status.get("conditions"), "Ready") or {}
    degraded = get_condition(status.get("conditions"), "Degraded") or {}
    # The PackJob's own blocking reason (unschedulable pods, a queue, a stalled stage), not only its phase.
    blocking = degraded if degraded.get("status") == "True" else ready
    if blocking is degraded or ready.get("reason") in BLOCKING_REASONS:
        return DataReadiness(
            False, "PackJobNotReady", f"{waiting}: {blocking.get('reason')}: {blocking.get('message')}"
        )
    return DataReadiness(False, "PackJobNotReady", waiting)


# Reasons a job cannot move on by itself; their time is bounded by `Deadlines`.
BLOCKING_REASONS = frozenset({"PackJobNotFound", "PackJobFailed", "Unschedulable", "Queued"})


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
    hopeless = readiness.reason in ("PackJobNotFound", "PackJobFailed")
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
    out = {dst: summary[src] for src, dst in _TRAIN_PROGRESS.items() if summary.get(src) is not None}  # type: ignore[literal-required]
    if not out:
        return None
    out["updatedAt"] = now
    return out


def pod_failure(pod: Mapping[str, Any], container: str, now: str) -> dict[str, Any] | None:
    """`status.lastFailure` from a trainer pod whose container exited non-zero (kept before the pod is gone)."""
    term = terminated(pod, container)
    if term is None or term.exit_code == 0:
        return None
    meta = pod.get("metadata") or {}
    return {
        "pod": meta.get("name", ""),
        "exitCode": term.exit_code,
        "reason": term.reason or "Error",
        "message": _detail(term) or term.reason or "no message",
        "time": now,
    }


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
    last_failure = failure_seen or prev.get("lastFailure")
    if last_failure:
        status["lastFailure"] = dict(last_failure)
    suspended = None
    if phase == "Suspended":
        suspended = (reason, message)
        if queued:
            suspended = ("Queued", f"{kind} {meta.get('name', '')} waits for queue {queued} to admit it")
            reason, message = suspended
    degraded = None
    stuck = unschedulable(pods) if phase in ("Pending", "Running") else None
    if stuck:
        reason = "Unschedulable"
        message = (
            f"training pods cannot be scheduled: {stuck}. Check spec.resources (GPUs, cpu, memory, "
            "nodeSelector, tolerations) against the GPU pool, and that the claims exist"
        )
        status["blocked"] = blocked_since(prev, "Unschedulable", now)
        waited = seconds_between(status["blocked"]["since"], now)
        if waited > deadlines.unschedulable:
            degraded = (
                "Unschedulable",
                f"pods unschedulable for longer than the "
                f"{_duration(deadlines.unschedulable)} deadline: {message}",
            )
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
        if last_failure:
            reason = "TrainerFailed"
            message = (
                f"the trainer exited with code {last_failure['exitCode']} in pod {last_failure['pod']}: "
                f"{last_failure['message']} ({kind}: {message})"
            )
        else:
            message = f"{message}. Details: kubectl describe {kind.lower()} {meta.get('name', '')}"
    if stall is not None and degraded is None and phase == "Running":
        if stall.fail:
            phase, reason, message = "Failed", stall.reason, stall.message
            status.update(phase=phase, completionTime=prev.get("completionTime") or now)
        else:
            degraded = (stall.reason, stall.message)
    if data_gone:
        conds = set_condition(
            prev.get("conditions") or [], "DataReady", False, "PackJobDeleted", data_gone, now, generation
        )
    else:
        conds = set_condition(
            prev.get("conditions") or [],
            "DataReady",
            True,
            "DataAvailable",
            f"training on {data_path}",
            now,
            generation,
        )
    created = (f"{kind}Created", f"{kind} {meta.get('name', '')} created")
    outcome = Outcome(phase, reason, message, created=created, suspended=suspended, degraded=degraded)
    status["conditions"] = lifecycle_conditions(conds, outcome, now, generation)
    if progress:
        status["progress"] = dict(progress)
    elif prev.get("progress"):
        status["progress"] = prev["progress"]
    return status


# Reasons that deserve a Warning event although the phase is not Failed.
WARNING_REASONS = frozenset(
    {
        "PackJobFailed",
        "PackJobNotFound",
        "PackJobDeleted",
        "Unschedulable",
        "StageStalled",
        "TrainerFailed",
        TRAINING_STALLED,
        NO_LIVE_PROGRESS,
    }
)


def event_reason(status: Mapping[str, Any] | None) -> str | None:
    """What an Event reports on: a passed deadline (`Degraded:<reason>`) first, else the current (Ready) reason.

    The Degraded prefix keeps a deadline passing apart from the wait it ends (both `Unschedulable`).
    """
    conds = (status or {}).get("conditions")
    degraded = get_condition(conds, "Degraded") or {}
    if degraded.get("status") == "True":
        return f"Degraded:{degraded.get('reason')}"
    data = get_condition(conds, "DataReady") or {}
    if data.get("reason") == "PackJobDeleted":
        return "PackJobDeleted"
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
