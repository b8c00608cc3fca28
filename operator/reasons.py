"""Every condition reason the operator writes, in one enum.

Conditions, Events, the Argo CD health checks and users' `kubectl wait` all read these words, so
each is spelled once. The two a packer pod reports itself (its error report's `reason`) come from
the pods' contract; a pod may report another CamelCase word, which the operator passes through.
"""

from __future__ import annotations

from enum import StrEnum

from packtrain.core.contract import NO_SAMPLES, TOO_MANY_REJECTED, PackStage


class ConditionReason(StrEnum):
    # Lifecycle conditions while nothing is wrong.
    NOT_CREATED = "NotCreated"
    NOT_SUSPENDED = "NotSuspended"
    NOT_FINISHED = "NotFinished"
    FAILED = "Failed"  # the Succeeded condition of a failed job
    NO_FAILURE = "NoFailure"
    AS_EXPECTED = "AsExpected"
    # PackJob stages.
    STAGE_JOB_CREATED = "StageJobCreated"
    CONVERTING = "Converting"
    PLANNING = "Planning"
    MATERIALIZING = "Materializing"
    PACK_READY = "PackReady"
    CONVERT_FAILED = "ConvertFailed"
    PLAN_FAILED = "PlanFailed"
    MATERIALIZE_FAILED = "MaterializeFailed"
    STAGE_STALLED = "StageStalled"
    INVALID_CONFIGURATION = "InvalidConfiguration"
    # Reported by the packer pods (the pods' contract defines the words).
    NO_SAMPLES = NO_SAMPLES
    TOO_MANY_REJECTED = TOO_MANY_REJECTED
    # Either kind: blocked, refused, invalid.
    QUEUED = "Queued"
    UNSCHEDULABLE = "Unschedulable"
    CHILD_REFUSED = "ChildRefused"
    INVALID_SPEC = "InvalidSpec"
    POLICY_VIOLATION = "PolicyViolation"
    PREVIOUS_OBJECT_BEING_DELETED = "PreviousObjectBeingDeleted"  # a predecessor's child still there
    NAME_CONFLICT = "NameConflict"  # someone else's object holds a child's name
    # SFTJob data.
    PACKJOB_NOT_FOUND = "PackJobNotFound"
    PACKJOB_NOT_READY = "PackJobNotReady"
    PACKJOB_SUCCEEDED = "PackJobSucceeded"
    PACKJOB_FAILED = "PackJobFailed"
    PACKJOB_DELETED = "PackJobDeleted"
    DATA_AVAILABLE = "DataAvailable"
    # SFTJob memory plan (before the training job exists).
    INSUFFICIENT_GPU_MEMORY = "InsufficientGPUMemory"
    MEMORY_PLANNED = "MemoryPlanned"
    MEMORY_NOT_PLANNED = "MemoryNotPlanned"
    # SFTJob training (the training job's own reasons pass through when it gives one).
    TRAINER_FAILED = "TrainerFailed"
    TRAINING_STALLED = "TrainingStalled"
    NO_LIVE_PROGRESS = "NoLiveProgress"
    PYTORCHJOB_CREATED = "PyTorchJobCreated"
    PYTORCHJOB_RUNNING = "PyTorchJobRunning"
    PYTORCHJOB_SUSPENDED = "PyTorchJobSuspended"
    PYTORCHJOB_SUCCEEDED = "PyTorchJobSucceeded"
    PYTORCHJOB_FAILED = "PyTorchJobFailed"
    TRAINJOB_CREATED = "TrainJobCreated"
    TRAINJOB_RUNNING = "TrainJobRunning"
    TRAINJOB_SUSPENDED = "TrainJobSuspended"
    TRAINJOB_SUCCEEDED = "TrainJobSucceeded"
    TRAINJOB_FAILED = "TrainJobFailed"

    @classmethod
    def stage_failed(cls, stage: PackStage) -> ConditionReason:
        """`ConvertFailed`, `PlanFailed`, `MaterializeFailed`."""
        return cls(f"{stage.capitalize()}Failed")

    @classmethod
    def of_child(cls, kind: str, what: str) -> ConditionReason:
        """A training job's reason when it gives none: `PyTorchJobRunning`, `TrainJobCreated`, ..."""
        return cls(f"{kind}{what}")
