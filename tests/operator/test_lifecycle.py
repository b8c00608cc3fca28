"""Failures explained, bounded waits, conditions, queueing and the cached view, without a cluster."""

from __future__ import annotations

import copy
import json
import logging
from typing import Any

import pytest
from operator_fixtures import PACKJOB, SFTJOB
from test_status_mapping import T0, T1, T2, convert_pods, job, pod

from packtrain.core.contract import NO_SAMPLES, TOO_MANY_REJECTED, pack_outcome_error
from packtrain.operator import builders, logs, names
from packtrain.operator import status as st
from packtrain.operator.api import PackJobSpec, PackJobStatus, SFTJobSpec, SFTJobStatus
from packtrain.operator.deadlines import Deadlines
from packtrain.operator.settings import OperatorDefaults
from packtrain.operator.view import CachedKube

SPEC = PackJobSpec.model_validate(PACKJOB["spec"])
DEFAULTS = OperatorDefaults(packer_image="packer:test", trainer_image="trainer:test")
LATER = "2026-01-01T02:00:00Z"  # two hours after T0


def cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    found = st.get_condition(status["conditions"], type_)
    assert found is not None, type_
    return dict(found)


# The pods' contract


def test_a_pack_without_packed_samples_or_with_too_many_rejects_is_refused() -> None:
    none = pack_outcome_error(5, 0, {"overlong": 4, "missing_media": 1}, None)
    assert none is not None and none["reason"] == NO_SAMPLES
    assert "5 read, 5 rejected (top reasons: overlong 4, missing_media 1)" in none["error"]
    many = pack_outcome_error(10, 6, {"overlong": 3, "bad_image": 1}, 0.25)
    assert many is not None and many["reason"] == TOO_MANY_REJECTED
    assert "4 of 10 samples rejected (40.0%), over packing.maxRejectedFraction 0.25" in many["error"]
    assert pack_outcome_error(10, 8, {"overlong": 2}, 0.25) is None
    assert pack_outcome_error(10, 8, {"overlong": 2}, None) is None


def test_the_plans_reason_becomes_the_condition_and_its_counts_the_stats() -> None:
    refused = {
        "stage": "plan",
        "samples": 3,
        "packed": 0,
        "rejected": 3,
        "rejected_by_reason": {"overlong": 3},
        "reason": NO_SAMPLES,
        "error": "no sample was packed: 3 read, 3 rejected",
    }
    jobs = {
        "convert": job("convert", complete=True, succeeded=4),
        "plan": job("plan", failed="PodFailurePolicy", completions=1),
        "materialize": None,
    }
    d = st.pack_status(
        "demo", 1, SPEC, jobs, {"convert": convert_pods(), "plan": [pod(json.dumps(refused), 2)]}, None, T1
    )
    PackJobStatus.model_validate(d.status)
    failed = cond(d.status, "Failed")
    assert d.status["phase"] == "Failed" and failed["reason"] == "NoSamples"
    assert "no sample was packed" in failed["message"] and d.create is None
    assert d.status["stats"]["samplesRejected"] == 3 and d.status["stats"]["rejectedByReason"] == {
        "overlong": 3
    }
    assert st.transition_event(None, None, d.status)[:2] == ("Warning", "NoSamples")  # type: ignore[index]


# Conditions


def test_each_condition_says_its_own_thing() -> None:
    d = st.pack_status(
        "demo",
        3,
        SPEC,
        {"convert": job("convert", succeeded=1), "plan": None, "materialize": None},
        {},
        None,
        T1,
    )
    s = d.status
    assert cond(s, "Created")["reason"] == "StageJobCreated" and cond(s, "Created")["status"] == "True"
    assert cond(s, "Running") | {"lastTransitionTime": ""} == {
        "type": "Running",
        "status": "True",
        "reason": "Converting",
        "message": "Job demo-convert: 1/4 done",
        "lastTransitionTime": "",
        "observedGeneration": 3,
    }
    assert (cond(s, "Succeeded")["reason"], cond(s, "Failed")["reason"]) == ("NotFinished", "NoFailure")
    assert cond(s, "Suspended")["status"] == "False" and cond(s, "Degraded")["status"] == "False"
    assert s["percentDone"] == 11  # 1 of 9 indexes


