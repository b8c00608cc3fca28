"""The SFTJob's handlers: its reconciler (wait for the data, create the training job once, mirror it)
and the events of its children, its pods and `spec.suspend`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.rest import ApiException
from pydantic import ValidationError

from packtrain.operator import builders, deadlines, metrics, ownership, progress
from packtrain.operator import status as st
from packtrain.operator.api import GROUP, VERSION, SFTJobSpec
from packtrain.operator.children import BY_BACKEND, PYTORCHJOB, TRAINJOB, ChildKind
from packtrain.operator.handlers.common import (
    RECONCILERS,
    ChildInTheWay,
    ChildRefused,
    _create_owned,
    _forget,
    _parent_event,
    _stop_stalled,
    _sync,
    now,
    write_status,
)
from packtrain.operator.names import SFTJOB_LABEL
from packtrain.operator.settings import OperatorDefaults


def reconcile_sftjob(
    kube: Any,
    body: Mapping[str, Any],
    defaults: OperatorDefaults,
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
    body: Mapping[str, Any], pods: list[dict[str, Any]], child: str, defaults: OperatorDefaults
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
