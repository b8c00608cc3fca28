"""The `SFTJob` kind: its spec (the trainer's sections, resources, volumes, backend), its status, its CRD
columns."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from packtrain.core.config import CamelModel
from packtrain.core.sft_config import DataSpec, TrainingSpec, TrainModelSpec
from packtrain.operator.api.common import (
    QUANTITY_PATTERN,
    Blocked,
    Condition,
    Quantity,
    Scheduling,
    SubPath,
    immutable_rules,
)

SFTPhase = Literal["Pending", "WaitingForData", "Running", "Succeeded", "Failed", "Suspended"]
Backend = Literal["pytorchjob", "trainjob"]


class SFTResources(Scheduling):
    """Nodes, GPUs and the GPU pool."""

    nodes: int = Field(1, ge=1, le=1024, description="Pods (torchrun nodes): 1 Master + nodes-1 Workers.")
    gpus_per_node: int = Field(
        1, ge=0, le=64, description="nvidia.com/gpu per pod = torchrun processes per node."
    )
    cpu: Quantity | None = Field(None, description="CPU request and limit per pod, e.g. 16 or 15500m.")
    memory: Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)] | None = Field(
        None, description="Memory request and limit per pod, e.g. 200Gi."
    )
    gpu_memory: Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)] | None = Field(
        None,
        description="Memory of one GPU, e.g. 80Gi (H100) or 141Gi (H200): the operator plans the job's "
        "memory against it before creating the training job and refuses one that cannot fit; default: "
        "the chart's policy.gpuMemory.",
    )


class VolumeClaim(CamelModel):
    """A PersistentVolumeClaim and the folder of it to use."""

    claim_name: str = Field(..., min_length=1, description="The PersistentVolumeClaim.")
    sub_path: SubPath | None = Field(None, description="The folder of the claim to use; default: all of it.")


class SFTVolumes(CamelModel):
    """Claims of the training pods. Data defaults to the referenced PackJob's output claim."""

    data: VolumeClaim | None = Field(
        None, description="Claim holding data.path, mounted read-only at /data; default: the PackJob's claim."
    )
    model: VolumeClaim | None = Field(
        None, description="Claim holding model.path, mounted read-only at /models; omit if it is on data."
    )
    checkpoints: VolumeClaim = Field(
        ..., description="Writable claim mounted at /checkpoints; the run writes to <subPath or name>/."
    )


class Runtime(CamelModel):
    """The Kubeflow Trainer v2 runtime a `trainjob` backend runs against."""

    name: str = Field("torch-distributed", description="The runtime's name.")
    kind: Literal["ClusterTrainingRuntime", "TrainingRuntime"] = Field(
        "ClusterTrainingRuntime", description="Cluster-wide, or a TrainingRuntime in the SFTJob's namespace."
    )


class SFTJobSpec(CamelModel):
    """A training run: the trainer's `data`, `model` and `training` plus where and how to run it."""

    IMMUTABLE: ClassVar[list[str]] = [
        "data",
        "model",
        "training",
        "resources",
        "image",
        "volumes",
        "backend",
        "runtime",
        "queueName",
        "metricsPort",
        "backoffLimit",
        "cleanPodPolicy",
        "serviceAccountName",
    ]
    model_config = CamelModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.data.path) != has(self.data.packJobRef)",
                    "message": "spec.data needs exactly one of path (a pack folder) or packJobRef (a "
                    "PackJob name)",
                    "fieldPath": ".data",
                },
                {
                    "rule": "!has(self.training) || !has(self.training.metricsPort)",
                    "message": "set spec.metricsPort, not spec.training.metricsPort: the operator sets it",
                    "fieldPath": ".training",
                },
                {
                    "rule": "has(self.data.packJobRef) || has(self.volumes.data)",
                    "message": "spec.volumes.data is required with data.path: name the claim that holds the "
                    "pack",
                    "fieldPath": ".volumes",
                },
                *immutable_rules("SFTJob", IMMUTABLE, required=frozenset({"data", "model", "volumes"})),
            ]
        }
    )

    data: DataSpec
    model: TrainModelSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    resources: SFTResources = Field(default_factory=SFTResources)
    image: str | None = Field(None, description="Default: the operator's trainer image.")
    volumes: SFTVolumes
    backend: Backend = Field(
        "pytorchjob", description="pytorchjob (Kubeflow Training v1) or trainjob (Trainer v2)."
    )
    runtime: Runtime | None = Field(
        None, description="trainjob only; default: ClusterTrainingRuntime torch-distributed."
    )
    suspend: bool = Field(False, description="Suspend the training job (the one mutable field).")
    queue_name: str | None = Field(None, description="Kueue LocalQueue; set as kueue.x-k8s.io/queue-name.")
    metrics_port: int = Field(9400, ge=1024, le=65535, description="Trainer /metrics on port + local rank.")
    backoff_limit: int = Field(0, ge=0, le=100, description="Restarts of the whole job before it fails.")
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        "None", description="Pods kept after the end."
    )
    service_account_name: str | None = Field(
        None, description="Default: the namespace's default (the policy may refuse it)."
    )

    @model_validator(mode="after")
    def _exactly_one_data(self) -> SFTJobSpec:
        if (self.data.path is None) == (self.data.pack_job_ref is None):
            raise ValueError(
                "spec.data needs exactly one of path (a pack folder) or packJobRef (a PackJob name)"
            )
        if self.training.metrics_port is not None:
            raise ValueError("set spec.metricsPort, not spec.training.metricsPort: the operator sets it")
        if self.data.pack_job_ref is None and self.volumes.data is None:
            raise ValueError(
                "spec.volumes.data is required with data.path: name the claim that holds the pack"
            )
        return self

    def train_config(
        self, data_path: str, metrics: bool = True, eval_path: str | None = None
    ) -> dict[str, Any]:
        """What `packtrain train -c` reads: the trainer sections, data (and evaluation data) resolved to
        folders."""
        data = self.data.model_copy(
            update={
                "path": data_path,
                "pack_job_ref": None,
                "eval_path": eval_path or self.data.eval_path,
                "eval_pack_job_ref": None,
            }
        )
        training = self.training.model_copy(update={"metrics_port": self.metrics_port if metrics else None})
        return {"data": data.dump(), "model": self.model.dump(), "training": training.dump()}


