"""Bounded waits: how long a job may stay blocked, and since when it has been.

Pure functions of RFC 3339 timestamps, so the status mapping stays testable without a clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from packtrain.core.contract import TRAIN_DATA_WAIT
from packtrain.operator.reasons import ConditionReason as R


@dataclass(frozen=True)
class Deadlines:
    """How long a job may stay blocked before it turns Failed or Degraded (seconds; the chart's `deadlines`).

    dataWait: an SFTJob whose PackJob is missing or failed turns Failed.
    unschedulable: pods the scheduler cannot place turn the job Degraded (an autoscaler may still help).
    stall: a PackJob stage without progress (no index finished) turns the PackJob Degraded.
    training_stall: a Running SFTJob whose training step has not advanced turns Degraded.
    training_stall_fail: ...and Failed, its training job deleted so its GPUs go back (None: never).
    """

    data_wait: float = 24 * 3600
    unschedulable: float = 3600
    stall: float = 6 * 3600
    training_stall: float = 30 * 60
    training_stall_fail: float | None = 6 * 3600

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Deadlines:
        keys = {
            "dataWaitSeconds": "data_wait",
            "unschedulableSeconds": "unschedulable",
            "stallSeconds": "stall",
            "trainingStallSeconds": "training_stall",
            "trainingStallFailSeconds": "training_stall_fail",
        }
        unknown = set(raw) - set(keys)
        if unknown:
            raise ValueError(f"unknown deadline(s) {sorted(unknown)}; expected {sorted(keys)}")
        # 0 (or null) never fails a stalled training: it stays Degraded. 0, because Helm drops a null value.
        never = {"trainingStallFailSeconds"}
        values = {keys[k]: None if k in never and not v else float(v) for k, v in raw.items()}
        if any(v is not None and v <= 0 for v in values.values()):
            raise ValueError(f"deadlines must be positive seconds, got {dict(raw)}")
        out = cls(**cast(dict[str, Any], values))  # None only for the optional training_stall_fail
        if out.training_stall_fail is not None and out.training_stall_fail <= out.training_stall:
            raise ValueError(
                "trainingStallFailSeconds must be longer than trainingStallSeconds (or 0: never fail), "
                f"got {out.training_stall_fail:g} <= {out.training_stall:g}"
            )
        return out


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
        return {"reason": str(reason), "since": str(prev["since"])}
    return {"reason": str(reason), "since": now}


# Training stalls: the trainer's step, scraped while an SFTJob runs (`progress`), against a clock kept in
# status.


def last_advance(previous: Mapping[str, Any] | None, step: int, now: str) -> str:
    """`status.progress.lastAdvanceTime`: when the step last changed, kept across scrapes and restarts.

    Any change counts, not only an increase: a trainer restarted from its checkpoint moves too.
    """
    prev = previous or {}
    if prev.get("step") == step and prev.get("lastAdvanceTime"):
        return str(prev["lastAdvanceTime"])
    return now


def scrape_error(previous: Mapping[str, Any] | None, message: str, now: str) -> dict[str, str]:
    """`status.scrapeError`: why no live progress could be read, since the first failure in a row."""
    return {"message": message, "since": str((previous or {}).get("since") or now)}


@dataclass(frozen=True)
class Stall:
    """What a Running SFTJob's conditions say once its training-stall deadline passed.

    reason: `TrainingStalled` (a recent reading saw the step stand still) or `NoLiveProgress` (none could).
    fail: the fail deadline passed too: the SFTJob turns Failed and its training job is deleted.
    """

    reason: str
    message: str
    fail: bool = False


def training_stall(
    status: Mapping[str, Any],
    running_since: str | None,
    now: str,
    deadlines: Deadlines,
    *,
    recent: float,
    namespace: str,
    selector: str,
    pod: str | None,
    child: str,
) -> Stall | None:
    """The stall of a Running SFTJob from its status alone (restart-safe: every time it reads is in there).

    The clock runs from the later of the step's last advance and the job turning Running (a resumed
    job starts afresh), and stops at the last reading (`progress.updatedAt`): a stall is only what
    readings saw, never time nobody observed. A reading older than `recent` seconds (the scrape
    interval twice, plus slack) was not taken by a live scrape loop: after an operator outage, or while
    the metrics cannot be read, it says so (`NoLiveProgress`) and fails nothing, since the operator
    cannot tell a hang from a trainer it has not looked at. A step at `maxSteps` is not a stall: the
    final checkpoint or evaluation keeps it still.
    `selector`: the training pods' label selector; `pod`: rank 0's pod; `child`: e.g. `PyTorchJob demo`.
    """
    progress = status.get("progress") or {}
    step = progress.get("step")
    max_steps = progress.get("maxSteps")
    if step is not None and max_steps is not None and step >= max_steps:
        return None
    advanced = progress.get("lastAdvanceTime") if step is not None else None
    since = _later(advanced, running_since)
    if since is None or seconds_between(since, now) <= deadlines.training_stall:
        return None
    read_at = progress.get("updatedAt")
    still_for = seconds_between(since, str(read_at)) if read_at else 0.0
    seen_still = still_for > deadlines.training_stall
    live = read_at is not None and seconds_between(str(read_at), now) <= recent
    error = status.get("scrapeError") or {}
    logs = f"kubectl logs -n {namespace} {pod}" if pod else f"kubectl logs -n {namespace} -l {selector}"
    limit = duration(deadlines.training_stall)
    if not live or (error and not seen_still):
        return _no_live_progress(step, since, read_at, error, recent, limit, logs)
    if not seen_still:  # the readings so far are within the deadline; the next one decides
        return None
    said = (
        f"training step {step} has not advanced since {since}"
        if step is not None
        else (f"no training step since the job started running at {since}")
    )
    message = (
        f"{said}, longer than the {limit} training-stall deadline (last read {read_at}). Look at rank "
        f"0's log ({logs}) and every rank's (kubectl logs -n {namespace} -l {selector} --prefix) for a "
        f"hung collective or a dead rank, and at {TRAIN_DATA_WAIT} (time the last steps waited for data) "
        "for a stuck data loader"
    )
    fail_after = deadlines.training_stall_fail
    if fail_after is not None and still_for > fail_after:
        return Stall(
            R.TRAINING_STALLED,
            f"{message}. Failed after {duration(fail_after)} without a step: {child} was deleted so its GPUs "
            "go back; fix the cause, then delete and re-create the SFTJob",
            fail=True,
        )
    return Stall(R.TRAINING_STALLED, message)


def _no_live_progress(
    step: Any, since: str, read_at: Any, error: Mapping[str, Any], recent: float, limit: str, logs: str
) -> Stall:
    """No recent reading (or only failed ones): say so, and fail nothing."""
    last = (
        f"the last reading ({read_at}) was step {step}, unchanged since {since}"
        if step is not None
        else (f"no step was read since it started running at {since}")
    )
    why = (
        f"{error.get('message')} (since {error.get('since')})"
        if error
        else (
            f"no reading in the last {duration(recent)} (the operator reads again within that time "
            "after a restart)"
        )
    )
    return Stall(
        R.NO_LIVE_PROGRESS,
        f"no live progress: {why}; {last}, so whether training moves within the {limit} training-stall "
        f"deadline is unknown. Check that the operator can reach the trainer's metrics port (a "
        f"NetworkPolicy), then the trainer's log ({logs})",
    )


def _later(a: str | None, b: str | None) -> str | None:
    if a is None or b is None:
        return a or b
    return a if seconds_between(b, a) > 0 else b


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g}h"
    if seconds >= 60:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"
