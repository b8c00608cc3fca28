"""The PackJob's handlers: its reconciler (the next stage's Job) and the events that move it on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf
from pydantic import ValidationError

from packtrain.core.contract import PACK_STAGES, PackStage
from packtrain.operator import builders, metrics, ownership, policy
from packtrain.operator import status as st
from packtrain.operator.api import GROUP, VERSION, PackJobSpec
from packtrain.operator.handlers.common import (
    RECONCILERS,
    ChildInTheWay,
    ChildRefused,
    _create_owned,
    _forget,
    _parent_event,
    _sync,
    now,
    write_status,
)
from packtrain.operator.names import JOB_NAME_LABEL, PACKJOB_LABEL
from packtrain.operator.settings import OperatorDefaults


def reconcile_packjob(kube: Any, body: Mapping[str, Any], defaults: OperatorDefaults) -> dict[str, Any]:
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


RECONCILERS["packjobs"] = ("PackJob", reconcile_packjob)


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
