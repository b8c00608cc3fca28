"""The children of an SFTJob: where its pack is, its config ConfigMap, and the PyTorchJob or TrainJob."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packtrain.operator.api import (
    API_VERSION,
    SFT_CHECKPOINT_MOUNT,
    SFT_EVAL_MOUNT,
    SFT_MODEL_MOUNT,
    PackJobSpec,
    Runtime,
    SFTJobSpec,
)
from packtrain.operator.builders.common import (
    CONFIG_DIR,
    _claim_volume,
    _config_map,
    _env,
    _labels,
    _mount,
    _pod_metadata,
    _scheduling,
    _tmp_volume,
    container_security_context,
    pod_security_context,
    with_default_requests,
)
from packtrain.operator.builders.packjob import pack_output_dir
from packtrain.operator.children import PYTORCHJOB, TRAINJOB
from packtrain.operator.commands import train_command
from packtrain.operator.names import (
    QUEUE_LABEL,
    SFTJOB_LABEL,
    TRAIN_CONTAINER,
    TRAINJOB_CONTAINER,
    TRAINJOB_TARGET,
)
from packtrain.operator.settings import OperatorDefaults

TRAIN_CONFIG_FILE = "sftjob.yaml"
SFT_DATA_MOUNT = "/data"


def train_config_name(name: str) -> str:
    return f"{name}-train-config"


def training_job_name(name: str) -> str:
    """The PyTorchJob/TrainJob carries the SFTJob's name: what users look for."""
    return name


@dataclass(frozen=True)
class EvalSource:
    """The evaluation PackJob's pack: its folder in the pods, and the claim to mount for it (None when
    it lies on the training data's volume)."""

    path: str
    claim_name: str | None = None


@dataclass(frozen=True)
class DataSource:
    """Where the pack is for an SFTJob: resolved from `data.path` or from the referenced PackJob."""

    claim_name: str
    mount_path: str
    path: str
    sub_path: str | None = None
    eval: EvalSource | None = None


def eval_source(data: DataSource, ref: str, pack_spec: PackJobSpec) -> EvalSource:
    """The evaluation PackJob's output (`data.evalPackJobRef`): read through the training data's
    volume when that mounts the same whole claim, else its claim read-only at /eval-data."""
    folder = (pack_spec.output.sub_path or ref).strip("/")
    if pack_spec.output.claim_name == data.claim_name and data.sub_path is None:
        return EvalSource(f"{data.mount_path.rstrip('/')}/{folder}")
    if data.mount_path == SFT_EVAL_MOUNT:
        raise ValueError(
            f"the training pack is mounted at {SFT_EVAL_MOUNT}, where the evaluation pack's claim goes: "
            "give the training PackJob another spec.output.mountPath"
        )
    return EvalSource(f"{SFT_EVAL_MOUNT}/{folder}", pack_spec.output.claim_name)


def data_source(
    spec: SFTJobSpec, pack_spec: PackJobSpec | None, pack_status: Mapping[str, Any] | None
) -> DataSource:
    """The data volume and folder. With a PackJob reference, its claim at its mount path (read-only)."""
    override = spec.volumes.data
    if spec.data.pack_job_ref is None:
        if override is None or spec.data.path is None:
            raise ValueError(
                "spec.volumes.data is required with data.path: name the claim that holds the pack"
            )
        return DataSource(override.claim_name, SFT_DATA_MOUNT, spec.data.path, override.sub_path)
    if pack_spec is None:
        raise ValueError(f"PackJob {spec.data.pack_job_ref} is needed to resolve spec.data.packJobRef")
    path = (pack_status or {}).get("outputPath") or pack_output_dir(spec.data.pack_job_ref, pack_spec)
    claim = override.claim_name if override else pack_spec.output.claim_name
    return DataSource(claim, pack_spec.output.mount_path, path, override.sub_path if override else None)


def sft_output_dir(name: str) -> str:
    return f"{SFT_CHECKPOINT_MOUNT}/{name}"


def train_config_map(name: str, namespace: str, spec: SFTJobSpec, data: DataSource) -> dict[str, Any]:
    """The trainer's config, mounted at /etc/packtrain/sftjob.yaml, with the data folder resolved."""
    doc = {
        "apiVersion": API_VERSION,
        "kind": "SFTJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec.train_config(data.path, eval_path=data.eval.path if data.eval else None),
    }
    return _config_map(
        train_config_name(name),
        namespace,
        _labels("train-config", SFTJOB_LABEL, name),
        TRAIN_CONFIG_FILE,
        doc,
    )