def test_a_queued_stage_is_suspended_not_running() -> None:
    spec = SPEC.model_copy(update={"queue_name": "cpu-queue"})
    queued = job("convert")
    queued["spec"]["suspend"] = True
    s = st.pack_status(
        "demo", 1, spec, {"convert": queued, "plan": None, "materialize": None}, {}, None, T1
    ).status
    assert cond(s, "Suspended")["status"] == "True" and cond(s, "Suspended")["reason"] == "Queued"
    assert "cpu-queue" in cond(s, "Suspended")["message"]
    assert cond(s, "Running")["status"] == "False" and cond(s, "Running")["reason"] == "Queued"


# Lifecycle: a stage Job deleted after it finished (ttlSecondsAfterFinished) is not run again


def test_a_finished_stage_whose_job_is_gone_is_not_created_again() -> None:
    first = st.pack_status(
        "demo",
        1,
        SPEC,
        {"convert": job("convert", complete=True, succeeded=4), "plan": None, "materialize": None},
        {"convert": convert_pods()},
        None,
        T1,
    )
    assert first.create == "plan" and first.finished == {"convert": 300.0}
    later = st.pack_status(
        "demo",
        1,
        SPEC,
        {"convert": None, "plan": job("plan", completions=1), "materialize": None},
        {},
        first.status,
        T2,
    )
    assert later.create is None and later.status["phase"] == "Planning" and later.finished == {}
    assert later.status["stats"]["samplesIn"] == 40  # kept from before the pods went


# Bounded waits


def test_unschedulable_pods_turn_the_packjob_degraded_after_the_deadline() -> None:
    stuck = {
        "status": {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/2 nodes are available",
                }
            ]
        }
    }
    jobs = {"convert": job("convert"), "plan": None, "materialize": None}
    first = st.pack_status("demo", 1, SPEC, jobs, {"convert": [stuck]}, None, T0).status
    assert (
        first["blocked"] == {"reason": "Unschedulable", "since": T0}
        and cond(first, "Degraded")["status"] == "False"
    )
    later = st.pack_status("demo", 1, SPEC, jobs, {"convert": [stuck]}, first, LATER).status
    degraded = cond(later, "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "Unschedulable"
    assert "longer than the 1h deadline" in degraded["message"] and later["phase"] == "Converting"
    assert st.transition_event(first["phase"], st.event_reason(first), later)[:2] == (  # type: ignore[index]
        "Warning",
        "Unschedulable",
    )


def test_a_stage_without_progress_turns_degraded() -> None:
    jobs = {"convert": job("convert", succeeded=1), "plan": None, "materialize": None}
    first = st.pack_status("demo", 1, SPEC, jobs, {}, None, T0).status
    short = Deadlines(stall=600)
    assert (
        cond(st.pack_status("demo", 1, SPEC, jobs, {}, first, T1, short).status, "Degraded")["status"]
        == "False"
    )
    stalled = st.pack_status("demo", 1, SPEC, jobs, {}, first, LATER, short).status
    assert (
        cond(stalled, "Degraded")["reason"] == "StageStalled"
        and "convert 1/4" in cond(stalled, "Degraded")["message"]
    )
    moved = st.pack_status(
        "demo", 1, SPEC, {**jobs, "convert": job("convert", succeeded=2)}, {}, first, LATER, short
    )
    assert cond(moved.status, "Degraded")["status"] == "False" and moved.status["lastProgressTime"] == LATER


def test_an_sftjob_gives_up_on_a_missing_packjob_after_the_deadline_only() -> None:
    missing = st.data_readiness("demo", None)
    first = st.waiting_status(1, missing, None, T0)
    assert first["phase"] == "WaitingForData" and first["blocked"]["since"] == T0
    assert st.waiting_status(1, missing, first, T2)["phase"] == "WaitingForData"
    gave_up = st.waiting_status(1, missing, first, LATER, Deadlines(data_wait=3600))
    SFTJobStatus.model_validate(gave_up)
    assert gave_up["phase"] == "Failed" and cond(gave_up, "Failed")["reason"] == "PackJobNotFound"
    assert "gave up after 2h (deadline 1h)" in cond(gave_up, "Failed")["message"]
    # A PackJob that is still working does not count against the SFTJob.
    busy = st.waiting_status(
        1,
        st.data_readiness("demo", {"status": {"phase": "Converting"}}),
        first,
        LATER,
        Deadlines(data_wait=3600),
    )
    assert busy["phase"] == "WaitingForData" and "blocked" not in busy


def test_an_sftjob_waiting_on_a_packjob_quotes_its_blocking_reason() -> None:
    blocked = {
        "status": {
            "phase": "Converting",
            "stage": "convert 0/1",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "claim x not found",
                }
            ],
        }
    }
    said = st.data_readiness("demo", blocked)
    assert (
        said.message == "waiting for PackJob demo: Converting (convert 0/1): Unschedulable: claim x not found"
    )
    stalled = {
        "status": {
            "phase": "Planning",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "Planning",
                    "message": "Job demo-plan: 0/1 done",
                },
                {"type": "Degraded", "status": "True", "reason": "StageStalled", "message": "no progress"},
            ],
        }
    }
    assert st.data_readiness("demo", stalled).message.endswith("StageStalled: no progress")
    plain = {
        "status": {
            "phase": "Planning",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "Planning",
                    "message": "Job demo-plan: 0/1 done",
                }
            ],
        }
    }
    assert st.data_readiness("demo", plain).message == "waiting for PackJob demo: Planning"


