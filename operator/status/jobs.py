"""batch/v1 Jobs (the PackJob's stages): their state, why one failed, how long each ran."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from packtrain.core.contract import PackStage
from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator.deadlines import seconds_between
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.status.pods import Terminated, detail, pod_results

# A reason a stage reports itself (NoSamples, TooManyRejected): a condition reason's shape.
_REASON = re.compile(r"[A-Z][A-Za-z0-9]{0,63}")


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


def failure(
    stage: PackStage,
    job: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    container: str,
    program: str = "packer",
) -> tuple[str, str]:
    """(reason, message) for a failed stage, preferring what the failing pod said over the Job's summary."""
    results = [t for t in pod_results(pods, container) if t.exit_code != 0]
    config = [t for t in results if t.exit_code == EXIT_CONFIG]
    if config:
        return _config_failure(stage, config[0], program)
    meta = job.get("metadata") or {}
    job_name = meta.get("name", stage)
    logs = f"kubectl logs -n {meta.get('namespace', 'default')} job/{job_name}"
    if results:
        t = results[-1]
        where = f" on index {t.index}" if t.index is not None else ""
        said = detail(t) or t.reason or "no message"
        return (
            R.stage_failed(stage),
            f"{stage} failed with exit code {t.exit_code}{where}: {said}. Details: {logs}",
        )
    state = job_state(job)
    why = ": ".join(x for x in (state.reason, state.message) if x) or "the Job failed"
    return R.stage_failed(stage), f"{stage} Job {job_name} failed ({why}). Details: {logs}"


def _config_failure(stage: str, t: Terminated, program: str) -> tuple[str, str]:
    """A configuration error (exit 2): the stage's own reason when it gives one, else InvalidConfiguration."""
    reason = str((t.summary or {}).get("reason") or "")
    if _REASON.fullmatch(reason):  # a stage that knows why the pack is useless (NoSamples, TooManyRejected)
        return reason, f"the {stage} stage failed: {detail(t)}"
    return (
        R.INVALID_CONFIGURATION,
        f"the {program} rejected the configuration in the {stage} stage: {detail(t) or 'no message'}. "
        "Fix the spec, then delete and re-create the resource.",
    )


def stage_durations(jobs: Mapping[PackStage, Mapping[str, Any] | None]) -> dict[str, float]:
    """Seconds each finished stage Job ran (startTime → completionTime), for the stage-duration metric."""
    out: dict[str, float] = {}
    for stage, job in jobs.items():
        st = (job or {}).get("status") or {}
        if st.get("startTime") and st.get("completionTime"):
            out[stage] = seconds_between(str(st["startTime"]), str(st["completionTime"]))
    return out
