"""Whose child is it: a parent re-created under the same name must not adopt its predecessor's children.

Children are named after their parent (`builders.pack_job_name`, `builders.training_job_name`,
the ConfigMaps), so a parent deleted and created again at once (Argo CD's `Replace=true` sync,
`kubectl replace --force`) meets its predecessor's children while the garbage collector is
still deleting them. Only an ownerReference's uid tells the two apart: a child read by name
alone would make the new parent skip stages, or report the old spec's result as its own.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from packtrain.operator.reasons import ConditionReason as R

Pod = TypeVar("Pod", bound=Mapping[str, Any])


class Claim(enum.Enum):
    OURS = "ours"
    LEFTOVER = (
        "leftover"  # owned by an earlier parent of the same kind and name: the garbage collector deletes it
    )
    FOREIGN = "foreign"  # someone else's (a user's object, another parent's): never adopted or overwritten


@dataclass(frozen=True)
class Blocker:
    """Why a parent creates nothing now: a leftover to wait for (`PreviousObjectBeingDeleted`) or a name
    taken (`NameConflict`)."""

    reason: str
    message: str

    @property
    def waiting(self) -> bool:
        return self.reason == R.PREVIOUS_OBJECT_BEING_DELETED


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _refs(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(_meta(obj).get("ownerReferences") or ())


def _group(api_version: str | None) -> str:
    return (api_version or "").rpartition("/")[0]


def _controller(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((r for r in _refs(obj) if r.get("controller")), None)


def _where(obj: Mapping[str, Any]) -> str:
    meta = _meta(obj)
    return f"{meta.get('namespace')}/{meta.get('name')}"


def claim(child: Mapping[str, Any], parent: Mapping[str, Any]) -> Claim:
    """OURS when an ownerReference carries the parent's uid; LEFTOVER when one names an earlier object
    of the parent's kind and name; FOREIGN otherwise."""
    meta = _meta(parent)
    refs = _refs(child)
    if any(r.get("uid") == meta.get("uid") for r in refs):
        return Claim.OURS
    if any(
        r.get("kind") == parent.get("kind")
        and r.get("name") == meta.get("name")
        and _group(r.get("apiVersion")) == _group(parent.get("apiVersion"))
        for r in refs
    ):
        return Claim.LEFTOVER
    return Claim.FOREIGN


def leftover_message(child: Mapping[str, Any], parent: Mapping[str, Any]) -> str:
    kind, name = parent.get("kind"), _meta(parent).get("name")
    old = next((r for r in _refs(child) if r.get("kind") == kind and r.get("name") == name), {})
    finalizers = _meta(child).get("finalizers") or []
    held = f" (held by finalizers: {', '.join(finalizers)})" if finalizers else ""
    return (
        f"waiting for {child.get('kind')} {_where(child)} of the previous {kind} {name} "
        f"(uid {old.get('uid')}) to be deleted by the garbage collector{held}; this {kind} "
        f"(uid {_meta(parent).get('uid')}) creates its own once it is gone"
    )


def conflict_message(child: Mapping[str, Any], parent: Mapping[str, Any]) -> str:
    kind, child_kind = parent.get("kind"), child.get("kind")
    owners = ", ".join(f"{r.get('kind')} {r.get('name')}" for r in _refs(child)) or "nothing"
    return (
        f"{child_kind} {_where(child)} already exists and is not this {kind}'s (its owners: {owners}); "
        f"the {kind} names its {child_kind} after itself and never adopts or overwrites another object. "
        f"Delete or rename that {child_kind}, then delete and re-create the {kind}, or create the {kind} "
        "under another name"
    )


def blocker(parent: Mapping[str, Any], children: Iterable[Mapping[str, Any] | None]) -> Blocker | None:
    """The first child in the parent's way: a foreign one (the parent fails) before a leftover (it waits)."""
    found = [(claim(c, parent), c) for c in children if c is not None]
    foreign = next((c for k, c in found if k is Claim.FOREIGN), None)
    if foreign is not None:
        return Blocker(R.NAME_CONFLICT, conflict_message(foreign, parent))
    leftover = next((c for k, c in found if k is Claim.LEFTOVER), None)
    if leftover is not None:
        return Blocker(R.PREVIOUS_OBJECT_BEING_DELETED, leftover_message(leftover, parent))
    return None


def leftover_pod(parent: Mapping[str, Any], child: str, pods: Sequence[Mapping[str, Any]]) -> Blocker | None:
    """A pod of an earlier child named `child`, still there before the parent creates its own: wait for it.

    Its labels match the new child's, so its termination message would be read as the new
    child's result, and it may still write where the new one will.
    """
    for pod in pods:
        owner = _controller(pod)
        if owner is not None:
            return Blocker(
                R.PREVIOUS_OBJECT_BEING_DELETED,
                (
                    f"waiting for pod {_where(pod)} of the previous {owner.get('kind')} {owner.get('name')} "
                    f"(uid {owner.get('uid')}) to be deleted; this {parent.get('kind')} then creates its "
                    f"own {child}"
                ),
            )
    return None


def pods_of(child: Mapping[str, Any], pods: Sequence[Pod]) -> list[Pod]:
    """The pods a child controls directly, without those of an earlier child of the same kind and name.

    Pods controlled by another kind (a TrainJob's pods belong to its JobSet's Jobs) are kept.
    """
    uid = _meta(child).get("uid")
    return [
        p
        for p in pods
        if (owner := _controller(p)) is None
        or owner.get("kind") != child.get("kind")
        or owner.get("uid") == uid
    ]
