"""kopf handlers: read the cached view, ask `builders`/`status` what to do, write the result.

Event-driven, without kopf timers or daemons, so kopf puts no finalizer on
PackJobs or SFTJobs: deleting one never waits for the operator, and the garbage
collector removes the children it owns. A parent is reconciled when it is created
or the operator starts (`resume`), on every event of a child it owns (Jobs, pods,
PyTorchJobs/TrainJobs; SFTJobs also on their PackJob's events), and by one sweep
every `RESYNC_INTERVAL` seconds that bounds the waits (`status.Deadlines`).

Reads come from kopf indexes (`view.CachedKube`), filled by the watches kopf runs anyway,
so an event costs no API read. Every create is "if absent" under a deterministic name,
so a restart mid-run, a stale cache or two events racing never makes a duplicate; a child
counts only if its ownerReference carries the parent's uid (`ownership`), so a parent
re-created under the same name waits for its predecessor's children to go; every
status write is conditional on the resourceVersion it was computed from, so a stale view
never overwrites a newer one.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

import kopf
import kubernetes
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from packtrain.core.contract import PACK_STAGES, PackStage
from packtrain.operator import builders, deadlines, logs, metrics, ownership, policy, progress
from packtrain.operator import status as st
from packtrain.operator.api import GROUP, VERSION, PackJobSpec, SFTJobSpec
from packtrain.operator.children import BY_BACKEND, BY_KIND, PYTORCHJOB, TRAINJOB, ChildKind
from packtrain.operator.names import JOB_NAME_LABEL, PACKJOB_LABEL, SFTJOB_LABEL
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.view import CachedKube, Kube

log = logging.getLogger("packtrain.operator")

RESYNC_INTERVAL = float(os.environ.get("PACKTRAIN_RESYNC_INTERVAL", "60"))
# Seconds between looks at a parent waiting for its predecessor's children to be garbage-collected.
LEFTOVER_RECHECK = 2.0

__all__ = ["Kube", "reconcile_packjob", "reconcile_sftjob", "write_status"]


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ChildRefused(Exception):
    """The API server refused a child for good (a quota or an admission policy, an invalid object)."""


class ChildInTheWay(Exception):
    """A same-named object is in a child's way: an earlier parent's being deleted, or someone else's.

    (Not `api.Blocked`, the `status.blocked` model: this one stops a create.)"""

    def __init__(self, blocker: ownership.Blocker) -> None:
        super().__init__(blocker.message)
        self.blocker = blocker


def _create_owned(kube: Any, owner: Mapping[str, Any], child: dict[str, Any]) -> None:
    """Create `child` owned by `owner`; one already there must be the owner's own (`ChildInTheWay`
    otherwise)."""
    kopf.adopt(child, owner=kopf.Body(cast(kopf.RawBody, owner)))  # as read from the API: a raw body
    meta = child["metadata"]
    try:
        created = kube.create(child)
    except ApiException as exc:
        if exc.status in st.REFUSED_CODES:
            raise ChildRefused(
                st.refusal_message(child["kind"], meta["name"], exc.status, exc.reason, exc.body)
            ) from exc
        raise
    if created:
        log.info(
            "created %s %s/%s",
            child["kind"],
            meta["namespace"],
            meta["name"],
            extra=logs.ref(owner["kind"], meta["namespace"], owner["metadata"]["name"]),
        )
        return
    existing = kube.read(child)
    if existing is None:  # deleted (by the garbage collector) between the create and the read
        raise ChildInTheWay(
            ownership.Blocker(
                R.PREVIOUS_OBJECT_BEING_DELETED,
                f"{child['kind']} {meta['namespace']}/{meta['name']} was being deleted; creating it again",
            )
        )
    if (blocker := ownership.blocker(owner, [existing])) is not None:
        raise ChildInTheWay(blocker)


def _post_transition(kind: str, body: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    """Event on the custom resource when its phase or reason changed, the phase gauge, stage durations."""
    prev = body.get("status") or {}
    event = st.transition_event(prev.get("phase"), st.event_reason(prev), status)
    for said in (event, st.memory_plan_event(prev, status)):
        if said is not None:
            kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=said[0], reason=said[1], message=said[2])
    meta = body["metadata"]
    metrics.PHASES.record(kind, f"{meta['namespace']}/{meta['name']}", status.get("phase"))
    # One observation per stage per pack: only the write that first records a stage observes it,
    # and that write is conditional, so neither a racing event nor a restart observes it again.
    before = prev.get("stageSeconds") or {}
    for stage, seconds in (status.get("stageSeconds") or {}).items():
        if stage not in before:
            metrics.STAGE_SECONDS.labels(stage).observe(seconds)


# PackJob


def reconcile_packjob(
    kube: Any, body: Mapping[str, Any], defaults: builders.OperatorDefaults
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
        return st.invalid_status("PackJob", body, exc, now())
    jobs = {
        stage: kube.get("batch", "v1", "jobs", namespace, builders.pack_job_name(name, stage))
        for stage in PACK_STAGES
    }
    if (blocker := ownership.blocker(body, jobs.values())) is not None:
        return st.blocked_status(body, blocker, now())
    pods = {
        stage: ownership.pods_of(job, kube.pods(namespace, _job_selector(name, stage)))
        for stage, job in jobs.items()
        if job is not None
    }
    decision = st.pack_status(name, meta.get("generation"), spec, jobs, pods, prev, now(), defaults.deadlines)
    if decision.create is not None:
        if violations := policy.check(spec, defaults):
            return st.policy_status("PackJob", body, violations, now())
        job_name = builders.pack_job_name(name, decision.create)
        stale_pods = kube.pods(namespace, _job_selector(name, decision.create))
        if (leftover := ownership.leftover_pod(body, f"Job {job_name}", stale_pods)) is not None:
            return st.blocked_status(body, leftover, now())
        try:
            if decision.create == PACK_STAGES[0]:  # the stages share the config the first one gets
                _create_owned(kube, body, builders.pack_config_map(name, namespace, spec))
            _create_owned(kube, body, builders.pack_job(name, namespace, spec, decision.create, defaults))
        except ChildRefused as exc:
            return st.child_refused_status("PackJob", body, str(exc), now())
        except ChildInTheWay as exc:
            return st.blocked_status(body, exc.blocker, now())
    return decision.status


def _job_selector(name: str, stage: PackStage) -> str:
    return f"{JOB_NAME_LABEL}={builders.pack_job_name(name, stage)}"


RECONCILERS = {"packjobs": ("PackJob", reconcile_packjob)}


def write_status(memo: kopf.Memo, plural: str, body: Mapping[str, Any], **hints: Any) -> None:
    """Reconcile and store the status, retrying on a conflicting write so a stale view never wins.

    Several events can reconcile one parent at once (its own, its children's); the
    status is computed from what was read and written only if the object is unchanged
    since, otherwise read again and recomputed.
    """
    kube = memo.view if "view" in memo else memo.kube
    if not isinstance(kube, CachedKube):
        _write_status(memo, kube, plural, body, **hints)
        return
    meta = body["metadata"]
    with kube.lock(plural, meta["namespace"], meta["name"]):
        # What the previous writer left (its own write is in the view at once).
        current = kube.get(GROUP, VERSION, plural, meta["namespace"], meta["name"])
        if current is not None and current["metadata"].get("uid") == meta.get("uid"):
            body = current
        _write_status(memo, kube, plural, body, **hints)


def _write_status(memo: kopf.Memo, kube: Any, plural: str, body: Mapping[str, Any], **hints: Any) -> None:
    kind, reconcile = RECONCILERS[plural]
    meta = body["metadata"]
    for _ in range(5):
        try:
            status = reconcile(kube, body, memo.defaults, **hints)
        except Exception as exc:
            metrics.ERRORS.labels(kind, type(exc).__name__).inc()
            raise
        _track_leftovers(memo, plural, meta, status)
        if status == (body.get("status") or {}):
            metrics.PHASES.record(kind, f"{meta['namespace']}/{meta['name']}", status.get("phase"))
            return
        try:
            kube.patch_status(plural, meta["namespace"], meta["name"], status, meta["resourceVersion"])
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Someone wrote since (kopf's own annotations, another event's status): its watch event
            # brings the newer object into the cache moments later; the API is asked only if it does not.
            waited = (
                kube.wait_newer(plural, meta["namespace"], meta["name"], meta["resourceVersion"])
                if isinstance(kube, CachedKube)
                else None
            )
            fresh = waited or memo.kube.get(GROUP, VERSION, plural, meta["namespace"], meta["name"])
            if fresh is None or fresh["metadata"].get("deletionTimestamp"):
                return
            body, meta = fresh, fresh["metadata"]
            continue
        _post_transition(kind, body, status)
        if kind == "SFTJob":
            _stop_stalled(kube, body, status)
        return
    raise kopf.TemporaryError(f"{kind} {meta['name']} kept changing while its status was written", delay=5)


def _track_leftovers(
    memo: kopf.Memo, plural: str, meta: Mapping[str, Any], status: Mapping[str, Any]
) -> None:
    """Remember the parents waiting for a predecessor's children, for the short recheck of the sweep loop."""
    leftovers = memo.get("leftovers")
    if leftovers is None:
        return
    key = (plural, meta["namespace"], meta["name"])
    ready = st.get_condition(status.get("conditions"), "Ready") or {}
    if status.get("phase") == "Pending" and ready.get("reason") == R.PREVIOUS_OBJECT_BEING_DELETED:
        leftovers.add(key)
    else:
        leftovers.discard(key)


def _parent_event(memo: kopf.Memo, plural: str, namespace: str | None, name: str, **hints: Any) -> None:
    """A child changed: reconcile its parent (kopf types `namespace` optional; ours are all namespaced)."""
    parent = memo.view.get(GROUP, VERSION, plural, namespace or "", name)
    if parent is not None and not parent["metadata"].get("deletionTimestamp"):
        write_status(memo, plural, parent, **hints)


def _sync(memo: kopf.Memo, indexes: Mapping[str, Any]) -> None:
    """Point the cached view at the indexes kopf passed to this handler (the same objects every call).

    kopf gives each resource object a shallow copy of the startup memo: the view itself is
    created at startup, so every handler and the sweep share it. The sweep also borrows a
    handler's context, where kopf keeps what posting an Event needs.
    """
    memo.view.indexes = indexes
    if memo.view.context is None:
        memo.view.context = contextvars.copy_context()


# Indexes: the cached view the reconcilers read (kopf fills them from its watches).


def _key(namespace: str | None, name: str) -> tuple[str, str]:
    return (namespace or "", name)


@kopf.index("batch", "v1", "jobs", labels={PACKJOB_LABEL: kopf.PRESENT})
def job_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {_key(namespace, name): dict(body)}


@kopf.index("", "v1", "pods", labels={PACKJOB_LABEL: kopf.PRESENT})
def pack_pod_index(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {(JOB_NAME_LABEL, *_key(namespace, labels.get(JOB_NAME_LABEL, ""))): dict(body)}


@kopf.index("", "v1", "pods", labels={SFTJOB_LABEL: kopf.PRESENT})
def sft_pod_index(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> dict[Any, Any]:
    return {(SFTJOB_LABEL, *_key(namespace, labels[SFTJOB_LABEL])): dict(body)}


@kopf.index(PYTORCHJOB.group, PYTORCHJOB.version, PYTORCHJOB.plural, labels={SFTJOB_LABEL: kopf.PRESENT})
def pytorchjob_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {_key(namespace, name): dict(body)}


@kopf.index(TRAINJOB.group, TRAINJOB.version, TRAINJOB.plural, labels={SFTJOB_LABEL: kopf.PRESENT})
def trainjob_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {_key(namespace, name): dict(body)}


@kopf.index(GROUP, VERSION, "packjobs")
def packjob_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {_key(namespace, name): dict(body)}


@kopf.index(GROUP, VERSION, "sftjobs")
def sftjob_index(namespace: str | None, name: str, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {_key(namespace, name): dict(body)}


# PackJob handlers


@kopf.on.resume(GROUP, VERSION, "packjobs")
@kopf.on.create(GROUP, VERSION, "packjobs")
def packjob_start(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    _sync(memo, kwargs)
    write_status(
        memo,
        "packjobs",
        memo.view.get(GROUP, VERSION, "packjobs", body.metadata.namespace, body.metadata.name) or dict(body),
    )


@kopf.on.event("batch", "v1", "jobs", labels={PACKJOB_LABEL: kopf.PRESENT})
def packjob_child_event(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    """A stage Job changed: move its PackJob on."""
    _sync(memo, kwargs)
    _parent_event(memo, "packjobs", namespace, labels[PACKJOB_LABEL])


@kopf.on.event("", "v1", "pods", labels={PACKJOB_LABEL: kopf.PRESENT})
def packjob_pod_event(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    """A stage pod changed (e.g. cannot be scheduled, which its Job does not report): refresh the PackJob."""
    _sync(memo, kwargs)
    _parent_event(memo, "packjobs", namespace, labels[PACKJOB_LABEL])


@kopf.on.event(GROUP, VERSION, "packjobs")
def packjob_event(type: str | None, namespace: str | None, name: str, memo: kopf.Memo, **kwargs: Any) -> None:
    """A PackJob changed or went: its gauge, and the SFTJobs that wait for (or train on) its pack."""
    _sync(memo, kwargs)
    if type == "DELETED":
        _forget(memo, "PackJob", "packjobs", namespace, name)
    for sft in memo.view.list(GROUP, VERSION, "sftjobs", namespace):
        phase = (sft.get("status") or {}).get("phase")
        data = (sft.get("spec") or {}).get("data") or {}
        if phase not in st.TERMINAL and name in (data.get("packJobRef"), data.get("evalPackJobRef")):
            write_status(memo, "sftjobs", sft)


def _forget(memo: kopf.Memo, kind: str, plural: str, namespace: str | None, name: str) -> None:
    """A deleted resource leaves the phase gauge and the caches (kopf runs no delete handler without a
    finalizer)."""
    namespace = namespace or ""
    metrics.PHASES.forget(kind, f"{namespace}/{name}")
    memo.latest.pop((plural, namespace, name), None)
    memo.running.discard((namespace, name))
    log.info("%s %s/%s deleted", kind, namespace, name, extra=logs.ref(kind, namespace, name))


# SFTJob


def reconcile_sftjob(
    kube: Any,
    body: Mapping[str, Any],
    defaults: builders.OperatorDefaults,
    pod: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Wait for the data, create the training job once, and mirror its state.

    Reads, then `st.decide_start` (no training job yet) or `st.mirror` (one exists) decides.
    `pod`: the trainer pod of the event being handled, as the event carried it; a pod being
    deleted is already gone from the cache, but its termination message is in this body.
    """
    metrics.RECONCILES.labels("SFTJob").inc()
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    prev = body.get("status") or {}
    if prev.get("phase") in st.TERMINAL:
        _stop_stalled(kube, body, prev)  # again after a restart between the Failed write and the delete
        return dict(prev)
    try:
        spec = SFTJobSpec.model_validate(body["spec"])
    except ValidationError as exc:
        return st.invalid_status("SFTJob", body, exc, now())
    kind = BY_BACKEND[spec.backend]
    child = kube.get(kind.group, kind.version, kind.plural, namespace, builders.training_job_name(name))
    if child is not None and (blocker := ownership.blocker(body, [child])) is not None:
        return st.blocked_status(body, blocker, now())
    packjob = _packjob(kube, namespace, spec.data.pack_job_ref)
    data_path = prev.get("dataPath")
    created_plan = None
    if child is None:
        evaljob = _packjob(kube, namespace, spec.data.eval_pack_job_ref)
        decision = st.decide_start(body, spec, defaults, packjob, evaljob, now())
        if (data := decision.create) is None:
            assert decision.status is not None  # a decision either creates or says why not
            return decision.status
        data_path, created_plan = data.path, decision.memory_plan
        child = builders.training_job(name, namespace, spec, data, defaults)
        configmap = builders.train_config_map(name, namespace, spec, data)
        if (refused := _create_training_job(kube, body, kind, configmap, child)) is not None:
            return refused
    phase = st.child_phase(kind.kind, child)[0]
    pods = _training_pods(kube, child, phase, pod)
    running = phase == "Running"
    stall = (
        _training_stall(body, pods, f"{kind.kind} {child['metadata']['name']}", defaults) if running else None
    )
    status = st.mirror(
        body,
        spec,
        kind,
        child,
        pods,
        data_path=data_path or spec.data.path or "",
        pack_present=packjob is not None,
        stall=stall,
        defaults=defaults,
        now=now(),
    )
    if created_plan is not None:
        status["memoryPlan"] = created_plan
    return status


def _packjob(kube: Any, namespace: str, ref: str | None) -> dict[str, Any] | None:
    return None if ref is None else kube.get(GROUP, VERSION, "packjobs", namespace, ref)


def _create_training_job(
    kube: Any, body: Mapping[str, Any], kind: ChildKind, configmap: dict[str, Any], child: dict[str, Any]
) -> dict[str, Any] | None:
    """Create the training config and job (after any predecessor's pods are gone); a status when it cannot."""
    name = body["metadata"]["name"]
    stale_pods = kube.pods(body["metadata"]["namespace"], f"{SFTJOB_LABEL}={name}")
    if (leftover := ownership.leftover_pod(body, f"{kind.kind} {name}", stale_pods)) is not None:
        return st.blocked_status(body, leftover, now())
    try:
        _create_owned(kube, body, configmap)
        _create_owned(kube, body, child)
    except ChildRefused as exc:
        return st.child_refused_status("SFTJob", body, str(exc), now())
    except ChildInTheWay as exc:
        return st.blocked_status(body, exc.blocker, now())
    except ApiException as exc:
        if exc.status == 404:
            operator = "Trainer v2" if kind is TRAINJOB else "training-operator"
            raise kopf.TemporaryError(
                f"the {kind.kind} API ({kind.group}/{kind.version}) is not installed: install the Kubeflow "
                f"{operator} CRDs or change spec.backend",
                delay=60,
            ) from exc
        raise
    return None


def _training_pods(
    kube: Any, child: Mapping[str, Any], phase: str, pod: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    """The training job's own pods (none read while it is suspended), with the event's pod as it came."""
    meta = child["metadata"]
    pods = kube.pods(meta["namespace"], f"{SFTJOB_LABEL}={meta['name']}") if phase != "Suspended" else []
    if pod is not None:
        pods = [p for p in pods if p["metadata"]["name"] != pod["metadata"]["name"]] + [dict(pod)]
    return ownership.pods_of(child, pods)


def _training_stall(
    body: Mapping[str, Any], pods: list[dict[str, Any]], child: str, defaults: builders.OperatorDefaults
) -> deadlines.Stall | None:
    """The training-stall deadline of a Running SFTJob, from its status (the clock is kept there)."""
    meta, prev = body["metadata"], body.get("status") or {}
    running = st.get_condition(prev.get("conditions"), "Running") or {}
    master = progress.master_pod(pods)
    return deadlines.training_stall(
        prev,
        running.get("lastTransitionTime") if running.get("status") == "True" else None,
        now(),
        defaults.deadlines,
        recent=progress.RECENT,
        namespace=meta["namespace"],
        selector=f"{SFTJOB_LABEL}={meta['name']}",
        pod=master["metadata"]["name"] if master is not None else None,
        child=child,
    )


RECONCILERS["sftjobs"] = ("SFTJob", reconcile_sftjob)


def _stop_stalled(kube: Any, body: Mapping[str, Any], status: Mapping[str, Any]) -> None:
    """Delete the training job of an SFTJob failed for a training stall, so its GPUs go back to the pool.

    Only once that status is written: a child gone from the view while the SFTJob still ran
    would be created again.
    """
    failed = st.get_condition(status.get("conditions"), "Failed") or {}
    if status.get("phase") != "Failed" or failed.get("reason") != R.TRAINING_STALLED:
        return
    ref = status.get("trainingJob") or {}
    kind = BY_KIND[ref.get("kind", "")]
    namespace = body["metadata"]["namespace"]
    child = kube.get(kind.group, kind.version, kind.plural, namespace, ref.get("name", ""))
    if child is None or child["metadata"].get("deletionTimestamp"):
        return
    if ownership.claim(child, body) is not ownership.Claim.OURS:  # a same-named object that is not this job's
        return
    kube.delete(kind.group, kind.version, kind.plural, namespace, ref["name"], uid=child["metadata"]["uid"])
    log.warning(
        "deleted %s %s/%s: training stalled",
        kind.kind,
        namespace,
        ref["name"],
        extra=logs.ref("SFTJob", namespace, body["metadata"]["name"]),
    )


@kopf.on.resume(GROUP, VERSION, "sftjobs")
@kopf.on.create(GROUP, VERSION, "sftjobs")
def sftjob_start(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
    _sync(memo, kwargs)
    write_status(
        memo,
        "sftjobs",
        memo.view.get(GROUP, VERSION, "sftjobs", body.metadata.namespace, body.metadata.name) or dict(body),
    )


@kopf.on.event(PYTORCHJOB.group, PYTORCHJOB.version, PYTORCHJOB.plural, labels={SFTJOB_LABEL: kopf.PRESENT})
def sftjob_pytorchjob_event(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    _sync(memo, kwargs)
    _parent_event(memo, "sftjobs", namespace, labels[SFTJOB_LABEL])


@kopf.on.event(TRAINJOB.group, TRAINJOB.version, TRAINJOB.plural, labels={SFTJOB_LABEL: kopf.PRESENT})
def sftjob_trainjob_event(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **kwargs: Any
) -> None:
    _sync(memo, kwargs)
    _parent_event(memo, "sftjobs", namespace, labels[SFTJOB_LABEL])


@kopf.on.event("", "v1", "pods", labels={SFTJOB_LABEL: kopf.PRESENT})
def sftjob_pod_event(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A trainer pod changed: mirror it, keeping its termination message before the pod is deleted."""
    _sync(memo, kwargs)
    _parent_event(memo, "sftjobs", namespace, labels[SFTJOB_LABEL], pod=dict(body))


@kopf.on.event(GROUP, VERSION, "sftjobs")
def sftjob_event(
    type: str | None, namespace: str | None, name: str, body: kopf.Body, memo: kopf.Memo, **kwargs: Any
) -> None:
    """Track running SFTJobs for the progress scrape; forget deleted ones."""
    _sync(memo, kwargs)
    if type == "DELETED":
        _forget(memo, "SFTJob", "sftjobs", namespace, name)
    elif (body.get("status") or {}).get("phase") == "Running":
        memo.running.add((namespace, name))
    else:
        memo.running.discard((namespace, name))


@kopf.on.field(GROUP, VERSION, "sftjobs", field="spec.suspend")
def sftjob_suspend(
    spec: kopf.Spec,
    name: str,
    namespace: str | None,
    old: Any,
    new: Any,
    body: kopf.Body,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """Pass `spec.suspend` on to the training job (only on change, so Kueue's own toggling is left alone).

    A queued job (spec.queueName) is resumed by its queue, not by the operator: clearing
    `suspend` there is left to Kueue's admission.
    """
    if old is None or (not new and spec.get("queueName")):
        return
    kind = BY_BACKEND[spec.get("backend", PYTORCHJOB.backend)]
    child = memo.view.get(kind.group, kind.version, kind.plural, namespace, builders.training_job_name(name))
    if child is None or ownership.claim(child, body) is not ownership.Claim.OURS:
        return  # not created yet (it will be created with the new value), or not this SFTJob's to change
    patch = (
        {"spec": {"runPolicy": {"suspend": bool(new)}}}
        if kind is PYTORCHJOB
        else {"spec": {"suspend": bool(new)}}
    )
    try:
        memo.kube.patch(
            kind.group, kind.version, kind.plural, namespace, builders.training_job_name(name), patch
        )
    except ApiException as exc:
        if exc.status != 404:  # not created yet: it will be created with the new value
            raise


# Periodic sweep: bounded waits need a clock, not only events.


def sweep(memo: kopf.Memo, only: frozenset[tuple[str, str, str]] | None = None) -> None:
    """Reconcile every unfinished PackJob and SFTJob from the cache, so deadlines pass without an event.

    `only`: just these (plural, namespace, name), the parents waiting for a predecessor's leftovers.
    """
    seen: set[tuple[str, str, str]] = set()
    for plural in ("packjobs", "sftjobs"):
        for body in memo.view.list_all(plural):
            key = (plural, body["metadata"]["namespace"], body["metadata"]["name"])
            seen.add(key)
            if (only is None or key in only) and (body.get("status") or {}).get("phase") not in st.TERMINAL:
                meta = body["metadata"]
                try:
                    write_status(memo, plural, body)
                except Exception:  # one broken object must not stop the sweep of the others
                    kind = RECONCILERS[plural][0]
                    log.exception(
                        "%s %s/%s: reconcile in the sweep failed",
                        kind,
                        meta["namespace"],
                        meta["name"],
                        extra=logs.ref(kind, meta["namespace"], meta["name"]),
                    )
    if "leftovers" in memo:  # parents deleted while they waited
        memo.leftovers.difference_update(set(memo.leftovers) - seen)


async def _sweep_loop(memo: kopf.Memo) -> None:
    """The full sweep every RESYNC_INTERVAL; between them, every LEFTOVER_RECHECK seconds, the parents
    waiting for a predecessor's leftovers (a ConfigMap's deletion brings no event: none is watched)."""
    loop = asyncio.get_running_loop()
    next_sweep = loop.time() + RESYNC_INTERVAL
    while True:
        await asyncio.sleep(min(RESYNC_INTERVAL, LEFTOVER_RECHECK))
        view = memo.get("view")
        context = view.context if view is not None else None
        if context is None:  # no handler has run yet: nothing is cached to sweep
            continue
        if loop.time() >= next_sweep:
            next_sweep = loop.time() + RESYNC_INTERVAL
            await loop.run_in_executor(None, context.run, sweep, memo)
        elif waiting := frozenset(memo.get("leftovers") or ()):
            await loop.run_in_executor(None, context.run, sweep, memo, waiting)


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
    memo.latest = {}
    memo.running = set()
    memo.leftovers = set()  # (plural, namespace, name) of parents waiting for a predecessor's children to go
    memo.view = CachedKube(memo.kube, memo.latest)
    memo.defaults = builders.OperatorDefaults.from_env()
    metrics.serve(int(memo.get("metrics_port", 0) or 0))


@kopf.on.startup()
async def start_loops(memo: kopf.Memo, **_: Any) -> None:
    """One progress loop for all running SFTJobs and one deadline sweep (per-object kopf timers would put
    a finalizer on each)."""
    memo.progress_task = asyncio.create_task(
        progress.progress_loop(lambda: memo.view, lambda: sorted(memo.get("running") or ()), now)
    )
    memo.sweep_task = asyncio.create_task(_sweep_loop(memo))


@kopf.on.cleanup()
async def stop_loops(memo: kopf.Memo, **_: Any) -> None:
    for task in (memo.get("progress_task"), memo.get("sweep_task")):
        if task is not None:
            task.cancel()