# Failures explained


def trainer_pod(message: str, exit_code: int) -> dict[str, Any]:
    p = pod(message, exit_code, container="pytorch")
    p["metadata"]["name"] = "demo-sft-master-0"
    return p


def test_the_trainers_termination_message_explains_the_failed_sftjob() -> None:
    ptj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "demo-sft"},
        "status": {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]},
    }
    seen = st.pod_failure(
        trainer_pod(json.dumps({"error": "the pack holds 0 units but one step needs 2"}), 1), "pytorch", T1
    )
    assert seen is not None and seen["message"] == "the pack holds 0 units but one step needs 2"
    running = st.sft_status(1, "PyTorchJob", ptj, "/data/p", None, T1, failure_seen=seen)
    assert running["lastFailure"]["exitCode"] == 1
    ptj["status"]["conditions"] = [
        {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "Job demo-sft has failed because it has reached the backoff limit",
        }
    ]
    failed = st.sft_status(1, "PyTorchJob", ptj, "/data/p", running, T2)  # the pod is gone by now
    SFTJobStatus.model_validate(failed)
    c = cond(failed, "Failed")
    assert c["reason"] == "TrainerFailed"
    assert c["message"].startswith(
        "the trainer exited with code 1 in pod demo-sft-master-0: the pack holds 0 units"
    )
    assert "backoff limit" in c["message"]
    assert st.pod_failure(trainer_pod("{}", 0), "pytorch", T1) is None


def test_a_deleted_packjob_is_surfaced_on_a_running_sftjob() -> None:
    ptj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": "demo-sft"},
        "status": {"conditions": [{"type": "Running", "status": "True", "reason": "PyTorchJobRunning"}]},
    }
    s = st.sft_status(1, "PyTorchJob", ptj, "/data/p", None, T1, data_gone="PackJob demo was deleted")
    assert s["phase"] == "Running" and cond(s, "DataReady")["reason"] == "PackJobDeleted"
    assert st.transition_event("Running", "PyTorchJobRunning", s) == (
        "Warning",
        "PackJobDeleted",
        "PackJob demo was deleted",
    )


# Builders: queueing, TTL, the CPU pool


def test_queued_children_are_created_suspended_with_the_queue_label() -> None:
    spec = PackJobSpec.model_validate({**PACKJOB["spec"], "queueName": "cpu-queue"})
    stage = builders.pack_job("demo", "ml", spec, "convert", DEFAULTS)
    assert stage["spec"]["suspend"] is True and stage["metadata"]["labels"][names.QUEUE_LABEL] == "cpu-queue"
    assert "suspend" not in builders.pack_job("demo", "ml", SPEC, "convert", DEFAULTS)["spec"]
    sft = SFTJobSpec.model_validate(SFTJOB["spec"])
    data = builders.DataSource("c", "/data", "/data/p")
    assert builders.training_job("x", "ml", sft, data, DEFAULTS)["spec"]["runPolicy"]["suspend"] is True
    unqueued = sft.model_copy(update={"queue_name": None})
    assert builders.training_job("x", "ml", unqueued, data, DEFAULTS)["spec"]["runPolicy"]["suspend"] is False


