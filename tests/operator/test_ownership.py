"""A parent re-created under the same name (Argo CD's Replace=true sync) must not adopt its predecessor's
children."""

from __future__ import annotations

import copy
from typing import Any

from test_handlers import FakeKube, sft_step, step

from packtrain.operator import names, ownership

OLD_UID = "0b1c2d3e-0000-4000-8000-00000000dead"


def _owned_by(kind: str, name: str, uid: str) -> list[dict[str, Any]]:
    return [
        {"apiVersion": "packtrain.dev/v1alpha1", "kind": kind, "name": name, "uid": uid, "controller": True}
    ]


def _child(kind: str, name: str, owners: list[dict[str, Any]] | None = None, **meta: Any) -> dict[str, Any]:
    return {
        "kind": kind,
        "metadata": {"name": name, "namespace": "ml", "ownerReferences": owners or [], **meta},
    }


def _previous(body: dict[str, Any]) -> dict[str, Any]:
    """The same manifest as an earlier object: same kind and name, another uid."""
    old = copy.deepcopy(body)
    old["metadata"]["uid"] = OLD_UID
    return old


def _condition(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == type_)


# The decision


def test_a_child_is_ours_only_by_uid(packjob: dict[str, Any]) -> None:
    uid = packjob["metadata"]["uid"]
    assert ownership.claim(_child("Job", "demo-convert", _owned_by("PackJob", "demo", uid)), packjob) is (
        ownership.Claim.OURS
    )
    assert ownership.claim(_child("Job", "demo-convert", _owned_by("PackJob", "demo", OLD_UID)), packjob) is (
        ownership.Claim.LEFTOVER
    )
    # Someone else's: no owner, another PackJob, another kind of the same name.
    assert ownership.claim(_child("Job", "demo-convert"), packjob) is ownership.Claim.FOREIGN
    assert ownership.claim(
        _child("Job", "demo-convert", _owned_by("PackJob", "other", OLD_UID)), packjob
    ) is (ownership.Claim.FOREIGN)
    assert ownership.claim(_child("Job", "demo-convert", _owned_by("SFTJob", "demo", OLD_UID)), packjob) is (
        ownership.Claim.FOREIGN
    )


def test_someone_elses_object_fails_before_a_leftover_waits(packjob: dict[str, Any]) -> None:
    leftover = _child(
        "Job",
        "demo-convert",
        _owned_by("PackJob", "demo", OLD_UID),
        deletionTimestamp="2026-11-30T22:00:00Z",
        finalizers=["example.com/hold"],
    )
    mine = _child("Job", "demo-plan", _owned_by("PackJob", "demo", packjob["metadata"]["uid"]))
    assert ownership.blocker(packjob, [None, mine]) is None
    wait = ownership.blocker(packjob, [leftover, mine, None])
    assert wait is not None and wait.waiting and wait.reason == "PreviousObjectBeingDeleted"
    assert wait.message == (
        f"waiting for Job ml/demo-convert of the previous PackJob demo (uid {OLD_UID}) to be deleted by the "
        f"garbage collector (held by finalizers: example.com/hold); this PackJob "
        f"(uid {packjob['metadata']['uid']}) creates its own once it is gone"
    )
    conflict = ownership.blocker(packjob, [leftover, _child("ConfigMap", "demo-pack-config")])
    assert conflict is not None and not conflict.waiting and conflict.reason == "NameConflict"
    assert conflict.message.startswith(
        "ConfigMap ml/demo-pack-config already exists and is not this PackJob's (its owners: nothing)"
    )
    assert "Delete or rename that ConfigMap, then delete and re-create the PackJob" in conflict.message


def test_pods_of_an_earlier_child_are_not_read_as_the_new_ones(packjob: dict[str, Any]) -> None:
    job = _child("Job", "demo-plan", uid="new-job")
    ours = {
        "metadata": {"name": "a", "ownerReferences": [{"kind": "Job", "uid": "new-job", "controller": True}]}
    }
    old = {
        "metadata": {
            "name": "b",
            "namespace": "ml",
            "ownerReferences": [{"kind": "Job", "name": "demo-plan", "uid": "old-job", "controller": True}],
        }
    }
    bare = {"status": {}}  # no owner to tell by: kept
    other_kind = {
        "metadata": {"name": "c", "ownerReferences": [{"kind": "JobSet", "uid": "x", "controller": True}]}
    }
    assert ownership.pods_of(job, [ours, old, bare, other_kind]) == [ours, bare, other_kind]
    assert ownership.leftover_pod(packjob, "Job demo-plan", [bare]) is None
    wait = ownership.leftover_pod(packjob, "Job demo-plan", [old])
    assert wait is not None and wait.waiting
    assert wait.message == (
        "waiting for pod ml/b of the previous Job demo-plan (uid old-job) to be deleted; "
        "this PackJob then creates its own Job demo-plan"
    )


