"""Child state → PackJob/SFTJob status: phases, conditions, stats, failure messages, events."""

from __future__ import annotations

import json
from typing import Any

from operator_fixtures import PACKJOB

from packtrain.operator import status as st
from packtrain.operator.api import PackJobSpec, PackJobStatus, SFTJobStatus

SPEC = PackJobSpec.model_validate(PACKJOB["spec"])
T0, T1, T2 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z", "2026-01-01T00:09:00Z"


def job(
    stage: str, *, complete: bool = False, failed: str | None = None, succeeded: int = 0, completions: int = 4
) -> dict[str, Any]:
    conds = []
    if complete:
        conds = [{"type": "SuccessCriteriaMet", "status": "True"}, {"type": "Complete", "status": "True"}]
    if failed:
        conds = [{"type": "Failed", "status": "True", "reason": failed, "message": "Job has failed indexes"}]
    status: dict[str, Any] = {"succeeded": succeeded, "conditions": conds}
    if complete:
        status |= {"startTime": T0, "completionTime": T1}
    return {
        "metadata": {"name": f"demo-{stage}", "namespace": "ml"},
        "spec": {"completions": completions},
        "status": status,
    }


def pod(
    message: str, exit_code: int = 0, index: int | None = None, container: str = "packer"
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "p"}
    if index is not None:
        meta["annotations"] = {st.COMPLETION_INDEX: str(index)}
    term = {"exitCode": exit_code, "message": message, "reason": "Completed" if exit_code == 0 else "Error"}
    return {
        "metadata": meta,
        "status": {"containerStatuses": [{"name": container, "state": {"terminated": term}}]},
    }


def convert_pods() -> list[dict[str, Any]]:
    return [
        pod(
            json.dumps(
                {
                    "stage": "convert",
                    "index": i,
                    "count": 4,
                    "samples": 10,
                    "converted": 9,
                    "rejected": 1,
                    "tokens": 1000,
                }
            ),
            index=i,
        )
        for i in range(4)
    ]


PLAN_SUMMARY = {
    "stage": "plan",
    "samples": 40,
    "packed": 36,
    "rejected": 4,
    "sequences": 9,
    "shards": 1,
    "tokens": 3600,
    "rejected_by_reason": {"overlong": 3, "missing_media": 1},
    "fill_ratio": 0.9765,
    "padding_saved": 0.71,
}


def decide(
    jobs: dict[str, Any],
    pods: dict[str, Any] | None = None,
    previous: dict[str, Any] | None = None,
    now: str = T1,
) -> st.PackDecision:
    decision = st.pack_status("demo", 1, SPEC, jobs, pods or {}, previous, now)
    PackJobStatus.model_validate(decision.status)  # always what the CRD's status schema accepts
    return decision


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found = st.get_condition(status["conditions"], type_)
    assert found is not None, type_
    return dict(found)


def test_new_packjob_creates_convert() -> None:
    d = decide({"convert": None, "plan": None, "materialize": None}, now=T0)
    assert d.create == "convert"
    assert d.status["phase"] == "Converting" and d.status["stage"] == "convert 0/4"
    assert d.status["startTime"] == T0 and d.status["outputPath"] == "/data/packs/demo"
    assert cond(d.status, "Ready")["status"] == "False" and cond(d.status, "Failed")["status"] == "False"


def test_running_convert_reports_progress_and_creates_nothing() -> None:
    d = decide({"convert": job("convert", succeeded=3), "plan": None, "materialize": None})
    assert d.create is None and d.status["phase"] == "Converting" and d.status["stage"] == "convert 3/4"


def test_finished_convert_creates_plan_and_sums_the_summaries() -> None:
    d = decide(
        {"convert": job("convert", complete=True, succeeded=4), "plan": None, "materialize": None},
        {"convert": convert_pods()},
    )
    assert d.create == "plan" and d.status["phase"] == "Planning" and d.status["stage"] == "plan 0/1"
    assert d.status["stats"] == {"samplesIn": 40, "samplesRejected": 4, "tokens": 4000}
    assert d.finished == {"convert": 300.0} and d.status["stageSeconds"] == {"convert": 300.0}
    assert d.status["percentDone"] == 44  # 4 of 9 indexes: convert 4, plan 1, materialize 4


