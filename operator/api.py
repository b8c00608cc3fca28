"""The `packtrain.dev/v1alpha1` API: `PackJob` and `SFTJob`.

These pydantic models are the single source of truth: the operator validates
custom resources with them, and `packtrain crds` turns them into the CRDs in
`crds/` (see `crdgen`). The packer's and trainer's own config models are embedded
as the `source`/`model`/`packing` and `data`/`model`/`training` sections, so the
YAML a user runs locally is the YAML they put in a custom resource.

Storage layout. A PackJob mounts one PersistentVolumeClaim, `output.claimName`,
at `output.mountPath` (default `/data`) in every pod; the pack is written to
`<mountPath>/<subPath or the PackJob's name>`. Source files and the model folder
are read from paths inside the pod: put them on the same claim (e.g.
`/data/datasets/…`, `/data/models/…`) or mount more claims with `volumes`.
An SFTJob that references a PackJob mounts that PackJob's claim read-only at the
same path, so the pack is found where the PackJob wrote it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from packtrain.core.config import CamelModel, ModelConfig, PackingConfig, SourceConfig
from packtrain.trainer.config import DataSpec, TrainingSpec, TrainModelSpec

GROUP = "packtrain.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

PackPhase = Literal["Pending", "Converting", "Planning", "Materializing", "Succeeded", "Failed"]
SFTPhase = Literal["Pending", "WaitingForData", "Running", "Succeeded", "Failed", "Suspended"]
Backend = Literal["pytorchjob", "trainjob"]

_NAME = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Longest custom resource name: "<name>-materialize-<index>" must stay a valid 63-character
# hostname and "<name>-worker-<n>" a valid Service name.
MAX_NAME_LENGTH = 45
NAME_RULE = {
    "rule": f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
    "message": f"metadata.name must be at most {MAX_NAME_LENGTH} characters: it prefixes the names of "
    "the Jobs, pods and Services the operator creates",
}

# A Kubernetes resource quantity (`2`, `500m`, `8Gi`, `1e3`): the grammar of k8s.io/apimachinery's
# resource.Quantity without a sign, so the API server refuses `cpu: "lots"` when the CR is applied
# instead of when the operator creates the pod.
_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^\+?{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?{_DECIMAL}))?$"
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]

# A folder inside a claim: relative and without `..`, so a mount or output path stays inside the claim.
# The same regex is the CEL rule the API server checks and the pydantic check of local runs.
PARENT_SEGMENT = r"(^|/)[.][.](/|$)"
SUB_PATH_MESSAGE = "must be a relative path inside the claim: no leading / and no .. segment"


def _sub_path(value: str) -> str:
    if value.startswith("/") or re.search(PARENT_SEGMENT, value):
        raise ValueError(f"{value!r} {SUB_PATH_MESSAGE}")
    return value


SubPath = Annotated[
    str,
    AfterValidator(_sub_path),
    Field(
        min_length=1,
        max_length=1024,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.startsWith('/') && !self.matches('{PARENT_SEGMENT}')",
                    "message": SUB_PATH_MESSAGE,
                }
            ]
        },
    ),
]


# Where a claim may be mounted: an absolute, normalized path (no `.`/`..` segment, no empty segment,
# no trailing slash) outside the image's own folders. A claim mounted over `/opt/packtrain` (the
# images' venv), `/usr` or `/home` would replace the code an allowed image runs with the CR author's;
# over `/tmp`, `/etc/packtrain` or `/dev` it collides with the operator's own mounts. The same data
# is the pydantic check and the CEL rule the API server runs.
MOUNT_PATH_PATTERN = r"^(/[^/]+)+$"
DOT_SEGMENT = r"(^|/)[.][.]?(/|$)"
RESERVED_MOUNT_ROOTS = (
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/proc",
    "/root", "/run", "/sbin", "/sys", "/tmp", "/usr", "/var",
)  # fmt: skip
MOUNT_PATH_MESSAGE = (
    "must be an absolute path such as /datasets, outside the image's own folders and the operator's "
    f"mounts ({', '.join(RESERVED_MOUNT_ROOTS)} and everything under them): pick another folder"
)


def _mount_path(value: str) -> str:
    reserved = any(value == r or value.startswith(r + "/") for r in RESERVED_MOUNT_ROOTS)
    if reserved or re.search(DOT_SEGMENT, value) or not re.fullmatch(MOUNT_PATH_PATTERN, value):
        raise ValueError(f"{value!r} {MOUNT_PATH_MESSAGE}")
    return value


MountPath = Annotated[
    str,
    Field(
        max_length=256,
        pattern=MOUNT_PATH_PATTERN,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.matches('{DOT_SEGMENT}') && !{list(RESERVED_MOUNT_ROOTS)}"
                    ".exists(r, self == r || self.startsWith(r + '/'))",
                    "message": MOUNT_PATH_MESSAGE,
                }
            ]
        },
    ),
    AfterValidator(_mount_path),
]
# The training pods' own mounts: an SFTJob mounts its PackJob's claim at that PackJob's
# output.mountPath beside these, so an output mounted at one of them would clash there.
SFT_MODEL_MOUNT = "/models"
SFT_CHECKPOINT_MOUNT = "/checkpoints"
SFT_EVAL_MOUNT = "/eval-data"  # the evaluation PackJob's claim, when it is not the training data's
TRAINING_MOUNTS = (SFT_MODEL_MOUNT, SFT_CHECKPOINT_MOUNT)
OUTPUT_MOUNT_MESSAGE = (
    f"spec.output.mountPath may not be {' or '.join(TRAINING_MOUNTS)}: an SFTJob reading this pack mounts "
    "its model and checkpoints there; pick another folder"
)
# Two mounts at one path make the pod invalid (the API server refuses the Job with a 422).
UNIQUE_MOUNTS_MESSAGE = "spec.volumes[].mountPath must differ from each other and from spec.output.mountPath"


def immutable_rules(kind: str, fields: list[str], required: frozenset[str]) -> list[JsonDict]:
    """CEL transition rules that refuse spec changes after creation, one per field so the error names it.

    A half-applied change (new packing for an existing pack, new node count for a
    running PyTorchJob) would leave children that disagree with their parent, so
    the API server rejects the update instead and says what to do. A field that
    may be absent is compared with `has()` first: adding or removing it is a change too.
    """
    rules: list[JsonDict] = []
    for f in fields:
        if f in required:
            rule = f"self.{f} == oldSelf.{f}"
        else:
            rule = f"has(self.{f}) == has(oldSelf.{f}) && (!has(self.{f}) || self.{f} == oldSelf.{f})"
        rules.append(
            {
                "rule": rule,
                "message": f"spec.{f} is immutable: delete the {kind} and create it again to change it",
                "fieldPath": f".{f}",
                "reason": "FieldValueForbidden",
            }
        )
    return rules


# Kubernetes building blocks, typed so the API server validates them (and CEL can compare them).


class ResourceRequirements(CamelModel):
    """Container requests/limits, as in a Pod spec (quantities: `2`, `500m`, `8Gi`)."""

    requests: dict[str, Quantity] | None = Field(
        None, max_length=16, description="What the scheduler reserves."
    )
    limits: dict[str, Quantity] | None = Field(
        None, max_length=16, description="What the container may use at most."
    )


class Toleration(CamelModel):
    """A Pod toleration (see the Kubernetes Pod API)."""

    key: str | None = Field(None, description="The taint key tolerated; empty with Exists: every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        None, description="Exists, or Equal (the default) to value."
    )
    value: str | None = Field(None, description="The taint value, with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect tolerated; empty: all."
    )
    toleration_seconds: int | None = Field(
        None, description="With NoExecute: how long the pod stays once tainted."
    )


class Scheduling(CamelModel):
    """Where pods go, and what they carry. Unset fields take the operator's pool defaults (the chart's values)."""  # noqa: E501 (the CRD's description)

    pod_annotations: dict[str, str] | None = Field(
        None, description="Added to every pod (e.g. cluster-autoscaler or service-mesh opt-outs)."
    )

    node_selector: dict[str, str] | None = Field(
        None, description="Default: the operator's pool selector (packtrain.dev/pool: cpu or gpu)."
    )
    tolerations: list[Toleration] | None = Field(
        None, description="Default: the operator's pool tolerations."
    )
    affinity: dict[str, Any] | None = Field(None, description="A Pod affinity, passed through unchanged.")


RESERVED_VOLUMES = ("output", "config", "tmp")


class ClaimMount(CamelModel):
    """An extra PersistentVolumeClaim mounted into every pod of the job."""

    model_config = CamelModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!(self.name in {list(RESERVED_VOLUMES)})",
                    "message": f"volume names {', '.join(RESERVED_VOLUMES)} are the operator's own: pick "
                    "another",
                    "fieldPath": ".name",
                }
            ]
        }
    )

    name: str = Field(..., pattern=_NAME, max_length=50, description="Volume name in the pod.")
    claim_name: str = Field(..., min_length=1, description="The PersistentVolumeClaim.")
    mount_path: MountPath = Field(..., description="Where it is mounted in the pods.")
    sub_path: SubPath | None = Field(None, description="Mount only this folder of the claim.")
    read_only: bool = Field(True, description="Mounted read-only (the default).")

    @model_validator(mode="after")
    def _not_reserved(self) -> ClaimMount:
        if self.name in RESERVED_VOLUMES:
            raise ValueError(
                f"volume names {', '.join(RESERVED_VOLUMES)} are the operator's own: pick another"
            )
        return self


# PackJob


class PackOutput(CamelModel):
    """Where the pack goes: a claim mounted at `mountPath`, the pack under `subPath`."""

    model_config = CamelModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!(self.mountPath in {list(TRAINING_MOUNTS)})",
                    "message": OUTPUT_MOUNT_MESSAGE,
                    "fieldPath": ".mountPath",
                }
            ]
        }
    )

    claim_name: str = Field(
        ..., min_length=1, description="PersistentVolumeClaim (ReadWriteMany for >1 worker)."
    )
    sub_path: SubPath | None = Field(
        None, description="Folder inside the claim; default: the PackJob's name."
    )
    mount_path: MountPath = Field("/data", description="Where the claim is mounted in the pods.")

    @model_validator(mode="after")
    def _not_a_training_mount(self) -> PackOutput:
        if self.mount_path in TRAINING_MOUNTS:
            raise ValueError(OUTPUT_MOUNT_MESSAGE)
        return self


class PackWorkers(Scheduling):
    """The CPU pods of the convert and materialize stages (plan runs as one pod with the same settings)."""

    count: int = Field(
        1, ge=1, le=1000, description="Parallel pods per stage: one index of an Indexed Job each."
    )
    resources: ResourceRequirements | None = None
    image: str | None = Field(None, description="Default: the operator's packer image.")
    service_account_name: str | None = Field(
        None, description="Default: the namespace's default (the policy may refuse it)."
    )
    backoff_limit_per_index: int = Field(1, ge=0, le=100, description="Retries of a failed index.")


class PackJobSpec(CamelModel):
    """A pack: the packer's `source`, `model` and `packing` plus where and how to run it."""

    model_config = CamelModel.model_config | ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.volumes) || self.volumes.all(v, v.mountPath != self.output.mountPath"
                    " && self.volumes.exists_one(w, w.mountPath == v.mountPath))",
                    "message": UNIQUE_MOUNTS_MESSAGE,
                    "fieldPath": ".volumes",
                },
                *immutable_rules(
                    "PackJob",
                    ["source", "model", "packing", "output", "workers", "volumes", "queueName"],
                    required=frozenset({"source", "model", "output"}),
                ),
            ]
        }
    )

    source: SourceConfig
    model: ModelConfig
    packing: PackingConfig = Field(default_factory=PackingConfig)
    output: PackOutput
    workers: PackWorkers = Field(default_factory=PackWorkers)
    volumes: list[ClaimMount] = Field(
        default_factory=list, max_length=16, description="More claims mounted into every stage pod."
    )
    queue_name: str | None = Field(
        None,
        description="Kueue LocalQueue: the stage Jobs carry kueue.x-k8s.io/queue-name and are created "
        "suspended, each started when the queue admits it.",
    )

    @model_validator(mode="after")
    def _unique_mounts(self) -> PackJobSpec:
        paths = [self.output.mount_path, *(v.mount_path for v in self.volumes)]
        if len(set(paths)) != len(paths):
            raise ValueError(UNIQUE_MOUNTS_MESSAGE)
        return self

    def pack_config(self) -> dict[str, Any]:
        """The part the packer reads (what `packtrain pack … -c` validates)."""
        return {"source": self.source.dump(), "model": self.model.dump(), "packing": self.packing.dump()}


