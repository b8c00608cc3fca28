"""Specs a CR author could use to get a pod the cluster admin did not allow, shared by the operator's
policy tests (tests/operator/test_policy.py) and the admission policy's (test_admission_policy.py),
so both enforcements are held to the same cases and the same messages."""

from __future__ import annotations

import copy
from typing import Any

GROUP_VERSION = "packtrain.dev/v1alpha1"
PACKJOB: dict[str, Any] = {
    "apiVersion": GROUP_VERSION,
    "kind": "PackJob",
    "metadata": {"name": "demo"},
    "spec": {
        "source": {"paths": ["/data/datasets/demo.jsonl"]},
        "model": {"path": "/data/models/qwen2-vl"},
        "output": {"claimName": "packtrain-data"},
        "workers": {"count": 4},
    },
}
SFTJOB: dict[str, Any] = {
    "apiVersion": GROUP_VERSION,
    "kind": "SFTJob",
    "metadata": {"name": "demo"},
    "spec": {
        "data": {"path": "/data/packs/demo"},
        "model": {"path": "/data/models/qwen2-vl"},
        "resources": {"nodes": 1, "gpusPerNode": 1},
        "volumes": {"data": {"claimName": "packtrain-data"}, "checkpoints": {"claimName": "ckpt"}},
    },
}

