"""The Argo CD health checks, run in Lua 5.1 (what Argo CD's gopher-lua implements) via lupa.

Statuses are built with the operator's own status models, so a renamed field breaks these tests.
"""

from __future__ import annotations

from typing import Any

import pytest
from lupa import lua51

from packtrain.operator.api import Condition, PackJobStatus, SFTJobStatus, TrainProgress

from .helm import CHART

NOW = "2026-01-01T00:00:00Z"
PACK_PROGRESSING = ["Pending", "Converting", "Planning", "Materializing"]
SFT_PROGRESSING = ["Pending", "WaitingForData", "Running"]


def health(kind: str, obj: dict[str, Any]) -> dict[str, str]:
    """Run the shipped script the way Argo CD does: `obj` global, a table `{status, message}` back."""
    script = (CHART / "files" / f"argocd-health-{kind.lower()}.lua").read_text()
    lua = lua51.LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(script)
    out = dict(result.items())
    assert set(out) == {"status", "message"}, out
    assert all(isinstance(v, str) for v in out.values()), out
    return out


def cr(status: PackJobStatus | SFTJobStatus | None, generation: int = 1) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "packtrain.dev/v1alpha1",
        "metadata": {"name": "j", "generation": generation},
    }
    if status is not None:
        obj["status"] = status.dump()
    return obj


def cond(type_: str, status: str = "True", message: str = "") -> Condition:
    return Condition(type=type_, status=status, reason="Test", message=message, last_transition_time=NOW)


@pytest.mark.parametrize("kind", ["PackJob", "SFTJob"])
def test_no_status_yet_is_progressing(kind: str) -> None:
    assert health(kind, cr(None)) == {
        "status": "Progressing",
        "message": "Waiting for the packtrain operator",
    }


@pytest.mark.parametrize(("kind", "model"), [("PackJob", PackJobStatus), ("SFTJob", SFTJobStatus)])
def test_terminal_phases(kind: str, model: type[PackJobStatus] | type[SFTJobStatus]) -> None:
    done = model(phase="Succeeded", observed_generation=1, conditions=[cond("Succeeded", message="all done")])
    assert health(kind, cr(done)) == {"status": "Healthy", "message": "all done"}
    failed = model(
        phase="Failed",
        observed_generation=1,
        conditions=[cond("Ready", "False", "not ready"), cond("Failed", message="OOMKilled")],
    )
    assert health(kind, cr(failed)) == {"status": "Degraded", "message": "OOMKilled"}
    assert health(kind, cr(model(phase="Failed"))) == {"status": "Degraded", "message": "Failed"}


@pytest.mark.parametrize(("kind", "model"), [("PackJob", PackJobStatus), ("SFTJob", SFTJobStatus)])
def test_conditions_decide_when_the_phase_is_missing(
    kind: str, model: type[PackJobStatus] | type[SFTJobStatus]
) -> None:
    assert health(kind, cr(model(conditions=[cond("Failed", message="bad spec")])))["status"] == "Degraded"
    assert health(kind, cr(model(conditions=[cond("Succeeded")])))["status"] == "Healthy"
    assert health(kind, cr(model(conditions=[cond("Failed", "False")])))["status"] == "Progressing"


@pytest.mark.parametrize("phase", PACK_PROGRESSING)
def test_packjob_working_phases_are_progressing(phase: str) -> None:
    assert health("PackJob", cr(PackJobStatus(phase=phase))) == {"status": "Progressing", "message": phase}
    staged = PackJobStatus(phase=phase, stage="convert 3/4")
    assert health("PackJob", cr(staged)) == {"status": "Progressing", "message": "convert 3/4"}
    ready = PackJobStatus(
        phase=phase, stage="convert 3/4", conditions=[cond("Ready", "False", "waiting for pods")]
    )
    assert health("PackJob", cr(ready))["message"] == "waiting for pods"