def test_all_stages_done_is_succeeded_with_stats_and_digest() -> None:
    jobs = {
        "convert": job("convert", complete=True, succeeded=4),
        "plan": job("plan", complete=True, completions=1),
        "materialize": job("materialize", complete=True, succeeded=4),
    }
    pods = {
        "convert": convert_pods(),
        "plan": [pod(json.dumps(PLAN_SUMMARY))],
        "materialize": [
            pod(
                json.dumps(
                    {
                        "stage": "materialize",
                        "index": 0,
                        "count": 4,
                        "shards": 1,
                        "manifest": True,
                        "manifest_sha256": "ab" * 32,
                    }
                ),
                index=0,
            )
        ],
    }
    d = decide(jobs, pods, previous={"startTime": T0}, now=T2)
    s = d.status
    assert d.create is None and s["phase"] == "Succeeded" and s["stage"] == "done"
    assert (
        s["stats"]["samplesPacked"] == 36
        and s["stats"]["fillRatio"] == 0.9765
        and s["stats"]["sequences"] == 9
        and s["stats"]["rejectedByReason"] == {"overlong": 3, "missing_media": 1}
    )
    assert (s["claimName"], s["subPath"], s["percentDone"]) == ("packtrain-data", "packs/demo", 100)
    assert s["manifestDigest"] == "sha256:" + "ab" * 32
    assert s["startTime"] == T0 and s["completionTime"] == T2
    ready = cond(s, "Ready")
    assert (
        ready["status"] == "True"
        and ready["reason"] == "PackReady"
        and "/data/packs/demo" in ready["message"]
    )
    assert cond(s, "Succeeded")["status"] == "True"