class TrainingJobRef(CamelModel):
    """The child PyTorchJob or TrainJob."""

    api_version: str = Field(..., description="kubeflow.org/v1 or trainer.kubeflow.org/v1alpha1.")
    kind: str = Field(..., description="PyTorchJob or TrainJob.")
    name: str = Field(..., description="Its name (the SFTJob's).")


class TrainProgress(CamelModel):
    """Last progress the trainer reported (its metrics while running, its summary at the end)."""

    step: int | None = Field(None, description="Optimizer steps done.")
    max_steps: int | None = Field(None, description="Steps of the whole run, when known up front.")
    loss: float | None = Field(None, description="Loss of the last step.")
    eval_loss: float | None = Field(
        None, description="Token-mean loss over the evaluation set, last evaluated."
    )
    tokens_per_second: float | None = Field(None, description="Token slots processed per second.")
    updated_at: str | None = Field(None, description="When this was read.")
    last_advance_time: str | None = Field(
        None, description="When the step last changed; the training-stall deadline counts from here."
    )


class ScrapeError(CamelModel):
    """Why the operator could not read live progress from the trainer's metrics."""

    message: str = Field(
        ..., description="What failed: no running rank-0 pod, or the endpoint and its error."
    )
    since: str = Field(..., description="Since when scrapes have failed in a row.")


class TrainFailure(CamelModel):
    """A trainer pod that exited non-zero, kept after the training job deleted the pod."""

    pod: str = Field(..., description="The pod's name.")
    exit_code: int = Field(..., description="The trainer's exit code (2: configuration, ≥128: a signal).")
    reason: str = Field(..., description="The kubelet's reason (Error, OOMKilled, …).")
    message: str = Field(..., description="The trainer's termination message: its error, short.")
    time: str = Field(..., description="When the operator saw it.")


class MemoryPlanStatus(CamelModel):
    """The GPU memory plan the operator made before creating the training job."""

    planned: bool = Field(False, description="Whether the operator could plan (it knows the model's sizes).")
    fits: bool | None = Field(None, description="Whether the plan fits resources.gpuMemory.")
    per_gpu_bytes: int | None = Field(None, description="Estimated peak memory of one GPU.")
    per_host_bytes: int | None = Field(None, description="Estimated memory of one node's GPUs together.")
    gpu_memory_bytes: int | None = Field(None, description="Memory of one GPU the plan was checked against.")
    message: str | None = Field(None, description="The plan in words, or why there is none.")


class SFTJobStatus(CamelModel):
    """Written by the operator only."""

    phase: SFTPhase | None = Field(
        None, description="Pending, WaitingForData, Running, Suspended, Succeeded or Failed."
    )
    observed_generation: int | None = Field(None, description="The generation this status was computed for.")
    start_time: str | None = Field(None, description="When the operator first saw the SFTJob.")
    completion_time: str | None = Field(None, description="When it succeeded or failed.")
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Created, Running, Suspended, Succeeded, Failed, Degraded, Ready and DataReady.",
    )
    training_job: TrainingJobRef | None = Field(None, description="The child PyTorchJob or TrainJob.")
    data_path: str | None = Field(None, description="The pack folder the run reads.")
    replica_statuses: dict[str, dict[str, Any]] | None = Field(
        None, description="Mirrored from the child job."
    )
    progress: TrainProgress | None = Field(
        None, description="Live progress while running, the summary at the end."
    )
    scrape_error: ScrapeError | None = Field(
        None,
        description="Set while the trainer's metrics cannot be read (then a stall cannot be told apart).",
    )
    last_failure: TrainFailure | None = Field(None, description="The last trainer pod that exited non-zero.")
    blocked: Blocked | None = Field(None, description="Since when the SFTJob is blocked, and why.")
    memory_plan: MemoryPlanStatus | None = Field(
        None, description="The GPU memory plan made before the training job was created."
    )


class SFTJob(CamelModel):
    """Fine-tunes a vision-language model on a pack, as a Kubeflow PyTorchJob or TrainJob on the GPU pool."""

    KIND: ClassVar[str] = "SFTJob"
    PLURAL: ClassVar[str] = "sftjobs"
    SHORT_NAMES: ClassVar[list[str]] = ["sft"]
    PRINTER_COLUMNS: ClassVar[list[dict[str, str]]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.progress.step", "description": "Steps done"},
        {
            "name": "Max",
            "type": "integer",
            "jsonPath": ".status.progress.maxSteps",
            "description": "Steps in all",
        },
        {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "description": "Last loss"},
        {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
        {"name": "Nodes", "type": "integer", "jsonPath": ".spec.resources.nodes"},
        {
            "name": "GPUs",
            "type": "integer",
            "jsonPath": ".spec.resources.gpusPerNode",
            "description": "GPUs per node",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: SFTJobSpec
    status: SFTJobStatus | None = None
