"""The `PackJob` kind: its spec (the packer's sections, output, workers), its status, its CRD columns."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from packtrain.core.config import CamelModel, ModelConfig, PackingConfig, SourceConfig
from packtrain.operator.api.common import (
    TRAINING_MOUNTS,
    Blocked,
    ClaimMount,
    Condition,
    MountPath,
    ResourceRequirements,
    Scheduling,
    SubPath,
    immutable_rules,
)

PackPhase = Literal["Pending", "Converting", "Planning", "Materializing", "Succeeded", "Failed"]

OUTPUT_MOUNT_MESSAGE = (
    f"spec.output.mountPath may not be {' or '.join(TRAINING_MOUNTS)}: an SFTJob reading this pack mounts "
    "its model and checkpoints there; pick another folder"
)
# Two mounts at one path make the pod invalid (the API server refuses the Job with a 422).
UNIQUE_MOUNTS_MESSAGE = "spec.volumes[].mountPath must differ from each other and from spec.output.mountPath"


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