def test_config_error_fails_with_an_actionable_reason() -> None:
    bad = pod(
        "Traceback ...\nConfigError: source.paths: no file matches /data/datasets/demo/*.jsonl",
        exit_code=2,
        index=1,
    )
    d = decide(
        {"convert": job("convert", failed="PodFailurePolicy"), "plan": None, "materialize": None},
        {"convert": [bad]},
    )
    assert d.create is None and d.status["phase"] == "Failed" and d.status["stage"] == "convert failed"
    failed = cond(d.status, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidConfiguration"
    assert "no file matches /data/datasets/demo/*.jsonl" in failed["message"]
    assert "delete and re-create" in failed["message"]


def test_config_error_reported_as_json_shows_the_error_text() -> None:
    report = json.dumps({"stage": "convert", "error": "source.paths: no file matches /x/*.jsonl"})
    d = decide(
        {"convert": job("convert", failed="PodFailurePolicy"), "plan": None, "materialize": None},
        {"convert": [pod(report, exit_code=2, index=0)]},
    )
    message = cond(d.status, "Failed")["message"]
    assert "in the convert stage: source.paths: no file matches /x/*.jsonl. Fix the spec" in message


def test_crash_names_index_exit_code_and_where_the_logs_are() -> None:
    d = decide(
        {"convert": job("convert", complete=True, succeeded=4), "plan": None, "materialize": None},
        {"convert": convert_pods()},
    )
    assert d.create == "plan"
    crash = pod("MemoryError\n", exit_code=137, index=None)
    d = decide(
        {
            "convert": job("convert", complete=True, succeeded=4),
            "plan": job("plan", failed="BackoffLimitExceeded", completions=1),
            "materialize": None,
        },
        {"plan": [crash]},
        previous=d.status,
    )
    failed = cond(d.status, "Failed")
    assert failed["reason"] == "PlanFailed"
    assert "exit code 137" in failed["message"] and "kubectl logs -n ml job/demo-plan" in failed["message"]
    assert d.status["stats"]["samplesIn"] == 40  # earlier stats survive


def test_job_failure_without_pods_uses_the_job_condition() -> None:
    d = decide({"convert": job("convert", failed="DeadlineExceeded"), "plan": None, "materialize": None})
    assert "DeadlineExceeded" in cond(d.status, "Failed")["message"]


def test_terminal_status_is_left_alone() -> None:
    prev = {"phase": "Succeeded", "stage": "done", "conditions": []}
    assert decide({"convert": None, "plan": None, "materialize": None}, previous=prev).status == prev


def test_condition_transition_time_moves_only_on_flip() -> None:
    conds = st.set_condition([], "Ready", False, "Converting", "a", T0)
    conds = st.set_condition(conds, "Ready", False, "Planning", "b", T1)
    assert conds[0]["lastTransitionTime"] == T0 and conds[0]["reason"] == "Planning"
    conds = st.set_condition(conds, "Ready", True, "PackReady", "c", T2, generation=3)
    assert conds[0]["lastTransitionTime"] == T2 and conds[0]["observedGeneration"] == 3


def test_termination_message_parsing() -> None:
    assert st.parse_summary('{"stage": "plan"}') == {"stage": "plan"}
    assert st.parse_summary("Traceback (most recent call last):") is None
    assert st.parse_summary("[1, 2]") is None and st.parse_summary("") is None
    t = st.terminated(pod("boom", exit_code=1, index=3), "packer")
    assert t == st.Terminated(1, "boom", "Error", 3)
    assert st.terminated(pod("x"), "other") is None
    assert (
        st.terminated(
            {"status": {"containerStatuses": [{"name": "packer", "state": {"running": {}}}]}}, "packer"
        )
        is None
    )


def test_job_state_reads_new_style_conditions() -> None:
    s = st.job_state(
        {
            "spec": {"completions": 2},
            "status": {"succeeded": 2, "conditions": [{"type": "SuccessCriteriaMet", "status": "True"}]},
        }
    )
    assert s.complete and not s.failed and (s.succeeded, s.total) == (2, 2)
    s = st.job_state(
        {
            "status": {
                "conditions": [{"type": "FailureTarget", "status": "True", "reason": "PodFailurePolicy"}]
            }
        }
    )
    assert s.failed and s.reason == "PodFailurePolicy"


# SFTJob


def test_data_readiness_says_what_it_waits_on() -> None:
    r = st.data_readiness("demo", None)
    assert not r.ready and r.reason == "PackJobNotFound" and "demo" in r.message
    r = st.data_readiness("demo", {"status": {"phase": "Planning", "stage": "plan 0/1"}})
    assert not r.ready and r.reason == "PackJobNotReady" and "Planning (plan 0/1)" in r.message
    failed = {
        "phase": "Failed",
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "InvalidConfiguration", "message": "bad paths"}
        ],
    }
    r = st.data_readiness("demo", {"status": failed})
    assert r.reason == "PackJobFailed" and "InvalidConfiguration: bad paths" in r.message
    assert st.data_readiness("demo", {"status": {"phase": "Succeeded", "outputPath": "/data/x"}}).ready


def test_waiting_status() -> None:
    s = st.waiting_status(1, st.data_readiness("demo", None), None, T0)
    SFTJobStatus.model_validate(s)
    assert s["phase"] == "WaitingForData"
    data = cond(s, "DataReady")
    assert data["status"] == "False" and data["reason"] == "PackJobNotFound"


def pytorchjob(*conds: tuple[str, str], replicas: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "demo-sft"},
        "status": {
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": f"{t} msg"} for t, r in conds
            ],
            "replicaStatuses": replicas or {},
        },
    }


