"""What both kinds share: the API group, names, quantities, paths inside claims and mount paths,
the Kubernetes building blocks (resources, scheduling, extra claims) and the status bits (conditions,
blocked waits). The kinds themselves are `packjob.py` and `sftjob.py`; `packtrain.operator.api`
is the public surface of all three."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, model_validator
from pydantic.config import JsonDict

from packtrain.core.config import CamelModel

GROUP = "packtrain.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

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


# Status bits both kinds report


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