class Condition(CamelModel):
    """metav1.Condition."""

    type: str = Field(
        ..., description="Created, Running, Suspended, Succeeded, Failed, Degraded, Ready, DataReady."
    )
    status: Literal["True", "False", "Unknown"] = Field(..., description="Whether the condition holds.")
    reason: str = Field(
        ..., pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", description="Why, as one CamelCase word."
    )
    message: str = Field("", description="Why, for a person: what happened and what to do.")
    last_transition_time: str = Field(..., description="When the status last flipped.")
    observed_generation: int | None = Field(None, description="The generation it was set for.")


class Blocked(CamelModel):
    """A wait the operator bounds with a deadline."""

    reason: str = Field(..., description="What the job waits on (PackJobNotFound, Unschedulable, …).")
    since: str = Field(..., description="Since when, for this reason.")


class PackStats(CamelModel):
    """What the packer reported (termination messages of its pods)."""

    samples_in: int | None = Field(None, description="Input records read by convert.")
    samples_packed: int | None = Field(None, description="Samples placed in a packed sequence.")
    samples_rejected: int | None = Field(
        None, description="Samples rejected (see rejects.jsonl in the pack)."
    )
    rejected_by_reason: dict[str, int] | None = Field(None, description="Rejected samples per reason.")
    tokens: int | None = Field(None, description="Tokens of the packed samples.")
    sequences: int | None = Field(None, description="Packed sequences.")
    shards: int | None = Field(None, description="Shard files of the pack.")
    fill_ratio: float | None = Field(None, description="Real tokens / (sequences x maxLength).")
    padding_saved: float | None = Field(None, description="Padding avoided vs one sample per row.")


