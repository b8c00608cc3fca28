"""The permissions the operator needs, as RBAC PolicyRules.

The Helm chart's ClusterRole must grant exactly these (its test compares them);
the integration test runs the operator under a ServiceAccount bound to them, so a
missing verb fails there, not in a user's cluster. Workload pods get nothing: the
packer reports through its termination message, which the operator reads.
"""

from __future__ import annotations

from typing import Any

from packtrain.operator.api import GROUP
from packtrain.operator.children import CHILD_KINDS

# What the handlers read and write, in the namespaces the operator watches.
NAMESPACED_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": [GROUP],
        "resources": ["packjobs", "sftjobs"],
        "verbs": ["get", "list", "watch", "patch"],
    },
    {
        "apiGroups": [GROUP],
        "resources": ["packjobs/status", "sftjobs/status"],
        "verbs": ["get", "patch"],
    },
    # Children carry ownerReferences with blockOwnerDeletion, which needs update on the owner's finalizers.
    {
        "apiGroups": [GROUP],
        "resources": ["packjobs/finalizers", "sftjobs/finalizers"],
        "verbs": ["update"],
    },
    {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["get", "list", "watch", "create"]},
    {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "create"]},
    # Termination messages (stage summaries, failure log tails) and unschedulable pods.
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
    # delete: the training job of an SFTJob failed for a training stall (its GPUs go back); the
    # garbage collector deletes every other child.
    *(
        {
            "apiGroups": [c.group],
            "resources": [c.plural],
            "verbs": ["get", "list", "watch", "create", "patch", "delete"],
        }
        for c in CHILD_KINDS
    ),
    # Events on PackJobs/SFTJobs (kopf posts core/v1 Events).
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]

# What kopf itself needs cluster-wide: discovering CRDs as they appear, and namespaces for --namespace globs.
CLUSTER_RULES: list[dict[str, Any]] = [
    {
        "apiGroups": ["apiextensions.k8s.io"],
        "resources": ["customresourcedefinitions"],
        "verbs": ["list", "watch"],
    },
    {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
]

# Everything, for the ClusterRole of an operator that watches all namespaces (the chart's default).
RULES: list[dict[str, Any]] = NAMESPACED_RULES + CLUSTER_RULES


def allows(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    """Whether `rules` grant `verb` on `group`/`resource` (no wildcards are used here)."""
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)
