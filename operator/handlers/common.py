"""What the handlers of both kinds share: creating owned children, the status write (conditional on the
resourceVersion it was computed from, each kind's reconciler registered in `RECONCILERS`), the
indexes kopf fills for the cached view, and the bookkeeping of deleted and stalled objects."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, cast

import kopf
from kubernetes.client.rest import ApiException

from packtrain.operator import logs, metrics, ownership
from packtrain.operator import status as st
from packtrain.operator.api import GROUP, VERSION
from packtrain.operator.children import BY_KIND, PYTORCHJOB, TRAINJOB
from packtrain.operator.names import JOB_NAME_LABEL, PACKJOB_LABEL, SFTJOB_LABEL
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.view import CachedKube

log = logging.getLogger("packtrain.operator")


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


# Each kind's reconciler, by plural: `packjob.py` and `sftjob.py` register theirs.
RECONCILERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {}


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


def _forget(memo: kopf.Memo, kind: str, plural: str, namespace: str | None, name: str) -> None:
    """A deleted resource leaves the phase gauge and the caches (kopf runs no delete handler without a
    finalizer)."""
    namespace = namespace or ""
    metrics.PHASES.forget(kind, f"{namespace}/{name}")
    memo.latest.pop((plural, namespace, name), None)
    memo.running.discard((namespace, name))
    log.info("%s %s/%s deleted", kind, namespace, name, extra=logs.ref(kind, namespace, name))


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
