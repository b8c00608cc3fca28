"""The children of a PackJob: its config ConfigMap and one batch/v1 Job per stage."""

from __future__ import annotations

from typing import Any

from packtrain.core.contract import PackStage
from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator.api import API_VERSION, PackJobSpec
from packtrain.operator.builders.common import (
    CONFIG_DIR,
    _claim_volume,
    _config_map,
    _env,
    _extra_volumes,
    _labels,
    _mount,
    _pod_metadata,
    _scheduling,
    _tmp_volume,
    container_security_context,
    pod_security_context,
    with_default_requests,
)
from packtrain.operator.commands import INDEXED_STAGES, pack_stage_command
from packtrain.operator.names import PACK_CONTAINER, PACKJOB_LABEL, QUEUE_LABEL, STAGE_LABEL
from packtrain.operator.settings import OperatorDefaults

PACK_CONFIG_FILE = "packjob.yaml"


def pack_config_name(name: str) -> str:
    return f"{name}-pack-config"


def pack_job_name(name: str, stage: PackStage) -> str:
    return f"{name}-{stage}"


def pack_output_dir(name: str, spec: PackJobSpec) -> str:
    """The pack folder as pods see it: `<mountPath>/<subPath or name>`."""
    return f"{spec.output.mount_path.rstrip('/')}/{(spec.output.sub_path or name).strip('/')}"


def pack_config_map(name: str, namespace: str, spec: PackJobSpec) -> dict[str, Any]:
    """The packer's config, mounted at /etc/packtrain/packjob.yaml (only the packer's sections)."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": "PackJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec.pack_config(),
    }
    labels = _labels("pack-config", PACKJOB_LABEL, name)
    return _config_map(pack_config_name(name), namespace, labels, PACK_CONFIG_FILE, doc)


def pack_job(
    name: str, namespace: str, spec: PackJobSpec, stage: PackStage, defaults: OperatorDefaults
) -> dict:
    """One stage as a batch/v1 Job: Indexed (one index per worker) for convert and materialize."""
    labels = _labels(f"pack-{stage}", PACKJOB_LABEL, name, **{STAGE_LABEL: stage})
    job_labels = {**labels, QUEUE_LABEL: spec.queue_name} if spec.queue_name else labels
    template = {
        "metadata": _pod_metadata(labels, spec.workers.pod_annotations),
        "spec": _pack_pod_spec(name, spec, stage, defaults),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": pack_job_name(name, stage), "namespace": namespace, "labels": job_labels},
        "spec": _pack_job_spec(spec, stage, template, defaults),
    }


def _pack_count(spec: PackJobSpec, stage: PackStage) -> int:
    """Pods of a stage: one per worker when Indexed, else one."""
    return spec.workers.count if stage in INDEXED_STAGES else 1


def _pack_container(name: str, spec: PackJobSpec, stage: PackStage, defaults: OperatorDefaults) -> dict:
    workers = spec.workers
    indexed = stage in INDEXED_STAGES
    extra_mounts = _extra_volumes(spec.volumes)[1]
    own = (
        workers.resources.model_dump(mode="json", by_alias=True, exclude_none=True)
        if workers.resources is not None
        else None
    )
    return {
        "name": PACK_CONTAINER,
        "image": workers.image or defaults.packer_image,
        "command": pack_stage_command(
            stage,
            f"{CONFIG_DIR}/{PACK_CONFIG_FILE}",
            pack_output_dir(name, spec),
            count=_pack_count(spec, stage) if indexed else None,
        ),
        "env": _env(),
        # The packer's JSON summary comes back through the termination message; a crash
        # leaves the log tail there instead, which is what the user needs to see.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": [
            _mount("output", spec.output.mount_path),
            _mount("config", CONFIG_DIR, read_only=True),
            _tmp_volume()[1],
            *extra_mounts,
        ],
        "resources": with_default_requests(own, defaults.cpu_resources),
        "securityContext": container_security_context(),
    }


def _pack_pod_spec(name: str, spec: PackJobSpec, stage: PackStage, defaults: OperatorDefaults) -> dict:
    workers = spec.workers
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # Packer pods never call the API: stats travel in the termination message.
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(defaults),
        **_scheduling(
            workers.node_selector,
            workers.tolerations,
            workers.affinity,
            defaults.cpu_node_selector,
            defaults.cpu_tolerations,
        ),
        "containers": [_pack_container(name, spec, stage, defaults)],
        "volumes": [
            _claim_volume("output", spec.output.claim_name),
            {"name": "config", "configMap": {"name": pack_config_name(name)}},
            _tmp_volume()[0],
            *_extra_volumes(spec.volumes)[0],
        ],
    }
    if workers.service_account_name:
        pod_spec["serviceAccountName"] = workers.service_account_name
    return pod_spec


def _pack_job_spec(
    spec: PackJobSpec, stage: PackStage, template: dict[str, Any], defaults: OperatorDefaults
) -> dict[str, Any]:
    """Completions, retries and cleanup. A configuration error (exit 2) fails the whole Job at once,
    since every retry would fail the same way; a disruption (preemption, node drain) is not counted
    against the retries."""
    count = _pack_count(spec, stage)
    config_error = {"containerName": PACK_CONTAINER, "operator": "In", "values": [EXIT_CONFIG]}
    job_spec: dict[str, Any] = {
        "completions": count,
        "parallelism": count,
        "podFailurePolicy": {
            "rules": [
                {"action": "FailJob", "onExitCodes": config_error},
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": template,
    }
    if defaults.job_ttl_seconds is not None:
        job_spec["ttlSecondsAfterFinished"] = defaults.job_ttl_seconds
    if spec.queue_name:
        job_spec["suspend"] = True  # created suspended: the queue (Kueue) admits it by unsuspending it
    if stage in INDEXED_STAGES:
        job_spec["completionMode"] = "Indexed"
        job_spec["backoffLimitPerIndex"] = spec.workers.backoff_limit_per_index
        job_spec["maxFailedIndexes"] = 0
    else:
        job_spec["completionMode"] = "NonIndexed"
        job_spec["backoffLimit"] = spec.workers.backoff_limit_per_index
    return job_spec
