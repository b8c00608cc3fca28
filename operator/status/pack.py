"""A PackJob's status from its stage Jobs and their pods, and which stage Job to create next."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packtrain.core.contract import PACK_STAGES, PackStage
from packtrain.operator.api import PackJobSpec
from packtrain.operator.builders import pack_job_name, pack_output_dir
from packtrain.operator.deadlines import Deadlines, blocked_since, seconds_between
from packtrain.operator.deadlines import duration as _duration
from packtrain.operator.names import PACK_CONTAINER, PACKJOB_LABEL
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.status.conditions import RUNNING_PHASES, TERMINAL, Outcome, lifecycle_conditions
from packtrain.operator.status.jobs import JobState, failure, job_state, stage_durations
from packtrain.operator.status.pods import pod_results, unschedulable, unschedulable_too_long

STAGE_PHASE: dict[str, str] = {"convert": "Converting", "plan": "Planning", "materialize": "Materializing"}

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


# Stats


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


def _stage_summaries(
    pods: Mapping[PackStage, Sequence[Mapping[str, Any]]],
) -> dict[str, list[dict[str, Any]]]:
    """Counts come from the stages that finished, and from a plan or materialize that refused the pack
    (NoSamples, TooManyRejected: materialize's final counts under `pack`)."""
    return {
        stage: [
            t.summary
            for t in pod_results(pods.get(stage, ()), PACK_CONTAINER)
            if t.summary and ("error" not in t.summary or "samples" in t.summary or "pack" in t.summary)
        ]
        for stage in PACK_STAGES
    }


# Progress


def _stage_units(spec: PackJobSpec, stage: str) -> int:
    return 1 if stage == "plan" else spec.workers.count


def percent_done(spec: PackJobSpec, done_units: int) -> int:
    """Share of all stage indexes finished (convert and materialize count one per worker, plan one)."""
    total = sum(_stage_units(spec, stage) for stage in PACK_STAGES)
    return int(100 * done_units / total)


@dataclass
class _Walk:
    """Where the walk through the stages stopped, and what it found there."""

    phase: str
    reason: str
    message: str
    stage: str = "done"  # status.stage: `<stage> <done>/<total>`, `<stage> failed`, or done
    create: PackStage | None = None
    suspended: tuple[str, str] | None = None
    stuck: str | None = None  # why the stage's pods cannot be scheduled
    done_units: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)


def _walk_stages(
    name: str,
    spec: PackJobSpec,
    jobs: Mapping[PackStage, Mapping[str, Any] | None],
    pods: Mapping[PackStage, Sequence[Mapping[str, Any]]],
    done_before: Mapping[str, float],
) -> _Walk:
    """The first stage not done decides: missing (create it), failed (the pack fails), or running."""
    durations = stage_durations(jobs)
    walk = _Walk(
        "Succeeded",
        R.PACK_READY,
        f"pack written to {pack_output_dir(name, spec)}",
        stage_seconds=dict(done_before),
    )
    for stage in PACK_STAGES:
        job = jobs.get(stage)
        if stage in done_before:
            walk.done_units += _stage_units(spec, stage)
            continue
        if job is None:
            walk.phase = walk.reason = STAGE_PHASE[stage]
            walk.stage, walk.create = f"{stage} 0/{_stage_units(spec, stage)}", stage
            walk.message = f"created Job {pack_job_name(name, stage)}"
            return walk
        state = job_state(job)
        if state.failed:
            walk.reason, walk.message = failure(stage, job, pods.get(stage, ()), PACK_CONTAINER)
            walk.phase, walk.stage = "Failed", f"{stage} failed"
            return walk
        if not state.complete:
            _running_stage(walk, name, spec, stage, state, pods.get(stage, ()))
            return walk
        walk.done_units += _stage_units(spec, stage)
        walk.stage_seconds[stage] = durations.get(stage, 0.0)
    return walk


def _running_stage(
    walk: _Walk,
    name: str,
    spec: PackJobSpec,
    stage: PackStage,
    state: JobState,
    pods: Sequence[Mapping[str, Any]],
) -> None:
    """A stage under way: its count, or why it does not move (queued, unschedulable)."""
    job = pack_job_name(name, stage)
    walk.phase = walk.reason = STAGE_PHASE[stage]
    walk.done_units += min(state.succeeded, state.total)
    walk.stage = f"{stage} {state.succeeded}/{state.total}"
    walk.message = f"Job {job}: {state.succeeded}/{state.total} done"
    if state.suspended:
        queue = spec.queue_name or "none"
        walk.suspended = (R.QUEUED, f"Job {job} is suspended until its queue ({queue}) admits it")
        walk.reason, walk.message = walk.suspended
    if stuck := unschedulable(pods):
        walk.reason = R.UNSCHEDULABLE
        walk.message = walk.stuck = (
            f"pods of Job {job} cannot be scheduled: {stuck}. Check that claim "
            f"{spec.output.claim_name} exists and that workers.nodeSelector/tolerations/resources fit "
            "the CPU pool"
        )