def _train_resources(spec: SFTJobSpec, defaults: OperatorDefaults) -> dict[str, Any]:
    """GPUs, cpu and memory as set, as requests and limits; the GPU pool's default requests for the rest."""
    res = spec.resources
    limits: dict[str, Any] = {}
    if res.gpus_per_node:
        limits["nvidia.com/gpu"] = res.gpus_per_node
    if res.cpu is not None:
        limits["cpu"] = res.cpu
    if res.memory is not None:
        limits["memory"] = res.memory
    pool = defaults.gpu_resources if res.gpus_per_node else defaults.cpu_resources
    out = with_default_requests({"limits": limits, "requests": dict(limits)}, pool)
    # Without a memory limit one trainer (its dataloader workers, /dev/shm) can take the node's memory
    # from every other pod; its request, what the scheduler reserved, is the limit unless one is set.
    if "memory" in out.get("requests", {}) and "memory" not in out.get("limits", {}):
        out["limits"] = {**out.get("limits", {}), "memory": out["requests"]["memory"]}
    return out


def _train_volumes(
    name: str, spec: SFTJobSpec, data: DataSource, defaults: OperatorDefaults
) -> tuple[list[dict], list[dict]]:
    tmp_volume, tmp_mount = _tmp_volume()
    volumes = [
        _claim_volume("data", data.claim_name, read_only=True),
        _claim_volume("checkpoints", spec.volumes.checkpoints.claim_name),
        {"name": "config", "configMap": {"name": train_config_name(name)}},
        # NCCL and dataloader workers share tensors through /dev/shm; the default 64 MiB is too small.
        # Memory-backed, it counts against the pod's memory limit: capped, so it cannot take all of it.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": defaults.shm_size_limit}},
        tmp_volume,
    ]
    mounts = [
        _mount("data", data.mount_path, read_only=True, sub_path=data.sub_path),
        _mount("checkpoints", SFT_CHECKPOINT_MOUNT, sub_path=spec.volumes.checkpoints.sub_path),
        _mount("config", CONFIG_DIR, read_only=True),
        _mount("dshm", "/dev/shm"),
        tmp_mount,
    ]
    if data.eval is not None and data.eval.claim_name is not None:
        volumes.append(_claim_volume("eval-data", data.eval.claim_name, read_only=True))
        mounts.append(_mount("eval-data", SFT_EVAL_MOUNT, read_only=True))
    if spec.volumes.model is not None:
        volumes.append(_claim_volume("model", spec.volumes.model.claim_name, read_only=True))
        mounts.append(_mount("model", SFT_MODEL_MOUNT, read_only=True, sub_path=spec.volumes.model.sub_path))
    return volumes, mounts


def _train_metadata(name: str, namespace: str, spec: SFTJobSpec) -> dict[str, Any]:
    labels = _labels("training", SFTJOB_LABEL, name)
    if spec.queue_name:
        labels[QUEUE_LABEL] = spec.queue_name
    return {"name": training_job_name(name), "namespace": namespace, "labels": labels}


def _train_scheduling(spec: SFTJobSpec, defaults: OperatorDefaults) -> dict[str, Any]:
    """The training pods' placement: the SFTJob's own, else the operator's GPU pool (CPU pool with no
    GPUs)."""
    res = spec.resources
    if res.gpus_per_node == 0:
        selector, tolerations = defaults.cpu_node_selector, defaults.cpu_tolerations
    else:
        selector, tolerations = defaults.gpu_node_selector, defaults.gpu_tolerations
    return _scheduling(res.node_selector, res.tolerations, res.affinity, selector, tolerations)


def created_suspended(spec: SFTJobSpec) -> bool:
    """Suspended at creation when asked, or when queued: the queue (Kueue) admits it by unsuspending it."""
    return spec.suspend or bool(spec.queue_name)


def _train_command(name: str, spec: SFTJobSpec, data: DataSource) -> list[str]:
    return train_command(
        f"{CONFIG_DIR}/{TRAIN_CONFIG_FILE}",
        data.path,
        sft_output_dir(name),
        nproc_per_node=spec.resources.gpus_per_node,
        nnodes=spec.resources.nodes,
    )


