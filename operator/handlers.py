"""kopf handlers: read the cluster, ask `builders`/`status` what to do, write the result.

Event-driven, without kopf timers or daemons, so kopf puts no finalizer on
PackJobs or SFTJobs: deleting one never waits for the operator, and the garbage
collector removes the children it owns. A parent is reconciled when it is created
or the operator starts (`resume`), and again on every event of a child it owns
(Jobs, pods, PyTorchJobs/TrainJobs; SFTJobs also on their PackJob's events).
Every create is "if absent" under a deterministic name, so a restart mid-run, or
two events racing, never makes a duplicate; every status write is conditional on
the resourceVersion it was computed from, so a stale view never overwrites a newer one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import aiohttp
import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from . import builders, metrics, policy, scrape
from . import status as st
from .api import GROUP, VERSION, PackJobSpec, SFTJobSpec

log = logging.getLogger("packtrain.operator")

PLURALS = {"Job": "jobs", "PyTorchJob": "pytorchjobs", "TrainJob": "trainjobs"}
CHILD_KINDS = {
    "pytorchjob": ("kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"),
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"),
}


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kube:
    """The few API calls the operator makes, returning plain camelCase dicts."""

    def __init__(self, client: kubernetes.client.ApiClient | None = None) -> None:
        self.client = client or kubernetes.client.ApiClient()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.core = kubernetes.client.CoreV1Api(self.client)

    def get(self, group: str, version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(group, version, namespace, plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, group: str, version: str, plural: str, namespace: str) -> list[dict[str, Any]]:
        return self.custom.list_namespaced_custom_object(group, version, namespace, plural).get("items", [])

    def create(self, body: dict[str, Any]) -> bool:
        """Create unless it exists; True when this call created it."""
        group, _, version = body["apiVersion"].rpartition("/")
        namespace = body["metadata"]["namespace"]
        try:
            if body["kind"] == "ConfigMap":
                self.core.create_namespaced_config_map(namespace, body)
            else:
                self.custom.create_namespaced_custom_object(
                    group, version, namespace, PLURALS[body["kind"]], body
                )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def patch(self, group: str, version: str, plural: str, namespace: str, name: str, body: dict) -> None:
        self.custom.patch_namespaced_custom_object(group, version, namespace, plural, name, body)

    def patch_status(
        self, plural: str, namespace: str, name: str, status: dict[str, Any], resource_version: str
    ) -> None:
        """Merge-patch the status, refused (409) if the object changed since `resource_version` was read."""
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, name, body)

    def merge_status(self, plural: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch part of the status unconditionally (fields no reconcile derives, like progress)."""
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, plural, name, {"status": status}
        )

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        return [self.client.sanitize_for_serialization(p) for p in pods]


class ChildRefused(Exception):
    """The API server refused a child for good (a quota or an admission policy, an invalid object)."""


def _create_owned(kube: Kube, owner: Mapping[str, Any], child: dict[str, Any]) -> None:
    kopf.adopt(child, owner=dict(owner))
    try:
        created = kube.create(child)
    except ApiException as exc:
        if exc.status in st.REFUSED_CODES:
            meta = child["metadata"]
            raise ChildRefused(
                st.refusal_message(child["kind"], meta["name"], exc.status, exc.reason, exc.body)
            ) from exc
        raise
    if created:
        log.info("created %s %s/%s", child["kind"], child["metadata"]["namespace"], child["metadata"]["name"])


def _child_refused(kind: str, body: Mapping[str, Any], exc: ChildRefused) -> dict[str, Any]:
    """Status for a child the API server would not create: Failed with its message (and a Warning Event)."""
    return _failed(body, "ChildRefused", f"{exc}. Fix that, then delete and re-create the {kind}.")


def _invalid(kind: str, body: Mapping[str, Any], exc: ValidationError) -> dict[str, Any]:
    """Status for a spec the API server accepted but the models reject (a rule CEL cannot express)."""
    errors = "; ".join(
        f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False)
    )
    message = f"invalid {kind} spec: {errors}. Fix it, then delete and re-create the {kind}."
    return _failed(body, "InvalidSpec", message)


