"""The training-stall deadline of a Running SFTJob: the pure decision, the scrape's bookkeeping, and the
reconcile against the in-memory API of `test_handlers` (the real API server: `test_cluster_deadlines`)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from test_handlers import FakeKube

from packtrain.core.contract import TRAIN_DATA_WAIT
from packtrain.operator import handlers, names, progress
from packtrain.operator import status as st
from packtrain.operator.api import SFTJobStatus
from packtrain.operator.deadlines import Deadlines, last_advance, scrape_error, training_stall
from packtrain.operator.reasons import ConditionReason
from packtrain.operator.settings import OperatorDefaults

RUNNING = "2026-01-01T00:00:00Z"
ADVANCED = "2026-01-01T01:00:00Z"
SHORTLY = "2026-01-01T01:10:00Z"  # 10 min after the last advance
LATER = "2026-01-01T01:40:00Z"  # 40 min after: past the 30 min default
MUCH_LATER = "2026-01-01T08:00:00Z"  # 7 h after: past the 6 h fail deadline
RECENT = 90.0  # a reading older than this was not taken by a live scrape loop (`progress.RECENT`)
WHERE = {
    "recent": RECENT,
    "namespace": "ml",
    "selector": "packtrain.dev/sftjob=demo-sft",
    "pod": "demo-sft-master-0",
    "child": "PyTorchJob demo-sft",
}


def reading(step: int = 120, updated: str = ADVANCED) -> dict[str, Any]:
    return {"progress": {"step": step, "maxSteps": 1000, "updatedAt": updated, "lastAdvanceTime": ADVANCED}}


def test_the_clock_moves_only_when_the_step_changes() -> None:
    assert last_advance(None, 5, ADVANCED) == ADVANCED
    assert last_advance({"step": 5, "lastAdvanceTime": ADVANCED}, 5, LATER) == ADVANCED
    assert last_advance({"step": 5, "lastAdvanceTime": ADVANCED}, 6, LATER) == LATER
    # A trainer restarted from its checkpoint goes back a few steps: that is movement too.
    assert last_advance({"step": 5, "lastAdvanceTime": ADVANCED}, 3, LATER) == LATER
    assert scrape_error(None, "down", ADVANCED) == {"message": "down", "since": ADVANCED}
    assert scrape_error({"message": "down", "since": ADVANCED}, "still down", LATER) == {
        "message": "still down",
        "since": ADVANCED,
    }


def test_no_stall_within_the_deadline() -> None:
    assert training_stall(reading(), RUNNING, SHORTLY, Deadlines(), **WHERE) is None
    assert training_stall({}, None, LATER, Deadlines(), **WHERE) is None  # not yet seen Running


def test_a_step_that_stands_still_is_a_stall_that_says_where_to_look() -> None:
    stall = training_stall(reading(updated=LATER), RUNNING, LATER, Deadlines(), **WHERE)
    assert stall is not None and stall.reason == "TrainingStalled" and not stall.fail
    assert stall.message.startswith(
        f"training step 120 has not advanced since {ADVANCED}, longer than the 30m "
    )
    assert "kubectl logs -n ml demo-sft-master-0" in stall.message
    assert "kubectl logs -n ml -l packtrain.dev/sftjob=demo-sft --prefix" in stall.message
    assert TRAIN_DATA_WAIT in stall.message and TRAIN_DATA_WAIT == "packtrain_train_data_wait_seconds"


def test_the_clock_starts_again_when_the_job_runs_again() -> None:
    """Resumed after a suspension long past the deadline: the old advance time does not count."""
    assert training_stall(reading(), SHORTLY, LATER, Deadlines(), **WHERE) is None


def test_a_trainer_that_never_steps_is_stalled_since_it_started_running() -> None:
    """A hang before the first step (a collective that never forms, a loader stuck on its first batch)."""
    read = {"progress": {"updatedAt": "2026-01-01T00:31:00Z"}}  # scraped fine, no step gauge yet
    stall = training_stall(read, RUNNING, "2026-01-01T00:31:00Z", Deadlines(), **{**WHERE, "pod": None})
    assert stall is not None and stall.reason == ConditionReason.TRAINING_STALLED
    assert stall.message.startswith(f"no training step since the job started running at {RUNNING}")
    assert "kubectl logs -n ml -l packtrain.dev/sftjob=demo-sft)" in stall.message
    # Never read at all (an operator that has not scraped it yet): not a stall, and never failed.
    unread = training_stall({}, RUNNING, MUCH_LATER, Deadlines(), **WHERE)
    assert unread is not None and unread.reason == ConditionReason.NO_LIVE_PROGRESS and not unread.fail
    assert f"no step was read since it started running at {RUNNING}" in unread.message


def test_unreadable_metrics_are_not_called_a_stall() -> None:
    status = {
        **reading(updated=SHORTLY),
        "scrapeError": {
            "message": "metrics endpoint http://10.0.0.5:9400/metrics could not be read: Connection refused",
            "since": SHORTLY,
        },
    }
    stall = training_stall(status, RUNNING, MUCH_LATER, Deadlines(), **WHERE)
    assert stall is not None and stall.reason == "NoLiveProgress" and not stall.fail  # never failed for it
    assert stall.message.startswith(
        "no live progress: metrics endpoint http://10.0.0.5:9400/metrics could not be read"
    )
    assert f"the last reading ({SHORTLY}) was step 120, unchanged since {ADVANCED}" in stall.message
    assert "NetworkPolicy" in stall.message and "kubectl logs -n ml demo-sft-master-0" in stall.message
    # Seen standing still past the deadline before the metrics went: that is a stall, unreadable or not.
    seen = {**status, "progress": {**status["progress"], "updatedAt": LATER}}
    assert (
        training_stall(seen, RUNNING, LATER, Deadlines(), **WHERE).reason == ConditionReason.TRAINING_STALLED
    )  # type: ignore[union-attr]


def test_an_operator_restart_does_not_stall_or_fail_a_healthy_training() -> None:
    """Step advancing, last scrape 10:00, the operator back at 10:40 or 16:30: its first reconcile runs before
    its first scrape, and time nobody observed is no stall."""
    advancing = {
        "progress": {
            "step": 500,
            "maxSteps": 1000,
            "updatedAt": "2026-01-01T10:00:00Z",
            "lastAdvanceTime": "2026-01-01T10:00:00Z",
        }
    }
    for back in ("2026-01-01T10:40:00Z", "2026-01-01T16:30:00Z"):
        stall = training_stall(advancing, RUNNING, back, Deadlines(), **WHERE)
        assert stall is not None and stall.reason == ConditionReason.NO_LIVE_PROGRESS and not stall.fail
        assert stall.message.startswith(
            "no live progress: no reading in the last 1.5m (the operator reads again"
        )
    # Its first scrape after the restart sees the step moved: the clock starts from there, nothing is called.
    moved = {
        "progress": {
            **advancing["progress"],
            "step": 900,
            "updatedAt": "2026-01-01T16:30:30Z",
            "lastAdvanceTime": "2026-01-01T16:30:30Z",
        }
    }
    assert training_stall(moved, RUNNING, "2026-01-01T16:30:31Z", Deadlines(), **WHERE) is None
    # A reading just before a short restart (within `recent`) still counts: a seen stall stays a stall.
    seen = reading(updated=LATER)
    assert (
        training_stall(seen, RUNNING, "2026-01-01T01:41:00Z", Deadlines(), **WHERE).reason
        == ConditionReason.TRAINING_STALLED
    )  # type: ignore[union-attr]


def test_a_stall_seen_and_then_unreadable_is_never_failed_on_time_nobody_observed() -> None:
    """Seen still for 40 min, then the metrics go: the fail deadline counts only to the last reading."""
    status = {**reading(updated=LATER), "scrapeError": {"message": "connection refused", "since": LATER}}
    soon = training_stall(status, RUNNING, "2026-01-01T01:41:00Z", Deadlines(), **WHERE)
    assert soon is not None and soon.reason == ConditionReason.TRAINING_STALLED and not soon.fail
    late = training_stall(status, RUNNING, MUCH_LATER, Deadlines(), **WHERE)
    assert late is not None and late.reason == ConditionReason.NO_LIVE_PROGRESS and not late.fail
    assert late.message.startswith(
        f"no live progress: connection refused (since {LATER}); the last reading ({LATER})"
    )


def test_the_last_step_standing_still_is_not_a_stall() -> None:
    """The final checkpoint or a long evaluation keeps the step at maxSteps: not a hang."""
    done = {
        "progress": {"step": 1000, "maxSteps": 1000, "updatedAt": MUCH_LATER, "lastAdvanceTime": ADVANCED}
    }
    assert training_stall(done, RUNNING, MUCH_LATER, Deadlines(), **WHERE) is None
    one_short = {"progress": {**done["progress"], "step": 999}}
    assert training_stall(one_short, RUNNING, MUCH_LATER, Deadlines(), **WHERE).fail  # type: ignore[union-attr]


def test_the_fail_deadline_fails_a_stall_and_zero_never_does() -> None:
    status = reading(updated=MUCH_LATER)
    stall = training_stall(status, RUNNING, MUCH_LATER, Deadlines(), **WHERE)
    assert stall is not None and stall.fail and stall.reason == ConditionReason.TRAINING_STALLED
    assert "Failed after 6h without a step: PyTorchJob demo-sft was deleted" in stall.message
    never = Deadlines.from_dict({"trainingStallSeconds": 60, "trainingStallFailSeconds": 0})
    assert never == Deadlines(training_stall=60, training_stall_fail=None)
    assert not training_stall(status, RUNNING, MUCH_LATER, never, **WHERE).fail  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="trainingStallFailSeconds must be longer than trainingStallSeconds"):
        Deadlines.from_dict({"trainingStallSeconds": 600, "trainingStallFailSeconds": 600})
    env = {"PACKTRAIN_DEADLINES": json.dumps({"trainingStallSeconds": 5, "trainingStallFailSeconds": 30})}
    assert OperatorDefaults.from_env(env).deadlines == Deadlines(training_stall=5, training_stall_fail=30)


# The scrape's status patch


def target(status: dict[str, Any], url: str | None = "http://127.0.0.1:9400/metrics") -> progress.Target:
    return progress.Target(url, 1000, status)


METRICS = 'packtrain_train_step{rank="0"} 120\npacktrain_train_loss{rank="0"} 1.5\n'


def test_a_scrape_records_when_the_step_moved_and_why_it_failed() -> None:
    first = progress.reading(target({}), METRICS, None, ADVANCED)
    assert first == {
        "progress": {
            "step": 120,
            "loss": 1.5,
            "maxSteps": 1000,
            "updatedAt": ADVANCED,
            "lastAdvanceTime": ADVANCED,
        }
    }
    same = progress.reading(target(first), METRICS, None, LATER)
    assert same is not None and same["progress"]["updatedAt"] == LATER
    assert same["progress"]["lastAdvanceTime"] == ADVANCED
    failed = progress.reading(target(first), None, "metrics endpoint x could not be read: refused", LATER)
    assert failed == {
        "scrapeError": {"message": "metrics endpoint x could not be read: refused", "since": LATER}
    }
    down = {**first, **failed}
    assert (
        progress.reading(target(down), None, "metrics endpoint x could not be read: refused", MUCH_LATER)
        is None
    )
    back = progress.reading(target(down), METRICS.replace("120", "121"), None, MUCH_LATER)
    assert (
        back is not None and back["scrapeError"] is None and back["progress"]["lastAdvanceTime"] == MUCH_LATER
    )
    SFTJobStatus.model_validate({**first, **failed})
    # Read, but no step gauge (not yet, or a restarted trainer): when it was read still counts.
    assert progress.reading(target(first), "# nothing yet\n", None, LATER) == {
        "progress": {"updatedAt": LATER}
    }
    assert progress.reading(target(first), "<html>not metrics</html>", None, LATER) is None  # shows nothing


# The reconcile: conditions, Events, and a failed stall deleting the training job


class DeletingKube(FakeKube):
    def __init__(self) -> None:
        super().__init__()
        self.deleted: list[str] = []
        self.uids: list[str] = []

    def delete(self, group: str, version: str, plural: str, namespace: str, name: str, *, uid: str) -> None:
        self.objects.pop((plural, namespace, name), None)
        self.deleted.append(f"{plural}/{name}")
        self.uids.append(uid)

    def patch_status(self, plural: str, namespace: str, name: str, status: dict[str, Any], rv: str) -> None:
        self.put(plural, {**self.objects[(plural, namespace, name)], "status": status})


def running_sftjob(sftjob: dict[str, Any], now: str) -> tuple[DeletingKube, dict[str, Any]]:
    sftjob["spec"]["data"] = {"path": "/data/packs/p"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    del sftjob["spec"]["queueName"]
    sftjob["metadata"]["resourceVersion"] = "1"
    kube = DeletingKube()
    kube.put("sftjobs", sftjob)
    handlers.reconcile_sftjob(kube, sftjob, OperatorDefaults())  # type: ignore[arg-type]
    child = kube.objects[("pytorchjobs", "ml", "demo-sft")]
    child["metadata"]["uid"] = "pytorchjob-uid"  # the API server's, which the in-memory one does not assign
    child["status"] = {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]}
    kube.pod_list[f"{names.SFTJOB_LABEL}=demo-sft"] = [
        {
            "metadata": {
                "name": "demo-sft-master-0",
                "labels": {"training.kubeflow.org/replica-type": "master"},
            },
            "status": {"phase": "Running", "podIP": "10.0.0.5"},
        }
    ]
    status = handlers.reconcile_sftjob(kube, sftjob, OperatorDefaults())  # type: ignore[arg-type]
    running = st.get_condition(status["conditions"], "Running")
    assert status["phase"] == "Running" and running is not None and running["status"] == "True"
    status["conditions"] = [{**c, "lastTransitionTime": now} for c in status["conditions"]]
    kube.put("sftjobs", {**sftjob, "status": {**status, **reading(updated=LATER)}})
    return kube, kube.objects[("sftjobs", "ml", "demo-sft")]


def test_a_stalled_sftjob_turns_degraded_with_a_warning_and_clears(
    sftjob: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, body = running_sftjob(sftjob, RUNNING)
    monkeypatch.setattr(handlers.sftjob, "now", lambda: LATER)
    status = handlers.reconcile_sftjob(kube, copy.deepcopy(body), OperatorDefaults())  # type: ignore[arg-type]
    degraded = st.get_condition(status["conditions"], "Degraded")
    assert status["phase"] == "Running" and degraded is not None and degraded["status"] == "True"
    assert (
        degraded["reason"] == ConditionReason.TRAINING_STALLED
        and "kubectl logs -n ml demo-sft-master-0" in degraded["message"]
    )
    event = st.transition_event("Running", st.event_reason(body["status"]), status)
    assert event is not None and event[:2] == ("Warning", "TrainingStalled") and "step 120" in event[2]
    moved = {
        **body,
        "status": {**status, "progress": {**status["progress"], "step": 121, "lastAdvanceTime": LATER}},
    }
    cleared = handlers.reconcile_sftjob(kube, moved, OperatorDefaults())  # type: ignore[arg-type]
    assert st.get_condition(cleared["conditions"], "Degraded")["status"] == "False"  # type: ignore[index]
    SFTJobStatus.model_validate(status)


def test_a_stall_past_the_fail_deadline_fails_and_deletes_the_training_job_once_written(
    sftjob: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kopf

    kube, body = running_sftjob(sftjob, RUNNING)
    child_uid = kube.objects[("pytorchjobs", "ml", "demo-sft")]["metadata"]["uid"]
    body["status"]["progress"]["updatedAt"] = MUCH_LATER
    kube.put("sftjobs", body)
    monkeypatch.setattr(handlers.sftjob, "now", lambda: MUCH_LATER)
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, type, reason, message: posted.append((type, reason)))
    handlers.write_status(kopf.Memo(kube=kube, defaults=OperatorDefaults()), "sftjobs", body)
    written = kube.objects[("sftjobs", "ml", "demo-sft")]["status"]
    failed = st.get_condition(written["conditions"], "Failed")
    assert (
        written["phase"] == "Failed"
        and failed is not None
        and failed["reason"] == ConditionReason.TRAINING_STALLED
    )
    assert written["completionTime"] == MUCH_LATER and posted == [("Warning", "TrainingStalled")]
    assert kube.deleted == ["pytorchjobs/demo-sft"]
    assert kube.uids == [child_uid]  # pinned to the PyTorchJob that was checked (a delete precondition)
    # Terminal now: a later event neither creates the training job again nor deletes anything more.
    handlers.write_status(
        kopf.Memo(kube=kube, defaults=OperatorDefaults()),
        "sftjobs",
        kube.objects[("sftjobs", "ml", "demo-sft")],
    )
    assert kube.deleted == ["pytorchjobs/demo-sft"] and ("pytorchjobs", "ml", "demo-sft") not in kube.objects


def test_a_restart_between_the_failed_write_and_the_delete_still_deletes(sftjob: dict[str, Any]) -> None:
    kube, body = running_sftjob(sftjob, RUNNING)
    failed = st.lifecycle_conditions(
        body["status"]["conditions"], st.Outcome("Failed", "TrainingStalled", "stuck"), MUCH_LATER, 1
    )
    body = {**body, "status": {**body["status"], "phase": "Failed", "conditions": failed}}
    assert handlers.reconcile_sftjob(kube, body, OperatorDefaults()) == body["status"]  # type: ignore[arg-type]
    assert kube.deleted == ["pytorchjobs/demo-sft"]


def test_after_an_operator_outage_a_stale_reading_degrades_without_failing_or_deleting(
    sftjob: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume reconcile of a restarted operator, hours after its last scrape, before its first new one."""
    import kopf

    kube, body = running_sftjob(sftjob, RUNNING)  # last read at LATER, step 120 unchanged since ADVANCED
    monkeypatch.setattr(handlers.sftjob, "now", lambda: MUCH_LATER)
    monkeypatch.setattr(kopf, "event", lambda body, type, reason, message: None)
    handlers.write_status(kopf.Memo(kube=kube, defaults=OperatorDefaults()), "sftjobs", body)
    written = kube.objects[("sftjobs", "ml", "demo-sft")]["status"]
    degraded = st.get_condition(written["conditions"], "Degraded")
    assert (
        written["phase"] == "Running"
        and degraded is not None
        and degraded["reason"] == ConditionReason.NO_LIVE_PROGRESS
    )
    assert kube.deleted == [] and ("pytorchjobs", "ml", "demo-sft") in kube.objects