# (name, kind, spec patch, the field refused, the values key that would allow it, values that allow it)
HOSTILE: list[tuple[str, str, dict[str, Any], str, str, dict[str, Any]]] = [
    (
        "pack-image",
        "PackJob",
        {"workers": {"image": "evil.example.com/miner:1"}},
        "spec.workers.image",
        "policy.allowedImages",
        {"allowedImages": ["evil.example.com/*"]},
    ),
    (
        "sft-image",
        "SFTJob",
        {"image": "evil.example.com/miner:1"},
        "spec.image",
        "policy.allowedImages",
        {"allowedImages": ["evil.example.com/miner:?"]},
    ),
    (
        "pack-account",
        "PackJob",
        {"workers": {"serviceAccountName": "admin"}},
        "spec.workers.serviceAccountName",
        "policy.allowedServiceAccounts",
        {"allowedServiceAccounts": ["admin"]},
    ),
    (
        "sft-account",
        "SFTJob",
        {"serviceAccountName": "admin"},
        "spec.serviceAccountName",
        "policy.allowedServiceAccounts",
        {"allowedServiceAccounts": ["admin"]},
    ),
    (
        "pack-tolerations",
        "PackJob",
        {"workers": {"tolerations": [{"operator": "Exists"}]}},
        "spec.workers.tolerations",
        "policy.allowTolerations",
        {"allowTolerations": True},
    ),
    (
        "sft-tolerations",
        "SFTJob",
        {"resources": {"tolerations": [{"operator": "Exists"}]}},
        "spec.resources.tolerations",
        "policy.allowTolerations",
        {"allowTolerations": True},
    ),
    (
        "pack-node-selector",
        "PackJob",
        {"workers": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}},
        "spec.workers.nodeSelector",
        "policy.allowNodeSelector",
        {"allowNodeSelector": True},
    ),
    (
        "sft-affinity",
        "SFTJob",
        {"resources": {"affinity": {"nodeAffinity": {}}}},
        "spec.resources.affinity",
        "policy.allowAffinity",
        {"allowAffinity": True},
    ),
    (
        "pack-annotations",
        "PackJob",
        {
            "workers": {
                "podAnnotations": {"container.apparmor.security.beta.kubernetes.io/packer": "unconfined"}
            }
        },
        "spec.workers.podAnnotations",
        "policy.allowedPodAnnotationPrefixes",
        {"allowedPodAnnotationPrefixes": ["container.apparmor.security.beta.kubernetes.io/"]},
    ),
    (
        "pack-workers",
        "PackJob",
        {"workers": {"count": 33}},
        "spec.workers.count",
        "policy.maxPackWorkers",
        {"maxPackWorkers": 33},
    ),
    (
        "sft-nodes",
        "SFTJob",
        {"resources": {"nodes": 9, "gpusPerNode": 1}},
        "spec.resources.nodes",
        "policy.maxTrainingNodes",
        {"maxTrainingNodes": 9},
    ),
    (
        "sft-gpus-per-node",
        "SFTJob",
        {"resources": {"nodes": 1, "gpusPerNode": 16}},
        "spec.resources.gpusPerNode",
        "policy.maxGpusPerNode",
        {"maxGpusPerNode": 16},
    ),
    (
        "sft-gpus-per-job",
        "SFTJob",
        {"resources": {"nodes": 8, "gpusPerNode": 8}},
        "spec.resources",
        "policy.maxGpusPerJob",
        {"maxGpusPerJob": 64},
    ),
    (
        "pack-gpus",
        "PackJob",
        {"workers": {"count": 1, "resources": {"limits": {"nvidia.com/gpu": "9"}}}},
        "spec.workers.resources",
        "policy.maxGpusPerNode",
        {"maxGpusPerNode": 9},
    ),
    (
        "pack-gpus-per-job",
        "PackJob",
        {"workers": {"count": 5, "resources": {"limits": {"nvidia.com/gpu": 8}}}},
        "spec.workers",
        "policy.maxGpusPerJob",
        {"maxGpusPerJob": 40},
    ),
    # Every GPU resource counts, summed over the kinds a pod asks for (5 + 4 > 8).
    (
        "pack-amd-gpus",
        "PackJob",
        {"workers": {"count": 1, "resources": {"limits": {"amd.com/gpu": "9"}}}},
        "spec.workers.resources",
        "policy.maxGpusPerNode",
        {"maxGpusPerNode": 9},
    ),
    (
        "pack-mixed-gpus",
        "PackJob",
        {
            "workers": {
                "count": 1,
                "resources": {"requests": {"nvidia.com/gpu": 5}, "limits": {"gpu.intel.com/xe": "4"}},
            }
        },
        "spec.workers.resources",
        "policy.maxGpusPerNode",
        {"maxGpusPerNode": 9},
    ),
    # An extended resource the policy does not know as a GPU cannot be counted, so it is refused.
    (
        "pack-mig-slices",
        "PackJob",
        {"workers": {"resources": {"limits": {"nvidia.com/mig-1g.10gb": 7}}}},
        "spec.workers.resources",
        "policy.gpuResources",
        {
            "gpuResources": [
                "nvidia.com/gpu",
                "amd.com/gpu",
                "gpu.intel.com/i915",
                "gpu.intel.com/xe",
                "nvidia.com/mig-1g.10gb",
            ]
        },
    ),
    # A trainjob's runtime owns its pod template: a namespaced one is the CR author's team's own.
    (
        "sft-own-runtime",
        "SFTJob",
        {"backend": "trainjob", "runtime": {"kind": "TrainingRuntime", "name": "mine"}},
        "spec.runtime",
        "policy.allowedRuntimes",
        {"allowedRuntimes": ["ClusterTrainingRuntime/torch-distributed", "TrainingRuntime/mine"]},
    ),
    (
        "sft-other-cluster-runtime",
        "SFTJob",
        {"backend": "trainjob", "runtime": {"name": "privileged"}},
        "spec.runtime",
        "policy.allowedRuntimes",
        {
            "allowedRuntimes": [
                "ClusterTrainingRuntime/torch-distributed",
                "ClusterTrainingRuntime/privileged",
            ]
        },
    ),
]
# The policy every case runs under (the default per-job ceiling, 64, would allow 8 nodes x 8 GPUs).
BASE_POLICY: dict[str, Any] = {"maxGpusPerJob": 32}


def manifest(kind: str, patch: dict[str, Any], name: str = "hostile") -> dict[str, Any]:
    """A CR as a user writes it, with `patch` merged into its spec (a top-level key set to None is
    removed)."""
    doc = copy.deepcopy(PACKJOB if kind == "PackJob" else SFTJOB)
    doc["metadata"] = {"name": name}
    for key, value in patch.items():
        if value is None:
            doc["spec"].pop(key, None)
        elif isinstance(value, dict):
            doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
        else:
            doc["spec"][key] = value
    return doc