class PackJobStatus(CamelModel):
    """Written by the operator only."""

    phase: PackPhase | None = Field(
        None, description="Pending, a stage (Converting, Planning, Materializing), Succeeded or Failed."
    )
    stage: str | None = Field(None, description="Human-readable progress, e.g. `convert 3/4`.")
    percent_done: int | None = Field(None, description="Share of all stage indexes finished, in percent.")
    observed_generation: int | None = Field(None, description="The generation this status was computed for.")
    start_time: str | None = Field(None, description="When the operator first saw the PackJob.")
    completion_time: str | None = Field(None, description="When it succeeded or failed.")
    last_progress_time: str | None = Field(
        None, description="When the stage or its share done last moved (the stall deadline counts from it)."
    )
    blocked: Blocked | None = Field(None, description="Since when the PackJob is blocked, and why.")
    stage_seconds: dict[str, float] | None = Field(
        None, description="Finished stages and how long each ran (kept after their Jobs are deleted)."
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Created, Running, Suspended, Succeeded, Failed, Degraded and Ready.",
    )
    stats: PackStats | None = Field(None, description="Counts the packer reported.")
    output_path: str | None = Field(None, description="The pack folder inside the output claim's mount.")
    claim_name: str | None = Field(None, description="The PersistentVolumeClaim holding the pack.")
    sub_path: str | None = Field(None, description="The pack folder inside that claim.")
    manifest_digest: str | None = Field(None, description="sha256 of the pack's manifest.json.")
    model_sizes: dict[str, Any] | None = Field(
        None,
        description="model.path's config.json keys the memory planner reads (sizes of the model's layers); "
        "an SFTJob on this pack with the same model.path plans its GPU memory from them.",
    )


