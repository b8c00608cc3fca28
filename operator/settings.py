"""The operator's own settings: what a spec may leave out (images, the CPU/GPU pools, the workload
identity, the admin's policy, the deadlines), read from the environment the Helm chart sets from its
values."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from packtrain.operator.api import QUANTITY_PATTERN, ResourceRequirements
from packtrain.operator.deadlines import Deadlines
from packtrain.operator.names import POOL_LABEL
from packtrain.operator.policy import Policy

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
