"""Pure status mapping: child objects in, phase/conditions/stats out.

The handlers read Jobs, pods and Kubeflow jobs from the API and hand them here
as plain dicts; what a user sees in `kubectl get`/`describe` is decided by these
functions alone, so every transition is unit-tested without a cluster. One module
per thing computed: `conditions` (the lifecycle set), `pods` (terminations, the
scheduler), `jobs` (stage Jobs), `pack` (the PackJob), `sft` (the SFTJob's status), `sft_decision`
(what to do for it), `refused`
(parents that create nothing now), `events` (what a change posts).
"""

from __future__ import annotations

from packtrain.core.contract import PACK_STAGES, parse_summary
from packtrain.operator.names import COMPLETION_INDEX
from packtrain.operator.status.conditions import (
    RUNNING_PHASES,
    TERMINAL,
    Outcome,
    get_condition,
    lifecycle_conditions,
    set_condition,
)
from packtrain.operator.status.events import (
    WARNING_REASONS,
    event_reason,
    memory_plan_event,
    transition_event,
)
from packtrain.operator.status.jobs import JobState, failure, job_state, stage_durations
from packtrain.operator.status.pack import STAGE_PHASE, PackDecision, pack_stats, pack_status, percent_done
from packtrain.operator.status.pods import Terminated, pod_failure, terminated, unschedulable
from packtrain.operator.status.refused import (
    REFUSED_CODES,
    blocked_status,
    child_refused_status,
    failed_status,
    invalid_status,
    policy_status,
    refusal_message,
)
from packtrain.operator.status.sft import (
    BLOCKING_REASONS,
    DataReadiness,
    child_phase,
    data_readiness,
    sft_status,
    train_progress,
    waiting_status,
)
from packtrain.operator.status.sft_decision import SFTDecision, decide_start, mirror

__all__ = [
    "BLOCKING_REASONS",
    "COMPLETION_INDEX",
    "PACK_STAGES",
    "REFUSED_CODES",
    "RUNNING_PHASES",
    "STAGE_PHASE",
    "TERMINAL",
    "WARNING_REASONS",
    "DataReadiness",
    "JobState",
    "Outcome",
    "PackDecision",
    "SFTDecision",
    "Terminated",
    "blocked_status",
    "child_phase",
    "child_refused_status",
    "data_readiness",
    "decide_start",
    "event_reason",
    "failed_status",
    "failure",
    "get_condition",
    "invalid_status",
    "job_state",
    "lifecycle_conditions",
    "mirror",
    "pack_stats",
    "pack_status",
    "parse_summary",
    "percent_done",
    "pod_failure",
    "policy_status",
    "refusal_message",
    "set_condition",
    "sft_status",
    "stage_durations",
    "terminated",
    "train_progress",
    "transition_event",
    "memory_plan_event",
    "unschedulable",
    "waiting_status",
]
