"""The `packtrain.dev/v1alpha1` API: `PackJob` and `SFTJob`, one module per kind (`packjob.py`,
`sftjob.py`) over what both share (`common.py`); this package is their public surface.

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

from packtrain.operator.api.common import (
    API_VERSION,
    DOT_SEGMENT,
    GROUP,
    MAX_NAME_LENGTH,
    MOUNT_PATH_MESSAGE,
    MOUNT_PATH_PATTERN,
    NAME_RULE,
    PARENT_SEGMENT,
    QUANTITY_PATTERN,
    RESERVED_MOUNT_ROOTS,
    RESERVED_VOLUMES,
    SFT_CHECKPOINT_MOUNT,
    SFT_EVAL_MOUNT,
    SFT_MODEL_MOUNT,
    SUB_PATH_MESSAGE,
    TRAINING_MOUNTS,
    VERSION,
    Blocked,
    ClaimMount,
    Condition,
    MountPath,
    Quantity,
    ResourceRequirements,
    Scheduling,
    SubPath,
    Toleration,
    immutable_rules,
)
from packtrain.operator.api.packjob import (
    OUTPUT_MOUNT_MESSAGE,
    UNIQUE_MOUNTS_MESSAGE,
    PackJob,
    PackJobSpec,
    PackJobStatus,
    PackOutput,
    PackPhase,
    PackStats,
    PackWorkers,
)
from packtrain.operator.api.sftjob import (
    Backend,
    MemoryPlanStatus,
    Runtime,
    ScrapeError,
    SFTJob,
    SFTJobSpec,
    SFTJobStatus,
    SFTPhase,
    SFTResources,
    SFTVolumes,
    TrainFailure,
    TrainingJobRef,
    TrainProgress,
    VolumeClaim,
)

__all__ = [
    "API_VERSION",
    "Backend",
    "Blocked",
    "ClaimMount",
    "Condition",
    "DOT_SEGMENT",
    "GROUP",
    "KINDS",
    "MAX_NAME_LENGTH",
    "MOUNT_PATH_MESSAGE",
    "MOUNT_PATH_PATTERN",
    "MemoryPlanStatus",
    "MountPath",
    "NAME_RULE",
    "OUTPUT_MOUNT_MESSAGE",
    "PARENT_SEGMENT",
    "PackJob",
    "PackJobSpec",
    "PackJobStatus",
    "PackOutput",
    "PackPhase",
    "PackStats",
    "PackWorkers",
    "QUANTITY_PATTERN",
    "Quantity",
    "RESERVED_MOUNT_ROOTS",
    "RESERVED_VOLUMES",
    "ResourceRequirements",
    "Runtime",
    "SFTJob",
    "SFTJobSpec",
    "SFTJobStatus",
    "SFTPhase",
    "SFTResources",
    "SFTVolumes",
    "SFT_CHECKPOINT_MOUNT",
    "SFT_EVAL_MOUNT",
    "SFT_MODEL_MOUNT",
    "SUB_PATH_MESSAGE",
    "Scheduling",
    "ScrapeError",
    "SubPath",
    "TRAINING_MOUNTS",
    "Toleration",
    "TrainFailure",
    "TrainProgress",
    "TrainingJobRef",
    "UNIQUE_MOUNTS_MESSAGE",
    "VERSION",
    "VolumeClaim",
    "immutable_rules",
]

KINDS: tuple[type[PackJob] | type[SFTJob], ...] = (PackJob, SFTJob)