def pytorch_job(
    name: str, namespace: str, spec: SFTJobSpec, data: DataSource, defaults: OperatorDefaults
) -> dict:
    """A `kubeflow.org/v1` PyTorchJob: one Master plus `nodes - 1` Workers, one container `pytorch` each.

    `restartPolicy: ExitCode` lets the training-operator restart pods killed by a
    signal (exit ≥ 128: preemption, OOM) but not ones that failed on their own
    (exit 1–127, including the config error 2), within `backoffLimit`.
    """
    volumes, mounts = _train_volumes(name, spec, data, defaults)
    container: dict[str, Any] = {
        "name": TRAIN_CONTAINER,
        "image": spec.image or defaults.trainer_image,
        "command": _train_command(name, spec, data),
        "env": _env(),
        "ports": [{"name": "metrics", "containerPort": spec.metrics_port, "protocol": "TCP"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "volumeMounts": mounts,
        "resources": _train_resources(spec, defaults),
        "securityContext": container_security_context(),
    }
    res = spec.resources
    pod_spec: dict[str, Any] = {
        # Trainer pods never call the API either.
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(defaults),
        **_train_scheduling(spec, defaults),
        "containers": [container],
        "volumes": volumes,
    }
    if spec.service_account_name:
        pod_spec["serviceAccountName"] = spec.service_account_name
    pod_labels = _labels("training", SFTJOB_LABEL, name)

    def replica(replicas: int) -> dict[str, Any]:
        return {
            "replicas": replicas,
            "restartPolicy": "ExitCode",
            "template": {
                "metadata": _pod_metadata(pod_labels, res.pod_annotations),
                "spec": copy.deepcopy(pod_spec),
            },
        }

    replicas = {"Master": replica(1)}
    if res.nodes > 1:
        replicas["Worker"] = replica(res.nodes - 1)
    return {
        "apiVersion": PYTORCHJOB.api_version,
        "kind": PYTORCHJOB.kind,
        "metadata": _train_metadata(name, namespace, spec),
        "spec": {
            "nprocPerNode": str(max(res.gpus_per_node, 1)),
            "runPolicy": {
                "backoffLimit": spec.backoff_limit,
                "cleanPodPolicy": spec.clean_pod_policy,
                "suspend": created_suspended(spec),
            },
            "pytorchReplicaSpecs": replicas,
        },
    }


def train_job(
    name: str, namespace: str, spec: SFTJobSpec, data: DataSource, defaults: OperatorDefaults
) -> dict:
    """A `trainer.kubeflow.org/v1alpha1` TrainJob against a (Cluster)TrainingRuntime, default
    torch-distributed.

    The runtime owns the pod template; volumes and scheduling go in as
    `podTemplateOverrides` on its `node` job. Trainer v2 lets a TrainJob override neither
    securityContext nor automountServiceAccountToken: the (admin-owned) runtime sets them.
    """
    runtime = spec.runtime or Runtime()
    volumes, mounts = _train_volumes(name, spec, data, defaults)
    res = spec.resources
    override_spec: dict[str, Any] = {
        **_train_scheduling(spec, defaults),
        "volumes": volumes,
        "containers": [{"name": TRAINJOB_CONTAINER, "volumeMounts": mounts}],
    }
    if spec.service_account_name:
        override_spec["serviceAccountName"] = spec.service_account_name
    trainer: dict[str, Any] = {
        "image": spec.image or defaults.trainer_image,
        "command": _train_command(name, spec, data),
        "env": _env(),
        "numNodes": res.nodes,
        "numProcPerNode": max(res.gpus_per_node, 1),
    }
    trainer["resourcesPerNode"] = _train_resources(spec, defaults)
    return {
        "apiVersion": TRAINJOB.api_version,
        "kind": TRAINJOB.kind,
        "metadata": _train_metadata(name, namespace, spec),
        "spec": {
            "runtimeRef": {"apiGroup": TRAINJOB.group, "kind": runtime.kind, "name": runtime.name},
            "suspend": created_suspended(spec),
            "trainer": trainer,
            "podTemplateOverrides": [
                {
                    "targetJobs": [{"name": TRAINJOB_TARGET}],
                    "metadata": _pod_metadata(_labels("training", SFTJOB_LABEL, name), res.pod_annotations),
                    "spec": override_spec,
                }
            ],
        },
    }


def training_job(
    name: str, namespace: str, spec: SFTJobSpec, data: DataSource, defaults: OperatorDefaults
) -> dict:
    """The child training job of the SFTJob's backend."""
    build = train_job if spec.backend == TRAINJOB.backend else pytorch_job
    return build(name, namespace, spec, data, defaults)
