"""Live training progress: rank 0's trainer `/metrics`, scraped into `status.progress` while a run is Running.

Kept apart from the reconcilers: scraping is best-effort and periodic (one loop for every running
SFTJob, not a per-object kopf timer, which would put a finalizer on each), while reconciling is
event-driven. The metric names are the trainer's own (`packer.contract`); the scrape itself is
bounded in size and time (`scrape`). Each scrape also keeps the training-stall clock in the status
(`progress.lastAdvanceTime`, and `scrapeError` while nothing can be read), which the reconcilers
hold against the deadline (`deadlines.training_stall`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from packtrain.core.contract import TRAIN_EVAL_LOSS, TRAIN_LOSS, TRAIN_STEP, TRAIN_TOKENS_PER_SECOND
from packtrain.operator import deadlines, scrape
from packtrain.operator.api import GROUP, VERSION, SFTJobSpec
from packtrain.operator.names import COMPLETION_INDEX, JOBSET_INDEX_LABEL, REPLICA_TYPE_LABEL, SFTJOB_LABEL

log = logging.getLogger("packtrain.operator")

INTERVAL = float(os.environ.get("PACKTRAIN_PROGRESS_INTERVAL", "30"))
# A reading older than this was not taken by a live scrape loop (two rounds missed, plus a slow round's
# time): the training-stall deadline then says it cannot see progress rather than calling a stall.
RECENT = 2 * INTERVAL + 30

# The rank-0 gauges the trainer serves on its metrics port -> `status.progress` keys.
PROGRESS_GAUGES = {
    TRAIN_STEP: "step",
    TRAIN_LOSS: "loss",
    TRAIN_TOKENS_PER_SECOND: "tokensPerSecond",
    TRAIN_EVAL_LOSS: "evalLoss",
}


class ProgressKube(Protocol):
    """What a scrape reads and writes (the operator's cached view, or a test's)."""

    def get(
        self, group: str, version: str, plural: str, namespace: str, name: str
    ) -> dict[str, Any] | None: ...

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]: ...

    def merge_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None: ...


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
        rank0 = labels.get(REPLICA_TYPE_LABEL) in ("master", "Master") or (
            labels.get(COMPLETION_INDEX, annotations.get(COMPLETION_INDEX)) == "0"
            and labels.get(JOBSET_INDEX_LABEL, "0") == "0"
        )
        if rank0 and status.get("phase") == "Running" and status.get("podIP"):
            return pod
    return None


@dataclass(frozen=True)
class Target:
    """What one scrape reads: rank 0's /metrics URL (None: no running rank-0 pod), and what it continues."""

    url: str | None
    max_steps: int | None
    status: Mapping[str, Any]


def _metrics_target(kube: ProgressKube, namespace: str, name: str) -> Target | None:
    """The running SFTJob's scrape target, or None when it is not Running (nothing to scrape, nothing
    amiss)."""
    body = kube.get(GROUP, VERSION, "sftjobs", namespace, name)
    status = (body or {}).get("status") or {}
    if body is None or status.get("phase") != "Running":
        return None
    spec = SFTJobSpec.model_validate(body["spec"])
    pod = master_pod(kube.pods(namespace, f"{SFTJOB_LABEL}={name}"))
    url = scrape.metrics_url(pod["status"]["podIP"], spec.metrics_port) if pod is not None else None
    return Target(url, spec.training.fixed_steps(), status)


def reading(target: Target, text: str | None, error: str | None, now: str) -> dict[str, Any] | None:
    """The status patch of one scrape: progress with the time its step last changed, or why there is none.

    A failed scrape is recorded (`scrapeError`, since its first failure in a row) so the training-stall
    deadline says it could not see progress rather than calling a stall; a good one clears it and, step
    or not, records when it read (`progress.updatedAt`). None: nothing to write.
    """
    prev = target.status
    if error is not None:
        failed = deadlines.scrape_error(prev.get("scrapeError"), error, now)
        return None if failed == prev.get("scrapeError") else {"scrapeError": failed}
    patch: dict[str, Any] = {"scrapeError": None} if prev.get("scrapeError") else {}
    progress = progress_from_metrics(text or "", target.max_steps, now)
    if progress is not None:
        progress["lastAdvanceTime"] = deadlines.last_advance(prev.get("progress"), progress["step"], now)
        patch["progress"] = progress
    elif _is_metrics(
        text or ""
    ):  # read, but no step yet: its time still counts (a hang before the first step)
        patch["progress"] = {"updatedAt": now}
    return patch or None


def _is_metrics(text: str) -> bool:
    """Prometheus text, step or not (anything else shows nothing, so it is no reading)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        for _ in text_string_to_metric_families(text):
            pass
    except (ValueError, OverflowError):
        return False
    return True


async def update_progress(
    kube: ProgressKube, client: aiohttp.ClientSession, namespace: str, name: str, now: Callable[[], str]
) -> dict[str, Any] | None:
    """Scrape the master pod's trainer metrics into `status.progress` (or `status.scrapeError`).

    Returns the progress read, None when there is none. The API calls and the parsing run in
    threads, off the event loop kopf's handlers share.
    """
    loop = asyncio.get_running_loop()
    target = await loop.run_in_executor(None, _metrics_target, kube, namespace, name)
    if target is None:
        return None
    text: str | None = None
    error: str | None = "no running rank-0 pod to scrape"
    if target.url is not None:
        try:
            text, error = await scrape.fetch(client, target.url), None
        except scrape.ScrapeError as exc:
            error = f"metrics endpoint {target.url} could not be read: {exc}"
    if error is not None:
        log.info("SFTJob %s/%s: no progress: %s", namespace, name, error)
    patch = await loop.run_in_executor(None, reading, target, text, error, now())
    if patch is not None:
        await loop.run_in_executor(None, kube.merge_status, "sftjobs", namespace, name, patch)
    read = (patch or {}).get("progress") or {}
    return read if "step" in read else None


async def progress_round(
    kube: ProgressKube,
    client: aiohttp.ClientSession,
    jobs: list[tuple[str, str]],
    limit: asyncio.Semaphore,
    now: Callable[[], str],
) -> list[dict[str, Any] | None]:
    """Scrape every running SFTJob at once, at most `limit` at a time; one failure stops no other."""

    async def one(namespace: str, name: str) -> dict[str, Any] | None:
        async with limit:
            try:
                return await update_progress(kube, client, namespace, name, now)
            except Exception:  # progress is best-effort; never stop the loop
                log.exception("SFTJob %s/%s: progress scrape failed", namespace, name)
                return None

    return await asyncio.gather(*(one(namespace, name) for namespace, name in jobs))


async def progress_loop(
    kube: Callable[[], ProgressKube], running: Callable[[], list[tuple[str, str]]], now: Callable[[], str]
) -> None:
    """Every `INTERVAL` seconds, one round over the SFTJobs `running()` names."""
    limit = asyncio.Semaphore(scrape.CONCURRENCY)
    async with scrape.session() as client:
        while True:
            await asyncio.sleep(INTERVAL)
            jobs = running()
            if jobs:
                await progress_round(kube(), client, jobs, limit, now)