# The reconcilers


def test_a_recreated_packjob_waits_for_the_old_jobs_then_runs_its_own_stages(packjob: dict[str, Any]) -> None:
    kube = FakeKube()
    old = _previous(packjob)
    step(kube, old)
    kube.objects[("jobs", "ml", "demo-convert")]["status"] = {
        "succeeded": 4,
        "conditions": [{"type": "Complete", "status": "True"}],
    }
    assert step(kube, old)["phase"] == "Planning"
    created_before = list(kube.created)
    packjob["spec"]["packing"]["maxLength"] = 8192  # the edit the replace carries

    status = step(kube, packjob)
    assert status["phase"] == "Pending" and kube.created == created_before  # neither skipped nor adopted
    ready = _condition(status, "Ready")
    assert ready["reason"] == "PreviousObjectBeingDeleted" and "Job ml/demo-convert" in ready["message"]
    assert _condition(status, "Created")["status"] == "False"
    assert step(kube, packjob) == status  # nothing moves while they are there

    del kube.objects[("jobs", "ml", "demo-convert")], kube.objects[("jobs", "ml", "demo-plan")]
    status = step(kube, packjob)  # the ConfigMap is still there, still the old PackJob's
    assert (
        status["phase"] == "Pending"
        and "ConfigMap ml/demo-pack-config" in _condition(status, "Ready")["message"]
    )
    assert kube.created == created_before

    del kube.objects[("configmaps", "ml", "demo-pack-config")]
    status = step(kube, packjob)
    assert status["phase"] == "Converting" and _condition(status, "Ready")["reason"] == "Converting"
    assert kube.created[len(created_before) :] == ["ConfigMap/demo-pack-config", "Job/demo-convert"]
    config = kube.objects[("configmaps", "ml", "demo-pack-config")]
    assert config["metadata"]["ownerReferences"][0]["uid"] == packjob["metadata"]["uid"]
    assert "maxLength: 8192" in next(iter(config["data"].values()))


def test_pods_of_the_old_stage_job_are_waited_for(packjob: dict[str, Any]) -> None:
    kube = FakeKube()
    kube.pod_list[f"{names.JOB_NAME_LABEL}=demo-convert"] = [
        {
            "metadata": {
                "name": "demo-convert-0-x",
                "namespace": "ml",
                "ownerReferences": [
                    {"kind": "Job", "name": "demo-convert", "uid": "old", "controller": True}
                ],
            }
        }
    ]
    status = step(kube, packjob)
    assert status["phase"] == "Pending" and kube.created == []
    assert (
        "pod ml/demo-convert-0-x of the previous Job demo-convert" in _condition(status, "Ready")["message"]
    )
    kube.pod_list.clear()
    assert step(kube, packjob)["phase"] == "Converting"


def test_someone_elses_configmap_fails_the_packjob_and_is_left_alone(packjob: dict[str, Any]) -> None:
    kube = FakeKube()
    theirs = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-pack-config", "namespace": "ml"},
        "data": {"mine": "yes"},
    }
    kube.put("configmaps", theirs)
    status = step(kube, packjob)
    assert status["phase"] == "Failed" and kube.created == []
    failed = _condition(status, "Failed")
    assert (
        failed["reason"] == "NameConflict"
        and "ConfigMap ml/demo-pack-config already exists" in failed["message"]
    )
    assert kube.objects[("configmaps", "ml", "demo-pack-config")] == theirs


