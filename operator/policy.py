"""The cluster admin's policy: what a PackJob or SFTJob may put into the pods the operator creates.

A custom resource is written by whoever may create one in a namespace; the chart's
values belong to the admin. Every CR field that reaches a pod and could widen what
that pod can do (its image, ServiceAccount, placement, annotations, size) is checked
here against the chart's `policy` values before any child exists. The chart ships
the same rules as a ValidatingAdmissionPolicy
(`charts/packtrain/templates/admission-policy.yaml`), so `kubectl apply` is refused
up front with the same message; this module is the operator's own check, and what
`packtrain render` applies.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import Field

from packtrain.core.config import CamelModel
from packtrain.operator.api import QUANTITY_PATTERN, PackJobSpec, Runtime, SFTJobSpec

GPU_RESOURCE = "nvidia.com/gpu"
VALUES_PREFIX = "policy"
# What a packer pod may request besides the GPU resources of the policy (a `hugepages-` prefix is any size).
# Any other extended resource is refused: a ceiling can count only what it knows to be a GPU.
PACKER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PREFIX = "hugepages-"


def runtime_ref(kind: str, name: str) -> str:
    """How `policy.allowedRuntimes` names a Trainer v2 runtime: `Kind/name`."""
    return f"{kind}/{name}"


DEFAULT_RUNTIME = runtime_ref(Runtime().kind, Runtime().name)


class Policy(CamelModel):
    """The chart's `policy` values (passed to the operator as JSON in `PACKTRAIN_POLICY`)."""

    allowed_images: list[str] = Field(
        default_factory=list,
        description="Image patterns a CR may name (`*`: any characters, `?`: one); the chart's own "
        "packer and trainer images are always allowed.",
    )
    allowed_service_accounts: list[str] = Field(
        default_factory=list, description="ServiceAccount names a CR may name; default: none."
    )
    allowed_runtimes: list[str] = Field(
        default_factory=lambda: [DEFAULT_RUNTIME],
        description="Trainer v2 runtimes (`Kind/name`) a `trainjob` SFTJob may run against; a namespaced "
        "TrainingRuntime is written by the CR author's team, so none is allowed unless listed.",
    )
    gpu_resources: list[str] = Field(
        default_factory=lambda: [GPU_RESOURCE, "amd.com/gpu", "gpu.intel.com/i915", "gpu.intel.com/xe"],
        description="Extended resources that are GPUs: a packer pod's are summed against the GPU ceilings; "
        "a packer pod may request no other extended resource.",
    )
    allow_tolerations: bool = Field(False, description="CRs may set tolerations.")
    allow_node_selector: bool = Field(False, description="CRs may set a nodeSelector.")
    allow_affinity: bool = Field(False, description="CRs may set an affinity.")
    allowed_pod_annotation_prefixes: list[str] = Field(
        default_factory=list, description="Pod annotation keys a CR may set must start with one of these."
    )
    max_pack_workers: int = Field(32, ge=1, description="Most workers (pods per stage) of a PackJob.")
    max_training_nodes: int = Field(8, ge=1, description="Most nodes (pods) of an SFTJob.")
    max_gpus_per_node: int = Field(8, ge=0, description="Most GPUs one pod may request.")
    max_gpus_per_job: int = Field(64, ge=0, description="Most GPUs all pods of one job may request.")
    gpu_memory: str = Field(
        "80Gi",
        pattern=QUANTITY_PATTERN,
        max_length=64,
        description="Memory of one GPU of the GPU pool (80Gi: H100; 141Gi: H200), what an SFTJob's memory "
        "plan is checked against unless its resources.gpuMemory says otherwise. The default is the "
        "smaller common size, so a plan that fits it fits either.",
    )
    admission_policy: bool = Field(
        True, description="The chart ships a ValidatingAdmissionPolicy (the operator checks regardless)."
    )


@dataclass(frozen=True)
class Violation:
    """One refused field: where it is, the chart value that would allow it, and what to do."""

    field: str
    key: str
    message: str

    def __str__(self) -> str:
        return self.message


