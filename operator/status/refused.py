"""Statuses of a parent that creates nothing now: refused (by the API server, the policy, the models),
or waiting for a predecessor's child to go. Pure: the handler passes the clock in."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from packtrain.core.spec_file import describe
from packtrain.operator import ownership, policy
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.reasons import ConditionReason as R
from packtrain.operator.status.conditions import Outcome, lifecycle_conditions

SPEC_MODELS: dict[str, type[BaseModel]] = {"PackJob": PackJobSpec, "SFTJob": SFTJobSpec}

# 403: a ResourceQuota, an admission policy or webhook, RBAC; 422: an object the server finds invalid.
# Retrying would be refused the same way, so the parent fails with the server's own words.
REFUSED_CODES = frozenset({400, 403, 422})


def refusal_message(kind: str, name: str, code: int | None, reason: str | None, body: Any) -> str:
    """What the API server said when it refused to create a child (its Status message, else its reason)."""
    said = ""
    try:
        doc = json.loads(body) if isinstance(body, str | bytes) else body
    except ValueError:
        doc = None
    if isinstance(doc, Mapping):
        said = str(doc.get("message") or "")
    said = said or (body.decode(errors="replace") if isinstance(body, bytes) else str(body or ""))
    said = said.strip() or str(reason or "no message")
    return f"the API server refused to create {kind} {name} ({code} {reason or ''}".rstrip() + f"): {said}"


def failed_status(body: Mapping[str, Any], reason: str, message: str, now: str) -> dict[str, Any]:
    """A terminal `Failed` status (the handler's transition Event makes it a Warning)."""
    prev = body.get("status") or {}
    generation = body["metadata"].get("generation")
    conds = lifecycle_conditions(
        prev.get("conditions") or [], Outcome("Failed", reason, message), now, generation
    )
    return {
        "phase": "Failed",
        "observedGeneration": generation,
        "conditions": conds,
        "completionTime": prev.get("completionTime") or now,
    }


def blocked_status(body: Mapping[str, Any], blocker: ownership.Blocker, now: str) -> dict[str, Any]:
    """Pending while a predecessor's child is deleted; Failed (NameConflict) for someone else's object."""
    if not blocker.waiting:
        return failed_status(body, blocker.reason, blocker.message, now)
    prev = body.get("status") or {}
    generation = body["metadata"].get("generation")
    outcome = Outcome("Pending", blocker.reason, blocker.message)
    return {
        **prev,
        "phase": "Pending",
        "observedGeneration": generation,
        "conditions": lifecycle_conditions(prev.get("conditions") or [], outcome, now, generation),
    }


def child_refused_status(kind: str, body: Mapping[str, Any], refusal: str, now: str) -> dict[str, Any]:
    """A child the API server would not create: Failed with its message."""
    message = f"{refusal}. Fix that, then delete and re-create the {kind}."
    return failed_status(body, R.CHILD_REFUSED, message, now)


def invalid_status(kind: str, body: Mapping[str, Any], exc: ValidationError, now: str) -> dict[str, Any]:
    """A spec the API server accepted but the models reject (a rule CEL cannot express), described as
    `packtrain run` and `render` describe it."""
    faults = describe(exc, SPEC_MODELS[kind], "spec")
    message = f"invalid {kind} spec: {faults}. Fix it, then delete and re-create the {kind}."
    return failed_status(body, R.INVALID_SPEC, message, now)


def policy_status(
    kind: str, body: Mapping[str, Any], violations: list[policy.Violation], now: str
) -> dict[str, Any]:
    """A spec the cluster policy refuses (created while the admission policy was absent)."""
    message = f"{policy.summary(kind, violations)}. Fix it, then delete and re-create the {kind}."
    return failed_status(body, R.POLICY_VIOLATION, message, now)