def test_a_recreated_sftjob_waits_for_the_old_pytorchjob(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["data"] = {"path": "/data/packs/x"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    kube = FakeKube()
    old = _previous(sftjob)
    sft_step(kube, old)
    ptj = kube.objects[("pytorchjobs", "ml", "demo-sft")]
    ptj["status"] = {"conditions": [{"type": "Succeeded", "status": "True", "reason": "PyTorchJobSucceeded"}]}
    created_before = list(kube.created)

    status = sft_step(kube, sftjob)
    assert (
        status["phase"] == "Pending" and kube.created == created_before
    )  # not Succeeded with the old result
    assert "PyTorchJob ml/demo-sft of the previous SFTJob demo-sft" in _condition(status, "Ready")["message"]
    del kube.objects[("pytorchjobs", "ml", "demo-sft")]
    kube.pod_list[f"{names.SFTJOB_LABEL}=demo-sft"] = [
        {
            "metadata": {
                "name": "demo-sft-master-0",
                "namespace": "ml",
                "ownerReferences": [
                    {"kind": "PyTorchJob", "name": "demo-sft", "uid": "old-ptj", "controller": True}
                ],
            }
        }
    ]
    status = sft_step(kube, sftjob)
    assert (
        status["phase"] == "Pending" and "pod ml/demo-sft-master-0" in _condition(status, "Ready")["message"]
    )
    kube.pod_list.clear()
    del kube.objects[("configmaps", "ml", "demo-sft-train-config")]
    status = sft_step(kube, sftjob)
    assert kube.created[len(created_before) :] == ["ConfigMap/demo-sft-train-config", "PyTorchJob/demo-sft"]
    ptj = kube.objects[("pytorchjobs", "ml", "demo-sft")]
    assert ptj["metadata"]["ownerReferences"][0]["uid"] == sftjob["metadata"]["uid"]


def test_someone_elses_pytorchjob_fails_the_sftjob(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["data"] = {"path": "/data/packs/x"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    kube = FakeKube()
    kube.put(
        "pytorchjobs",
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "metadata": {"name": "demo-sft", "namespace": "ml"},
        },
    )
    status = sft_step(kube, sftjob)
    failed = _condition(status, "Failed")
    assert status["phase"] == "Failed" and failed["reason"] == "NameConflict" and kube.created == []
    assert failed["message"].startswith("PyTorchJob ml/demo-sft already exists and is not this SFTJob's")


def test_the_cached_view_remembers_a_create_only_for_the_same_owner(packjob: dict[str, Any]) -> None:
    """A child this process created for the previous PackJob moments ago does not stand in for the new
    one's."""
    from packtrain.operator.view import CachedKube

    api = FakeKube()
    view = CachedKube(api, {})  # type: ignore[arg-type]
    old_owner = _owned_by("PackJob", "demo", OLD_UID)
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "demo-pack-config", "namespace": "ml", "ownerReferences": old_owner},
    }
    assert view.create(copy.deepcopy(config)) is True
    assert view.create(copy.deepcopy(config)) is False and api.created == ["ConfigMap/demo-pack-config"]
    assert view.read(config) == config  # this process made it: no API read needed

    new = copy.deepcopy(config)
    new["metadata"]["ownerReferences"] = _owned_by("PackJob", "demo", packjob["metadata"]["uid"])
    assert view.create(copy.deepcopy(new)) is False  # asked the API: the old one is still there
    found = view.read(new)
    assert found is not None and ownership.claim(found, packjob) is ownership.Claim.LEFTOVER
    del api.objects[("configmaps", "ml", "demo-pack-config")]  # the garbage collector got to it
    assert view.read(new) is None
    assert view.create(copy.deepcopy(new)) is True
    assert (
        api.objects[("configmaps", "ml", "demo-pack-config")]["metadata"]["ownerReferences"][0]["uid"]
        == (packjob["metadata"]["uid"])
    )


def test_a_waiting_parent_is_rechecked_until_it_stops_waiting(packjob: dict[str, Any]) -> None:
    """A leftover ConfigMap's deletion brings no event (none is watched): the sweep loop looks again soon."""
    import kopf

    from packtrain.operator import handlers

    memo = kopf.Memo(leftovers=set())
    kube = FakeKube()
    kube.put(
        "configmaps",
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": "demo-pack-config",
                "namespace": "ml",
                "ownerReferences": _owned_by("PackJob", "demo", OLD_UID),
            },
        },
    )
    waiting = step(kube, packjob)
    handlers.common._track_leftovers(memo, "packjobs", packjob["metadata"], waiting)
    assert memo.leftovers == {("packjobs", "ml", "demo")}
    del kube.objects[("configmaps", "ml", "demo-pack-config")]
    handlers.common._track_leftovers(memo, "packjobs", packjob["metadata"], step(kube, packjob))
    assert memo.leftovers == set()
