"""Pure builders: custom resource in, child manifests out.

Everything the operator creates is decided here, from the validated spec and the
operator's defaults, without any API call, so each manifest is unit-tested (golden
files under `tests/operator/golden/`) and the kopf handlers stay thin. Names are
deterministic, which is what makes "create if absent" idempotent across restarts.
"""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from packtrain.core.contract import PackStage
from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator.api import (
    API_VERSION,
    QUANTITY_PATTERN,
    SFT_CHECKPOINT_MOUNT,
    SFT_EVAL_MOUNT,
    SFT_MODEL_MOUNT,
    ClaimMount,
    PackJobSpec,
    ResourceRequirements,
    Runtime,
    SFTJobSpec,
)
from packtrain.operator.children import PYTORCHJOB, TRAINJOB
from packtrain.operator.commands import INDEXED_STAGES, pack_stage_command, train_command
from packtrain.operator.deadlines import Deadlines
from packtrain.operator.names import (
    PACK_CONTAINER,
    PACKJOB_LABEL,
    POOL_LABEL,
    QUEUE_LABEL,
    SFTJOB_LABEL,
    STAGE_LABEL,
    TRAIN_CONTAINER,
    TRAINJOB_CONTAINER,
    TRAINJOB_TARGET,
)
from packtrain.operator.policy import Policy

CONFIG_DIR = "/etc/packtrain"
PACK_CONFIG_FILE = "packjob.yaml"
TRAIN_CONFIG_FILE = "sftjob.yaml"
SFT_DATA_MOUNT = "/data"
TERMINATION_LOG = "/dev/termination-log"
TMP_DIR = "/tmp"
# The uid/gid of the `packtrain` user in images/packer and images/trainer.
WORKLOAD_ID = 65532


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packtrain")
    except PackageNotFoundError:
        return "latest"


def _json_env(env: Mapping[str, str], key: str, default: Any) -> Any:
    raw = env.get(key)
    if not raw:
        return default
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"environment variable {key} must be JSON, got {raw!r}: {exc}") from exc


def _policy(raw: Any) -> Policy:
    try:
        return Policy.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(
            f"environment variable PACKTRAIN_POLICY (the chart's `policy` values) is invalid: {exc}"
        ) from exc


def _deadlines(raw: Any) -> Deadlines:
    if not isinstance(raw, dict):
        raise ValueError(
            "environment variable PACKTRAIN_DEADLINES (the chart's `deadlines`) must be a mapping, got "
            f"{raw!r}"
        )
    try:
        return Deadlines.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"environment variable PACKTRAIN_DEADLINES (the chart's `deadlines`) is invalid: {exc}"
        ) from exc