def image_pattern(pattern: str) -> re.Pattern[str]:
    """`*` any run of characters (`/` and `:` included), `?` one character, everything else literal.

    The admission policy's template translates the same way (quote, then `\\*` → `.*`,
    `\\?` → `.`), so both enforcements agree on every pattern.
    """
    parts = (".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.compile("".join(parts))


def image_allowed(image: str, policy: Policy, own_images: Iterable[str]) -> bool:
    return image in set(own_images) or any(image_pattern(p).fullmatch(image) for p in policy.allowed_images)


_SUFFIXES = {
    "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


def quantity(value: int | str) -> float:
    """A Kubernetes quantity as a number (`2`, `"2"`, `"500m"`); ValueError when it is none."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    return float(match.group(1)) * _SUFFIXES.get(match.group(2) or "", 1.0)


def _key(name: str) -> str:
    return f"{VALUES_PREFIX}.{Policy.model_fields[name].alias or name}"


def _image(field: str, image: str | None, policy: Policy, own: Iterable[str]) -> list[Violation]:
    if image is None or image_allowed(image, policy, own):
        return []
    key = _key("allowed_images")
    return [
        Violation(
            field,
            key,
            f'{field} "{image}" is not an allowed image: add a matching pattern to '
            f"the chart value {key}, or leave {field} unset for the chart's image",
        )
    ]


def _account(field: str, account: str | None, policy: Policy) -> list[Violation]:
    if account is None or account in policy.allowed_service_accounts:
        return []
    key = _key("allowed_service_accounts")
    return [
        Violation(
            field,
            key,
            f'{field} "{account}" is not an allowed ServiceAccount: add it to the '
            f"chart value {key}, or leave {field} unset",
        )
    ]


def _placement(path: str, pod: Any, policy: Policy) -> list[Violation]:
    out = []
    for attr, name, allow in (
        ("tolerations", "tolerations", "allow_tolerations"),
        ("node_selector", "nodeSelector", "allow_node_selector"),
        ("affinity", "affinity", "allow_affinity"),
    ):
        if getattr(pod, attr) is not None and not getattr(policy, allow):
            field, key = f"{path}.{name}", _key(allow)
            out.append(
                Violation(
                    field,
                    key,
                    f"{field} may not be set while the chart value {key} is false: "
                    "leave it unset to use the chart's pools",
                )
            )
    return out


def _annotations(path: str, annotations: Mapping[str, str] | None, policy: Policy) -> list[Violation]:
    prefixes = policy.allowed_pod_annotation_prefixes
    bad = sorted(k for k in annotations or {} if not any(k.startswith(p) for p in prefixes))
    if not bad:
        return []
    field, key = f"{path}.podAnnotations", _key("allowed_pod_annotation_prefixes")
    return [
        Violation(
            field,
            key,
            f"{field} has keys no prefix in the chart value {key} allows: "
            f"{', '.join(bad)}; remove them, or add their prefix to {key}",
        )
    ]


def _ceiling(field: str, value: float, name: str, policy: Policy, unit: str = "") -> list[Violation]:
    limit = getattr(policy, name)
    if value <= limit:
        return []
    key = _key(name)
    return [
        Violation(
            field,
            key,
            f"{field} is {int(value)}{unit}, above the chart value {key} ({limit}): "
            f"lower it, or have the cluster admin raise {key}",
        )
    ]


def _runtime(spec: SFTJobSpec, policy: Policy) -> list[Violation]:
    if spec.backend != "trainjob":
        return []
    runtime = spec.runtime or Runtime()
    ref = runtime_ref(runtime.kind, runtime.name)
    if ref in policy.allowed_runtimes:
        return []
    field, key = "spec.runtime", _key("allowed_runtimes")
    return [
        Violation(
            field,
            key,
            f'{field} "{ref}" is not an allowed training runtime: add "{ref}" to the '
            f"chart value {key}, or pick a runtime it lists",
        )
    ]


def _pack_resources(path: str, spec: PackJobSpec, policy: Policy) -> list[Violation]:
    res = spec.workers.resources
    names = {*(res.requests or {}), *(res.limits or {})} if res is not None else set()
    bad = sorted(
        n
        for n in names
        if n not in PACKER_RESOURCES and n not in policy.gpu_resources and not n.startswith(HUGEPAGES_PREFIX)
    )
    if not bad:
        return []
    field, key = f"{path}.resources", _key("gpu_resources")
    return [
        Violation(
            field,
            key,
            f"{field} names resources a packer pod may not request: {', '.join(bad)}; "
            f"use {', '.join(PACKER_RESOURCES)} or {HUGEPAGES_PREFIX}*, or, for a GPU, "
            f"have the cluster admin add it to {key}",
        )
    ]


def _pack_gpus(spec: PackJobSpec, policy: Policy) -> float:
    """GPUs per packer pod: over the GPU resources, the sum of each one's larger of request and limit
    (a quantity no parser accepts counts as many)."""
    res = spec.workers.resources
    if res is None:
        return 0.0
    try:
        return sum(
            max(quantity(q.get(name, 0)) for q in (res.requests or {}, res.limits or {}))
            for name in policy.gpu_resources
        )
    except ValueError:
        return float(2**62)


class Settings(Protocol):
    """What the check reads of the operator's settings (`settings.OperatorDefaults`), so this module
    needs nothing of the settings, which import the `Policy` model from here."""

    @property
    def policy(self) -> Policy: ...
    @property
    def packer_image(self) -> str: ...
    @property
    def trainer_image(self) -> str: ...


def check(spec: PackJobSpec | SFTJobSpec, defaults: Settings) -> list[Violation]:
    """Every way `spec` exceeds the policy in `defaults.policy` (empty: the operator may create its
    children)."""
    policy = defaults.policy
    own = (defaults.packer_image, defaults.trainer_image)
    if isinstance(spec, PackJobSpec):
        w, path = spec.workers, "spec.workers"
        gpus = _pack_gpus(spec, policy)
        return [
            *_image(f"{path}.image", w.image, policy, own),
            *_account(f"{path}.serviceAccountName", w.service_account_name, policy),
            *_placement(path, w, policy),
            *_annotations(path, w.pod_annotations, policy),
            *_ceiling(f"{path}.count", w.count, "max_pack_workers", policy),
            *_pack_resources(path, spec, policy),
            *_ceiling(f"{path}.resources", gpus, "max_gpus_per_node", policy, " GPUs per pod"),
            *_ceiling(path, gpus * w.count, "max_gpus_per_job", policy, " GPUs in all"),
        ]
    r, path = spec.resources, "spec.resources"
    return [
        *_image("spec.image", spec.image, policy, own),
        *_account("spec.serviceAccountName", spec.service_account_name, policy),
        *_runtime(spec, policy),
        *_placement(path, r, policy),
        *_annotations(path, r.pod_annotations, policy),
        *_ceiling(f"{path}.nodes", r.nodes, "max_training_nodes", policy),
        *_ceiling(f"{path}.gpusPerNode", r.gpus_per_node, "max_gpus_per_node", policy),
        *_ceiling(path, r.gpus_per_node * r.nodes, "max_gpus_per_job", policy, " GPUs in all"),
    ]


def summary(kind: str, violations: list[Violation]) -> str:
    """One status/Event message for all violations."""
    return f"{kind} refused by the cluster policy: " + "; ".join(v.message for v in violations)