# Deadlines


def _degraded(
    name: str, status: Mapping[str, Any], walk: _Walk, now: str, deadlines: Deadlines
) -> tuple[str, str] | None:
    """A passed deadline: pods unschedulable too long, or a running stage without progress too long."""
    if walk.stuck is not None:
        return unschedulable_too_long(status["blocked"], walk.stuck, now, deadlines)
    if walk.phase in RUNNING_PHASES and walk.suspended is None and walk.create is None:
        idle = seconds_between(status["lastProgressTime"], now)
        if idle > deadlines.stall:
            return (
                R.STAGE_STALLED,
                f"no progress in {status.get('stage')} for longer than the "
                f"{_duration(deadlines.stall)} deadline: look at the pods' logs "
                f"(kubectl logs -l {PACKJOB_LABEL}={name})",
            )
    return None


# The PackJob


@dataclass
class PackDecision:
    """The PackJob's new status, the stage Job to create next (None: nothing to create), and the stages
    that finished in this status (their durations, observed once: when this status is written)."""

    status: dict[str, Any]
    create: PackStage | None = None
    finished: dict[str, float] = field(default_factory=dict)


def _base_status(
    name: str,
    generation: int | None,
    spec: PackJobSpec,
    pods: Mapping[PackStage, Sequence[Mapping[str, Any]]],
    prev: Mapping[str, Any],
    now: str,
) -> dict[str, Any]:
    """What does not depend on the stages' progress: where the pack goes, and its counts so far."""
    summaries = _stage_summaries(pods)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "startTime": prev.get("startTime") or now,
        "outputPath": pack_output_dir(name, spec),
        "claimName": spec.output.claim_name,
        "subPath": (spec.output.sub_path or name).strip("/"),
        "stats": pack_stats(prev.get("stats"), summaries),
    }
    if digest := manifest_digest(summaries["materialize"]) or prev.get("manifestDigest"):
        status["manifestDigest"] = digest
    sizes = next((s["model_sizes"] for s in summaries["convert"] if s.get("model_sizes")), None)
    if sizes := sizes or prev.get("modelSizes"):  # kept once the convert pods are cleaned up
        status["modelSizes"] = sizes
    return status


def _progress(
    status: dict[str, Any], walk: _Walk, spec: PackJobSpec, prev: Mapping[str, Any], now: str
) -> None:
    """`stage`, `percentDone`, and `lastProgressTime`: moved when either did (a stalled stage: neither)."""
    status["stage"] = walk.stage
    status["percentDone"] = 100 if walk.phase == "Succeeded" else percent_done(spec, walk.done_units)
    moved = (status.get("stage"), status["percentDone"]) != (prev.get("stage"), prev.get("percentDone"))
    status["lastProgressTime"] = (
        now if moved or not prev.get("lastProgressTime") else prev["lastProgressTime"]
    )
    if walk.stage_seconds:
        status["stageSeconds"] = walk.stage_seconds


def pack_status(
    name: str,
    generation: int | None,
    spec: PackJobSpec,
    jobs: Mapping[PackStage, Mapping[str, Any] | None],
    pods: Mapping[PackStage, Sequence[Mapping[str, Any]]],
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
    status = _base_status(name, generation, spec, pods, prev, now)
    done_before: dict[str, float] = dict(prev.get("stageSeconds") or {})
    walk = _walk_stages(name, spec, jobs, pods, done_before)
    _progress(status, walk, spec, prev, now)
    if walk.stuck is not None:
        status["blocked"] = blocked_since(prev, R.UNSCHEDULABLE, now)
    degraded = _degraded(name, status, walk, now, deadlines)
    status["phase"] = walk.phase
    if walk.phase in TERMINAL:
        status["completionTime"] = prev.get("completionTime") or now
    created = None
    if any(jobs.get(stage) for stage in PACK_STAGES) or done_before or walk.create is not None:
        created = (
            R.STAGE_JOB_CREATED,
            f"stage Jobs {name}-<stage> created in order: {', '.join(PACK_STAGES)}",
        )
    outcome = Outcome(
        walk.phase, walk.reason, walk.message, created=created, suspended=walk.suspended, degraded=degraded
    )
    status["conditions"] = lifecycle_conditions(prev.get("conditions") or [], outcome, now, generation)
    finished = {stage: secs for stage, secs in walk.stage_seconds.items() if stage not in done_before}
    return PackDecision(status=status, create=walk.create, finished=finished)