def _refused(kind: str, body: Mapping[str, Any], violations: list[policy.Violation]) -> dict[str, Any]:
    """Status for a spec the cluster policy refuses (created while the admission policy was absent)."""
    return _failed(body, "PolicyViolation", f"{policy.summary(kind, violations)}. Fix it, then delete "
                                            f"and re-create the {kind}.")


def _failed(body: Mapping[str, Any], reason: str, message: str) -> dict[str, Any]:
    """A terminal `Failed` status; `_post_transition` turns it into a Warning Event."""
    prev = body.get("status") or {}
    generation = body["metadata"].get("generation")
    conds = prev.get("conditions") or []
    for ctype, value in (("Ready", False), ("Succeeded", False), ("Failed", True)):
        conds = st.set_condition(conds, ctype, value, reason, message, now(), generation)
    return {
        "phase": "Failed",
        "observedGeneration": generation,
        "conditions": conds,
        "completionTime": prev.get("completionTime") or now(),
    }


def _post_transition(kind: str, body: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    """Event on the custom resource when its phase or reason changed, and the phase gauge."""
    prev = body.get("status") or {}
    prev_reason = (st.get_condition(prev.get("conditions"), "Ready") or {}).get("reason")
    event = st.transition_event(prev.get("phase"), prev_reason, status)
    if event is not None:
        kopf.event(dict(body), type=event[0], reason=event[1], message=event[2])
    meta = body["metadata"]
    metrics.PHASES.record(kind, f"{meta['namespace']}/{meta['name']}", status.get("phase"))


# PackJob


def reconcile_packjob(
    kube: Kube, body: Mapping[str, Any], defaults: builders.OperatorDefaults
) -> dict[str, Any]:
    """Create the next stage's Job if it is missing; return the PackJob's new status."""
    metrics.RECONCILES.labels("PackJob").inc()
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    prev = body.get("status") or {}
    if prev.get("phase") in st.TERMINAL:
        return dict(prev)
    try:
        spec = PackJobSpec.model_validate(body["spec"])
    except ValidationError as exc:
        return _invalid("PackJob", body, exc)
    jobs = {
        stage: kube.get("batch", "v1", "jobs", namespace, builders.pack_job_name(name, stage))
        for stage in st.PACK_STAGES
    }
    pods = {
        stage: kube.pods(namespace, f"{builders.JOB_NAME_LABEL}={builders.pack_job_name(name, stage)}")
        for stage, job in jobs.items()
        if job is not None
    }
    decision = st.pack_status(name, meta.get("generation"), spec, jobs, pods, prev, now())
    if decision.create is not None:
        if violations := policy.check(spec, defaults):
            return _refused("PackJob", body, violations)
        try:
            _create_owned(kube, body, builders.pack_config_map(name, namespace, spec))
            _create_owned(kube, body, builders.pack_job(name, namespace, spec, decision.create, defaults))
        except ChildRefused as exc:
            return _child_refused("PackJob", body, exc)
    prev_phase = prev.get("phase")
    for stage, seconds in decision.stage_durations.items():
        if prev_phase == st.STAGE_PHASE[stage] and decision.status.get("phase") != prev_phase:
            metrics.STAGE_SECONDS.labels(stage).observe(seconds)
    return decision.status


RECONCILERS = {"packjobs": ("PackJob", reconcile_packjob)}


def write_status(memo: kopf.Memo, plural: str, body: Mapping[str, Any]) -> None:
    """Reconcile and store the status, retrying on a conflicting write so a stale view never wins.

    Several events can reconcile one parent at once (its own, its children's); the
    status is computed from what was read and written only if the object is unchanged
    since, otherwise read again and recomputed.
    """
    kind, reconcile = RECONCILERS[plural]
    meta = body["metadata"]
    for _ in range(5):
        try:
            status = reconcile(memo.kube, body, memo.defaults)
        except Exception as exc:
            metrics.ERRORS.labels(kind, type(exc).__name__).inc()
            raise
        if status == (body.get("status") or {}):
            metrics.PHASES.record(kind, f"{meta['namespace']}/{meta['name']}", status.get("phase"))
            return
        try:
            memo.kube.patch_status(plural, meta["namespace"], meta["name"], status, meta["resourceVersion"])
        except ApiException as exc:
            if exc.status != 409:
                raise
            fresh = memo.kube.get(GROUP, VERSION, plural, meta["namespace"], meta["name"])
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return
            body, meta = fresh, fresh["metadata"]
            continue
        _post_transition(kind, body, status)
        if plural == "sftjobs":
            _track_running(memo, body, status)
        return
    raise kopf.TemporaryError(f"{kind} {meta['name']} kept changing while its status was written", delay=5)


def _parent_event(memo: kopf.Memo, plural: str, namespace: str, name: str) -> None:
    parent = memo.kube.get(GROUP, VERSION, plural, namespace, name)
    if parent is not None and not parent["metadata"].get("deletionTimestamp"):
        write_status(memo, plural, parent)


@kopf.on.resume(GROUP, VERSION, "packjobs")
@kopf.on.create(GROUP, VERSION, "packjobs")
def packjob_start(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    write_status(memo, "packjobs", body)


@kopf.on.event("batch", "v1", "jobs", labels={builders.PACKJOB_LABEL: kopf.PRESENT})
def packjob_child_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    """A stage Job changed: move its PackJob on."""
    _parent_event(memo, "packjobs", namespace, labels[builders.PACKJOB_LABEL])


@kopf.on.event("", "v1", "pods", labels={builders.PACKJOB_LABEL: kopf.PRESENT})
def packjob_pod_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    """A stage pod changed (e.g. cannot be scheduled, which its Job does not report): refresh the PackJob."""
    _parent_event(memo, "packjobs", namespace, labels[builders.PACKJOB_LABEL])


@kopf.on.delete(GROUP, VERSION, "packjobs", optional=True)
def packjob_deleted(namespace: str, name: str, **_: Any) -> None:
    metrics.PHASES.forget("PackJob", f"{namespace}/{name}")


# SFTJob


def reconcile_sftjob(
    kube: Kube, body: Mapping[str, Any], defaults: builders.OperatorDefaults
) -> dict[str, Any]:
    """Wait for the data, create the training job once, and mirror its state."""
    metrics.RECONCILES.labels("SFTJob").inc()
    meta = body["metadata"]
    name, namespace, generation = meta["name"], meta["namespace"], meta.get("generation")
    prev = body.get("status") or {}
    if prev.get("phase") in st.TERMINAL:
        return dict(prev)
    try:
        spec = SFTJobSpec.model_validate(body["spec"])
    except ValidationError as exc:
        return _invalid("SFTJob", body, exc)
    group, version, plural, kind = CHILD_KINDS[spec.backend]
    child = kube.get(group, version, plural, namespace, builders.training_job_name(name))
    data_path = prev.get("dataPath")
    if child is None:
        if violations := policy.check(spec, defaults):
            return _refused("SFTJob", body, violations)
        pack_spec, pack_status = None, None
        if spec.data.pack_job_ref is not None:
            packjob = kube.get(GROUP, VERSION, "packjobs", namespace, spec.data.pack_job_ref)
            readiness = st.data_readiness(spec.data.pack_job_ref, packjob)
            if not readiness.ready or packjob is None:
                return st.waiting_status(generation, readiness, prev, now())
            pack_spec, pack_status = PackJobSpec.model_validate(packjob["spec"]), packjob.get("status")
        data = builders.data_source(spec, pack_spec, pack_status)
        if (eval_ref := spec.data.eval_pack_job_ref) is not None:
            evaljob = kube.get(GROUP, VERSION, "packjobs", namespace, eval_ref)
            readiness = st.data_readiness(eval_ref, evaljob)
            if not readiness.ready or evaljob is None:
                return st.waiting_status(generation, readiness, prev, now())
            evals = builders.eval_source(data, eval_ref, PackJobSpec.model_validate(evaljob["spec"]))
            data = dataclasses.replace(data, eval=evals)
        data_path = data.path
        child = builders.training_job(name, namespace, spec, data, defaults)
        try:
            _create_owned(kube, body, builders.train_config_map(name, namespace, spec, data))
            _create_owned(kube, body, child)
        except ChildRefused as exc:
            return _child_refused("SFTJob", body, exc)
        except ApiException as exc:
            if exc.status == 404:
                raise kopf.TemporaryError(
                    f"the {kind} API ({group}/{version}) is not installed: install the Kubeflow "
                    f"{'Trainer v2' if kind == 'TrainJob' else 'training-operator'} CRDs or change spec.backend",
                    delay=60,
                ) from exc
            raise
    progress = None
    phase = st.child_phase(kind, child)[0]
    pods = kube.pods(namespace, f"{builders.SFTJOB_LABEL}={name}") if phase != "Suspended" else []
    if phase in st.TERMINAL:
        for pod in pods:
            term = st.terminated(
                pod, builders.TRAIN_CONTAINER if kind == "PyTorchJob" else builders.TRAINJOB_CONTAINER
            )
            progress = progress or (st.train_progress(term.summary, now()) if term else None)
    return st.sft_status(
        generation, kind, child, data_path or spec.data.path or "", prev, now(), progress, pods=pods
    )


RECONCILERS["sftjobs"] = ("SFTJob", reconcile_sftjob)


@kopf.on.resume(GROUP, VERSION, "sftjobs")
@kopf.on.create(GROUP, VERSION, "sftjobs")
def sftjob_start(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    write_status(memo, "sftjobs", body)


@kopf.on.event("kubeflow.org", "v1", "pytorchjobs", labels={builders.SFTJOB_LABEL: kopf.PRESENT})
def sftjob_pytorchjob_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    _parent_event(memo, "sftjobs", namespace, labels[builders.SFTJOB_LABEL])


@kopf.on.event("trainer.kubeflow.org", "v1alpha1", "trainjobs", labels={builders.SFTJOB_LABEL: kopf.PRESENT})
def sftjob_trainjob_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    _parent_event(memo, "sftjobs", namespace, labels[builders.SFTJOB_LABEL])


@kopf.on.event("", "v1", "pods", labels={builders.SFTJOB_LABEL: kopf.PRESENT})
def sftjob_pod_event(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    _parent_event(memo, "sftjobs", namespace, labels[builders.SFTJOB_LABEL])


@kopf.on.event(GROUP, VERSION, "packjobs")
def sftjob_data_event(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A PackJob changed: SFTJobs waiting for it may start (or learn that it failed)."""
    for sft in memo.kube.list(GROUP, VERSION, "sftjobs", namespace):
        waiting = (sft.get("status") or {}).get("phase") in (None, "Pending", "WaitingForData")
        data = (sft.get("spec") or {}).get("data") or {}
        if waiting and name in (data.get("packJobRef"), data.get("evalPackJobRef")):
            write_status(memo, "sftjobs", sft)


@kopf.on.field(GROUP, VERSION, "sftjobs", field="spec.suspend")
def sftjob_suspend(
    spec: kopf.Spec, name: str, namespace: str, old: Any, new: Any, memo: kopf.Memo, **_: Any
) -> None:
    """Pass `spec.suspend` on to the training job (only on change, so Kueue's own toggling is left alone)."""
    if old is None:
        return
    group, version, plural, kind = CHILD_KINDS[spec.get("backend", "pytorchjob")]
    patch = (
        {"spec": {"runPolicy": {"suspend": bool(new)}}}
        if kind == "PyTorchJob"
        else {"spec": {"suspend": bool(new)}}
    )
    try:
        memo.kube.patch(group, version, plural, namespace, builders.training_job_name(name), patch)
    except ApiException as exc:
        if exc.status != 404:  # not created yet: it will be created with the new value
            raise


@kopf.on.delete(GROUP, VERSION, "sftjobs", optional=True)
def sftjob_deleted(namespace: str, name: str, **_: Any) -> None:
    metrics.PHASES.forget("SFTJob", f"{namespace}/{name}")


# Training progress: scraped from rank 0's /metrics while a run is Running.

PROGRESS_INTERVAL = float(os.environ.get("PACKTRAIN_PROGRESS_INTERVAL", "30"))


def _track_running(memo: kopf.Memo, body: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    running = memo.setdefault("running", set())
    if status.get("phase") == "Running":
        running.add(key)
    else:
        running.discard(key)


def _metrics_target(kube: Kube, namespace: str, name: str) -> tuple[str, int] | None:
    """(the running master pod's /metrics URL, maxSteps), or None when there is nothing to scrape."""
    body = kube.get(GROUP, VERSION, "sftjobs", namespace, name)
    if body is None or (body.get("status") or {}).get("phase") != "Running":
        return None
    spec = SFTJobSpec.model_validate(body["spec"])
    pod = st.master_pod(kube.pods(namespace, f"{builders.SFTJOB_LABEL}={name}"))
    if pod is None:
        return None
    return scrape.metrics_url(pod["status"]["podIP"], spec.metrics_port), spec.training.fixed_steps()


async def update_progress(
    kube: Kube, client: aiohttp.ClientSession, namespace: str, name: str
) -> dict[str, Any] | None:
    """Scrape the master pod's trainer metrics into `status.progress`; None when there is nothing to read.

    The API calls and the parsing run in threads; the scrape itself is bounded in size and time (`scrape`).
    """
    loop = asyncio.get_running_loop()
    target = await loop.run_in_executor(None, _metrics_target, kube, namespace, name)
    if target is None:
        return None
    url, max_steps = target
    try:
        text = await scrape.fetch(client, url)
    except scrape.ScrapeError as exc:
        log.info("no progress for SFTJob %s/%s from %s: %s", namespace, name, url, exc)
        return None
    # Parsing up to MAX_BYTES of text takes a while: off the event loop kopf's handlers share.
    progress = await loop.run_in_executor(None, st.progress_from_metrics, text, max_steps, now())
    if progress is not None:
        await loop.run_in_executor(None, kube.merge_status, "sftjobs", namespace, name, {"progress": progress})
    return progress


async def progress_round(
    kube: Kube, client: aiohttp.ClientSession, jobs: list[tuple[str, str]], limit: asyncio.Semaphore
) -> list[dict[str, Any] | None]:
    """Scrape every running SFTJob at once, at most `limit` at a time; one failure stops no other."""

    async def one(namespace: str, name: str) -> dict[str, Any] | None:
        async with limit:
            try:
                return await update_progress(kube, client, namespace, name)
            except Exception:  # progress is best-effort; never stop the loop
                log.exception("progress of SFTJob %s/%s", namespace, name)
                return None

    return await asyncio.gather(*(one(namespace, name) for namespace, name in jobs))


async def _progress_loop(memo: kopf.Memo) -> None:
    limit = asyncio.Semaphore(scrape.CONCURRENCY)
    async with scrape.session() as client:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL)
            await progress_round(memo.kube, client, sorted(memo.get("running", ())), limit)


# Operator lifecycle


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Progress in annotations (the status schema is ours alone), client config, defaults, /metrics."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    memo.kube = Kube()
    memo.defaults = builders.OperatorDefaults.from_env()
    metrics.serve(int(memo.get("metrics_port", 0) or 0))


@kopf.on.startup()
async def start_progress(memo: kopf.Memo, **_: Any) -> None:
    """One loop for all running SFTJobs (a per-object kopf timer would put a finalizer on each)."""
    memo.progress_task = asyncio.create_task(_progress_loop(memo))


@kopf.on.cleanup()
async def stop_progress(memo: kopf.Memo, **_: Any) -> None:
    task = memo.get("progress_task")
    if task is not None:
        task.cancel()