class PackJob(CamelModel):
    """Packs a vision-language dataset into fixed-length sequences on the CPU pool (convert, plan, materialize)."""  # noqa: E501 (the CRD's description)

    KIND: ClassVar[str] = "PackJob"
    PLURAL: ClassVar[str] = "packjobs"
    SHORT_NAMES: ClassVar[list[str]] = ["pj"]
    PRINTER_COLUMNS: ClassVar[list[dict[str, str]]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Stage", "type": "string", "jsonPath": ".status.stage"},
        {
            "name": "Done%",
            "type": "integer",
            "jsonPath": ".status.percentDone",
            "description": "Share of the stage work finished",
        },
        {
            "name": "Samples",
            "type": "integer",
            "jsonPath": ".status.stats.samplesPacked",
            "description": "Samples packed",
        },
        {
            "name": "Rejected",
            "type": "integer",
            "jsonPath": ".status.stats.samplesRejected",
            "description": "Samples rejected",
        },
        {
            "name": "Fill",
            "type": "number",
            "jsonPath": ".status.stats.fillRatio",
            "description": "Fill ratio of the packed sequences",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]

    spec: PackJobSpec
    status: PackJobStatus | None = None


# SFTJob


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


KINDS: tuple[type[PackJob] | type[SFTJob], ...] = (PackJob, SFTJob)