@dataclass(frozen=True)
class OperatorDefaults:
    """What a spec may leave out: images and the CPU/GPU pools, set by the Helm chart through env."""

    packer_image: str = f"ghcr.io/packtrain/packer:{_version()}"
    trainer_image: str = f"ghcr.io/packtrain/trainer:{_version()}"
    cpu_node_selector: dict[str, str] = field(default_factory=lambda: {POOL_LABEL: "cpu"})
    cpu_tolerations: list[dict[str, Any]] = field(default_factory=list)
    gpu_node_selector: dict[str, str] = field(default_factory=lambda: {POOL_LABEL: "gpu"})
    gpu_tolerations: list[dict[str, Any]] = field(
        default_factory=lambda: [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    )
    # Requests of the pods whose spec sets none (a quota or a scheduler needs them on every pod).
    cpu_resources: dict[str, Any] = field(default_factory=lambda: {"requests": {"cpu": "1", "memory": "2Gi"}})
    gpu_resources: dict[str, Any] = field(
        default_factory=lambda: {"requests": {"cpu": "4", "memory": "64Gi"}}
    )
    # The size limit of the trainer pods' memory-backed /dev/shm (it counts against their memory limit).
    shm_size_limit: str = "16Gi"
    # The identity every workload pod runs as (the images' own non-root user by default).
    run_as_user: int = WORKLOAD_ID
    run_as_group: int = WORKLOAD_ID
    fs_group: int = WORKLOAD_ID
    # What a CR may put into its pods (the chart's `policy` values); checked before any child is created.
    policy: Policy = field(default_factory=Policy)
    # How long a finished stage Job stays (the Job controller deletes it and its pods after), None: kept.
    job_ttl_seconds: int | None = 86400
    # How long a job may stay blocked before it turns Failed or Degraded (the chart's `deadlines`).
    deadlines: Deadlines = field(default_factory=Deadlines)

    def __post_init__(self) -> None:
        for name in ("run_as_user", "run_as_group", "fs_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer (a non-root id), got {value!r}")
        if self.job_ttl_seconds is not None and (
            isinstance(self.job_ttl_seconds, bool)
            or not isinstance(self.job_ttl_seconds, int)
            or self.job_ttl_seconds < 0
        ):
            raise ValueError(
                f"job_ttl_seconds must be a non-negative integer or null, got {self.job_ttl_seconds!r}"
            )
        if not re.fullmatch(QUANTITY_PATTERN, str(self.shm_size_limit)):
            raise ValueError(
                f"shm_size_limit must be a Kubernetes quantity such as 16Gi, got {self.shm_size_limit!r}"
            )
        for name in ("cpu_resources", "gpu_resources"):
            try:
                ResourceRequirements.model_validate(getattr(self, name))
            except ValidationError as exc:
                raise ValueError(
                    f"{name} must be a container `resources` with Kubernetes quantities: {exc}"
                ) from exc

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorDefaults:
        """`PACKTRAIN_PACKER_IMAGE`, `PACKTRAIN_TRAINER_IMAGE`, JSON
        `PACKTRAIN_{CPU,GPU}_{NODE_SELECTOR,TOLERATIONS,
        RESOURCES}`, `PACKTRAIN_SHM_SIZE_LIMIT`, `PACKTRAIN_{RUN_AS_USER,RUN_AS_GROUP,FS_GROUP}`,
        `PACKTRAIN_JOB_TTL_SECONDS` (JSON: a
        number, or null to keep finished Jobs) and `PACKTRAIN_DEADLINES` (JSON: dataWaitSeconds,
        unschedulableSeconds, stallSeconds)."""
        env = os.environ if env is None else env
        base = cls()
        return cls(
            packer_image=env.get("PACKTRAIN_PACKER_IMAGE") or base.packer_image,
            trainer_image=env.get("PACKTRAIN_TRAINER_IMAGE") or base.trainer_image,
            cpu_node_selector=_json_env(env, "PACKTRAIN_CPU_NODE_SELECTOR", base.cpu_node_selector),
            cpu_tolerations=_json_env(env, "PACKTRAIN_CPU_TOLERATIONS", base.cpu_tolerations),
            gpu_node_selector=_json_env(env, "PACKTRAIN_GPU_NODE_SELECTOR", base.gpu_node_selector),
            gpu_tolerations=_json_env(env, "PACKTRAIN_GPU_TOLERATIONS", base.gpu_tolerations),
            cpu_resources=_json_env(env, "PACKTRAIN_CPU_RESOURCES", base.cpu_resources),
            gpu_resources=_json_env(env, "PACKTRAIN_GPU_RESOURCES", base.gpu_resources),
            shm_size_limit=env.get("PACKTRAIN_SHM_SIZE_LIMIT") or base.shm_size_limit,
            run_as_user=_json_env(env, "PACKTRAIN_RUN_AS_USER", base.run_as_user),
            run_as_group=_json_env(env, "PACKTRAIN_RUN_AS_GROUP", base.run_as_group),
            fs_group=_json_env(env, "PACKTRAIN_FS_GROUP", base.fs_group),
            policy=_policy(_json_env(env, "PACKTRAIN_POLICY", {})),
            job_ttl_seconds=_json_env(env, "PACKTRAIN_JOB_TTL_SECONDS", base.job_ttl_seconds),
            deadlines=_deadlines(_json_env(env, "PACKTRAIN_DEADLINES", {})),
        )


# Names and labels


def pack_config_name(name: str) -> str:
    return f"{name}-pack-config"


def train_config_name(name: str) -> str:
    return f"{name}-train-config"


def pack_job_name(name: str, stage: PackStage) -> str:
    return f"{name}-{stage}"


def training_job_name(name: str) -> str:
    """The PyTorchJob/TrainJob carries the SFTJob's name: what users look for."""
    return name


def _labels(component: str, parent_label: str, parent: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "packtrain",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "packtrain-operator",
        parent_label: parent,
        **extra,
    }


def pack_output_dir(name: str, spec: PackJobSpec) -> str:
    """The pack folder as pods see it: `<mountPath>/<subPath or name>`."""
    return f"{spec.output.mount_path.rstrip('/')}/{(spec.output.sub_path or name).strip('/')}"


# Pod pieces


def _scheduling(
    node_selector: dict[str, str] | None,
    tolerations: list[Any] | None,
    affinity: dict[str, Any] | None,
    default_selector: dict[str, str],
    default_tolerations: list[dict[str, Any]],
) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    selector = default_selector if node_selector is None else node_selector
    if selector:
        pod["nodeSelector"] = dict(selector)
    tols = (
        [dict(t) for t in default_tolerations]
        if tolerations is None
        else [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tolerations]
    )
    if tols:
        pod["tolerations"] = tols
    if affinity:
        pod["affinity"] = affinity
    return pod


def _env() -> list[dict[str, str]]:
    # Where packtrain writes its JSON summary (the kubelet's default path, named so tools that run
    # the command outside a kubelet, like the test node agent, can redirect it). HOME is the writable
    # /tmp: the root filesystem is read-only, and caches (Hugging Face, Triton) live under HOME.
    return [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PACKTRAIN_TERMINATION_LOG", "value": TERMINATION_LOG},
        {"name": "HOME", "value": TMP_DIR},
    ]


# Pod security: every pod the operator builds meets the `restricted` Pod Security Standard, so a
# namespace that enforces it runs PackJobs and SFTJobs, and a CR author cannot loosen it (no spec
# field reaches these settings; the identity is the admin's, from the chart's values).


def pod_security_context(defaults: OperatorDefaults) -> dict[str, Any]:
    """Pod level: a numeric non-root identity and the container runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": defaults.run_as_user,
        "runAsGroup": defaults.run_as_group,
        "fsGroup": defaults.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Container level: no privilege escalation, no capabilities, a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


def _tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """The writable /tmp the read-only root filesystem leaves out (torchrun, tokenizers and caches use it)."""
    return {"name": "tmp", "emptyDir": {}}, _mount("tmp", TMP_DIR)


def with_default_requests(own: Mapping[str, Any] | None, default: Mapping[str, Any]) -> dict[str, Any]:
    """Container resources that always carry requests (a namespace quota refuses pods without them).

    Each resource the spec names (as a request or a limit) is the spec's alone, a limit without a
    request requesting as much (what the API server would default); every other resource takes
    the pool's default request and limit.
    """
    own = own or {}
    requests = dict(own.get("requests") or {})
    limits = dict(own.get("limits") or {})
    touched = set(requests) | set(limits)
    requests.update({k: v for k, v in limits.items() if k not in requests})
    for part, target in (("requests", requests), ("limits", limits)):
        target.update({k: v for k, v in (default.get(part) or {}).items() if k not in touched})
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _pod_metadata(labels: dict[str, str], annotations: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _claim_volume(name: str, claim: str, read_only: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {"claimName": claim}
    if read_only:
        source["readOnly"] = True
    return {"name": name, "persistentVolumeClaim": source}


def _mount(name: str, path: str, read_only: bool = False, sub_path: str | None = None) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": path}
    if sub_path:
        mount["subPath"] = sub_path
    if read_only:
        mount["readOnly"] = True
    return mount


def _extra_volumes(extra: list[ClaimMount]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes = [_claim_volume(v.name, v.claim_name, v.read_only) for v in extra]
    mounts = [_mount(v.name, v.mount_path, v.read_only, v.sub_path) for v in extra]
    return volumes, mounts


def _config_map(
    name: str, namespace: str, labels: dict[str, str], filename: str, doc: dict[str, Any]
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {filename: yaml.safe_dump(doc, sort_keys=False)},
    }


# PackJob


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


# SFTJob


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
