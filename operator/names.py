"""Label keys and container names, spelled once: the builders write them, the watches, the view and
the status mapping select and read by them, so a rename cannot leave one side behind."""

from __future__ import annotations

from typing import Final

# Ours: every child and pod carries its parent's name under one of these.
PACKJOB_LABEL: Final = "packtrain.dev/packjob"
SFTJOB_LABEL: Final = "packtrain.dev/sftjob"
STAGE_LABEL: Final = "packtrain.dev/stage"
# The operator's default node pools select on this label (`packtrain.dev/pool: cpu|gpu`).
POOL_LABEL: Final = "packtrain.dev/pool"

# Kubernetes' and Kueue's: the Job controller sets the first two, Kueue reads the queue.
JOB_NAME_LABEL: Final = "batch.kubernetes.io/job-name"
COMPLETION_INDEX: Final = "batch.kubernetes.io/job-completion-index"
QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
# Kubeflow's: the training-operator's replica type, JobSet's job index (rank 0 lives on index 0 of both).
REPLICA_TYPE_LABEL: Final = "training.kubeflow.org/replica-type"
JOBSET_INDEX_LABEL: Final = "jobset.sigs.k8s.io/job-index"

# Containers: the packer's, and the trainer's under each training backend.
PACK_CONTAINER: Final = "packer"
TRAIN_CONTAINER: Final = "pytorch"  # the name the Kubeflow training-operator requires
TRAINJOB_CONTAINER: Final = "node"  # the trainer container of the torch-distributed runtime
TRAINJOB_TARGET: Final = "node"  # its replicated job
