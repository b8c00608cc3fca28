"""The Kubeflow training jobs an SFTJob may create, one record per kind.

Group, version, plural, the backend that selects it, its trainer container and the kopf index
holding it: the builders, the watches and indexes, the view, RBAC and the stall delete all read
them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from packtrain.operator.names import TRAIN_CONTAINER, TRAINJOB_CONTAINER


@dataclass(frozen=True)
class ChildKind:
    """A training-job kind: where its API is, and what the operator calls it."""

    kind: str
    group: str
    version: str
    plural: str
    backend: str  # the SFTJob's `spec.backend` value that selects it
    container: str  # the trainer container in its pods
    index: str  # the kopf index (a function in `handlers`) holding these objects

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


PYTORCHJOB = ChildKind(
    "PyTorchJob", "kubeflow.org", "v1", "pytorchjobs", "pytorchjob", TRAIN_CONTAINER, "pytorchjob_index"
)
TRAINJOB = ChildKind(
    "TrainJob",
    "trainer.kubeflow.org",
    "v1alpha1",
    "trainjobs",
    "trainjob",
    TRAINJOB_CONTAINER,
    "trainjob_index",
)
CHILD_KINDS: tuple[ChildKind, ...] = (PYTORCHJOB, TRAINJOB)
BY_BACKEND: dict[str, ChildKind] = {c.backend: c for c in CHILD_KINDS}
BY_KIND: dict[str, ChildKind] = {c.kind: c for c in CHILD_KINDS}