@pytest.mark.parametrize("phase", SFT_PROGRESSING)
def test_sftjob_working_phases_are_progressing(phase: str) -> None:
    assert health("SFTJob", cr(SFTJobStatus(phase=phase))) == {"status": "Progressing", "message": phase}


def test_sftjob_reports_training_progress() -> None:
    running = SFTJobStatus(phase="Running", progress=TrainProgress(step=120, max_steps=1000))
    assert health("SFTJob", cr(running)) == {"status": "Progressing", "message": "step 120/1000"}
    assert (
        health("SFTJob", cr(SFTJobStatus(phase="Running", progress=TrainProgress(step=7))))["message"]
        == "step 7"
    )


def test_a_running_sftjob_shows_its_step_not_the_childs_message() -> None:
    running = SFTJobStatus(
        phase="Running",
        progress=TrainProgress(step=5, max_steps=10),
        conditions=[cond("Ready", "False", "PyTorchJob quickstart is running.")],
    )
    assert health("SFTJob", cr(running)) == {"status": "Progressing", "message": "step 5/10"}


@pytest.mark.parametrize(("kind", "model"), [("PackJob", PackJobStatus), ("SFTJob", SFTJobStatus)])
def test_a_passed_deadline_is_degraded(kind: str, model: type[PackJobStatus] | type[SFTJobStatus]) -> None:
    stuck = model(
        phase="Pending", conditions=[cond("Degraded", "True", "pods unschedulable for longer than 1h")]
    )
    assert health(kind, cr(stuck)) == {
        "status": "Degraded",
        "message": "pods unschedulable for longer than 1h",
    }
    fine = model(phase="Pending", conditions=[cond("Degraded", "False")])
    assert health(kind, cr(fine))["status"] == "Progressing"


def test_suspended_sftjob_is_suspended() -> None:
    suspended = SFTJobStatus(phase="Suspended", conditions=[cond("Ready", "False", "spec.suspend is true")])
    assert health("SFTJob", cr(suspended)) == {"status": "Suspended", "message": "spec.suspend is true"}
    assert health("SFTJob", cr(SFTJobStatus(phase="Suspended"))) == {
        "status": "Suspended",
        "message": "Suspended",
    }


def test_packjob_has_no_suspended_phase() -> None:
    obj = cr(PackJobStatus(phase="Pending"))
    obj["status"]["phase"] = "Suspended"
    assert health("PackJob", obj) == {"status": "Progressing", "message": "Unknown phase Suspended"}


@pytest.mark.parametrize(("kind", "model"), [("PackJob", PackJobStatus), ("SFTJob", SFTJobStatus)])
def test_stale_status_waits_for_the_operator(
    kind: str, model: type[PackJobStatus] | type[SFTJobStatus]
) -> None:
    stale = model(phase="Succeeded", observed_generation=1)
    assert health(kind, cr(stale, generation=2)) == {
        "status": "Progressing",
        "message": "Waiting for the operator to observe generation 2",
    }
    assert health(kind, cr(stale, generation=1))["status"] == "Healthy"


def test_a_stalled_training_is_degraded_with_the_operators_message() -> None:
    """A Running SFTJob whose step stands still (the operator's own status for it): Degraded, not its step."""
    from packtrain.operator import status as st
    from packtrain.operator.deadlines import Stall

    child = {
        "apiVersion": "kubeflow.org/v1",
        "metadata": {"name": "j"},
        "status": {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]},
    }
    stall = Stall("TrainingStalled", "training step 120 has not advanced since 2026-01-01T00:00:00Z")
    status = st.sft_status(
        1, "PyTorchJob", child, "/data/p", {"progress": {"step": 120, "maxSteps": 1000}}, NOW, stall=stall
    )
    assert health("SFTJob", cr(SFTJobStatus.model_validate(status))) == {
        "status": "Degraded",
        "message": stall.message,
    }
    cleared = st.sft_status(1, "PyTorchJob", child, "/data/p", status, NOW)
    assert health("SFTJob", cr(SFTJobStatus.model_validate(cleared))) == {
        "status": "Progressing",
        "message": "step 120/1000",
    }