def test_pytorchjob_states_mirror_into_the_sftjob() -> None:
    assert st.child_phase("PyTorchJob", pytorchjob())[0] == "Pending"
    assert st.child_phase("PyTorchJob", pytorchjob(("Created", "PyTorchJobCreated")))[0] == "Pending"
    running = pytorchjob(
        ("Created", "c"), ("Running", "PyTorchJobRunning"), replicas={"Master": {"active": 1}}
    )
    s = st.sft_status(1, "PyTorchJob", running, "/data/packs/demo", {"startTime": T0}, T1)
    SFTJobStatus.model_validate(s)
    assert s["phase"] == "Running" and s["replicaStatuses"] == {"Master": {"active": 1}}
    assert s["trainingJob"] == {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "demo-sft"}
    assert cond(s, "DataReady")["status"] == "True" and cond(s, "Ready")["reason"] == "PyTorchJobRunning"
    failed = pytorchjob(("Created", "c"), ("Failed", "PyTorchJobFailed"))
    s = st.sft_status(1, "PyTorchJob", failed, "/d", s, T2)
    assert s["phase"] == "Failed" and s["completionTime"] == T2
    assert (
        cond(s, "Failed")["reason"] == "PyTorchJobFailed"
        and "kubectl describe pytorchjob demo-sft" in cond(s, "Failed")["message"]
    )
    assert st.child_phase("PyTorchJob", pytorchjob(("Suspended", "JobSuspended")))[0] == "Suspended"
    assert st.child_phase("PyTorchJob", pytorchjob(("Running", "r"), ("Succeeded", "done")))[0] == "Succeeded"


def test_trainjob_states() -> None:
    tj = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "metadata": {"name": "x"},
        "status": {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]},
    }
    assert st.child_phase("TrainJob", tj)[0] == "Running"
    s = st.sft_status(1, "TrainJob", tj, "/d", None, T0)
    assert s["replicaStatuses"] == {"node": {"active": 2, "ready": 2}}
    tj["status"]["conditions"] = [{"type": "Complete", "status": "True", "reason": "JobsCompleted"}]
    assert st.child_phase("TrainJob", tj)[0] == "Succeeded"


def test_progress_from_the_trainer_summary() -> None:
    p = st.train_progress({"steps": 100, "final_loss": 1.25, "tokens_per_second": 5.0, "other": 1}, T2)
    assert p == {"step": 100, "loss": 1.25, "tokensPerSecond": 5.0, "updatedAt": T2}
    assert st.train_progress({"step": 100, "loss": 1.25}, T2) is None  # one spelling: the contract's
    assert st.train_progress({"unrelated": 1}, T2) is None and st.train_progress(None, T2) is None


def test_events_on_transitions_only() -> None:
    s = decide({"convert": None, "plan": None, "materialize": None}).status
    assert st.transition_event(None, None, s) == ("Normal", "Converting", "created Job demo-convert")
    assert st.transition_event("Converting", "Converting", s) is None
    failed = {
        "phase": "Failed",
        "conditions": [
            {"type": "Ready", "status": "False", "reason": "InvalidConfiguration", "message": "fix it"}
        ],
    }
    assert st.transition_event("Converting", "Converting", failed) == (
        "Warning",
        "InvalidConfiguration",
        "fix it",
    )
    waiting = st.waiting_status(1, st.data_readiness("demo", {"status": {"phase": "Failed"}}), None, T0)
    assert st.transition_event("WaitingForData", "PackJobNotReady", waiting)[0] == "Warning"


def unschedulable_pod() -> dict[str, Any]:
    return {
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": 'persistentvolumeclaim "packtrain-data" not found',
                }
            ],
        }
    }


def test_unschedulable_stage_pods_say_why() -> None:
    d = decide(
        {"convert": job("convert"), "plan": None, "materialize": None}, {"convert": [unschedulable_pod()]}
    )
    ready = cond(d.status, "Ready")
    assert d.status["phase"] == "Converting" and ready["reason"] == "Unschedulable"
    assert 'persistentvolumeclaim "packtrain-data" not found' in ready["message"]
    assert "claim packtrain-data exists" in ready["message"]


def test_unschedulable_training_pods_say_why() -> None:
    s = st.sft_status(
        1, "PyTorchJob", pytorchjob(("Created", "c")), "/d", None, T0, pods=[unschedulable_pod()]
    )
    assert s["phase"] == "Pending" and cond(s, "Ready")["reason"] == "Unschedulable"
    assert "spec.resources" in cond(s, "Ready")["message"]