def test_finished_jobs_ttl_and_deadlines_come_from_the_chart() -> None:
    env = {"PACKTRAIN_JOB_TTL_SECONDS": "600", "PACKTRAIN_DEADLINES": json.dumps({"stallSeconds": 60})}
    d = OperatorDefaults.from_env(env)
    assert d.job_ttl_seconds == 600 and d.deadlines == Deadlines(stall=60)
    assert builders.pack_job("demo", "ml", SPEC, "plan", d)["spec"]["ttlSecondsAfterFinished"] == 600
    kept = OperatorDefaults.from_env({"PACKTRAIN_JOB_TTL_SECONDS": "null"})
    assert "ttlSecondsAfterFinished" not in builders.pack_job("demo", "ml", SPEC, "plan", kept)["spec"]
    with pytest.raises(ValueError, match="unknown deadline"):
        OperatorDefaults.from_env({"PACKTRAIN_DEADLINES": json.dumps({"waitSeconds": 1})})
    with pytest.raises(ValueError, match="positive"):
        OperatorDefaults.from_env({"PACKTRAIN_DEADLINES": json.dumps({"stallSeconds": 0})})


def test_no_gpus_runs_on_the_cpu_pool() -> None:
    body = copy.deepcopy(SFTJOB["spec"])
    body["resources"] = {"nodes": 1, "gpusPerNode": 0}
    spec = SFTJobSpec.model_validate(body)
    ptj = builders.training_job("x", "ml", spec, builders.DataSource("c", "/data", "/data/p"), DEFAULTS)
    pod_spec = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"packtrain.dev/pool": "cpu"} and "tolerations" not in pod_spec
    # A trainer pod always has a memory limit (its request where none is set): a leak is an OOM kill.
    assert pod_spec["containers"][0]["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"memory": "2Gi"},
    }


# The cached view


class Store(list):  # type: ignore[type-arg]
    """What a kopf index holds under one key."""


def test_the_cached_view_reads_indexes_and_creates_a_child_once() -> None:
    class Api:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def create(self, body: dict[str, Any]) -> bool:
            self.calls.append(f"create {body['metadata']['name']}")
            return True

        def get(self, *args: Any) -> None:
            self.calls.append("get")

    api = Api()
    view = CachedKube(api, {})  # type: ignore[arg-type]
    stage = {
        "kind": "Job",
        "metadata": {"name": "demo-convert", "namespace": "ml", "uid": "u", "resourceVersion": "5"},
    }
    view.indexes = {
        "job_index": {},
        "pack_pod_index": {
            ("batch.kubernetes.io/job-name", "ml", "demo-convert"): Store([{"metadata": {"name": "p"}}])
        },
    }
    assert view.get("batch", "v1", "jobs", "ml", "demo-convert") is None and api.calls == []
    assert view.create(dict(stage)) is True and view.create(dict(stage)) is False
    assert api.calls == ["create demo-convert"]  # the second reconcile did not ask the API again
    assert view.get("batch", "v1", "jobs", "ml", "demo-convert") == stage  # until the watch shows it
    view.indexes = {**view.indexes, "job_index": {("ml", "demo-convert"): Store([{**stage, "status": {}}])}}
    assert view.get("batch", "v1", "jobs", "ml", "demo-convert") == {**stage, "status": {}}
    assert view.pods("ml", "batch.kubernetes.io/job-name=demo-convert") == [{"metadata": {"name": "p"}}]


# Logs


def test_log_lines_name_their_resource(capsys: pytest.CaptureFixture[str]) -> None:
    record = logging.LogRecord(
        "packtrain.operator", logging.INFO, __file__, 1, "created Job %s", ("x",), None
    )
    record.k8s_ref = logs.ref("PackJob", "team-a", "pack")["k8s_ref"]
    assert logs.TextFormatter("%(message)s").format(record) == "[PackJob team-a/pack] created Job x"
    from kopf._core.actions.loggers import ObjectJsonFormatter

    doc = json.loads(ObjectJsonFormatter(refkey="object").format(record))
    assert doc["object"] == {"kind": "PackJob", "namespace": "team-a", "name": "pack"}
    assert doc["message"] == "created Job x"
