"""A PackJob reconciled by the operator against the real local control plane (tests/cluster).

The operator runs as a subprocess (`packtrain operator`, exactly what the chart's
Deployment runs) with a ServiceAccount token bound to `packtrain.operator.rbac.RULES`,
so a missing permission fails here. The controllers are real: the Job controller
creates pods, the scheduler puts them on the CPU/GPU pool, the node agent plays the
kubelet (simulating exits, or really running the packer with
`packtrain.dev/node-agent: run`). No training-operator runs, so the test moves the
PyTorchJob along by writing its status, as the training-operator would.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import pytest
from cluster_operator import (
    CLAIM,
    DURATION,
    EXIT_CODE,
    GROUP,
    VERSION,
    Operator,
    condition,
    create,
    custom,
    describe,
    events,
    get,
    jobs,
    packjob,
    phase,
    sftjob,
    stage_counts,
    wait_for,
)
from kubernetes import client

pytestmark = pytest.mark.cluster


def test_packjob_walks_its_stages(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    observed = stage_counts(operator)
    create(api, namespace, packjob("walk", count=2))
    seen: list[str] = []

    def done() -> bool:
        p = phase(api, namespace, "packjobs", "walk")
        if p and (not seen or seen[-1] != p):
            seen.append(p)
        return p in ("Succeeded", "Failed")

    wait_for("PackJob walk to finish", done, timeout=120, every=0.1)
    assert seen[-1] == "Succeeded", (seen, get(api, namespace, "packjobs", "walk")["status"])
    order = ["Converting", "Planning", "Materializing", "Succeeded"]
    assert [p for p in order if p in seen] == order, seen
    pj = get(api, namespace, "packjobs", "walk")
    assert pj["status"]["stage"] == "done" and pj["status"]["outputPath"] == "/data/packs/walk"
    assert condition(pj, "Ready")["status"] == "True"
    assert not pj["metadata"].get("finalizers"), "deleting a PackJob must not wait for the operator"
    children = {j.metadata.name: j for j in jobs(api, namespace, "walk")}
    assert sorted(children) == ["walk-convert", "walk-materialize", "walk-plan"]
    for job in children.values():
        owner = job.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "PackJob",
            "walk",
            pj["metadata"]["uid"],
            True,
        )
    assert children["walk-convert"].spec.completion_mode == "Indexed"
    pods = (
        client.CoreV1Api(api)
        .list_namespaced_pod(namespace, label_selector="packtrain.dev/packjob=walk")
        .items
    )
    assert len(pods) == 5 and {p.spec.node_name for p in pods} == {"cpu-0"}
    reasons = [e.reason for e in events(api, namespace, "walk")]
    assert {"Converting", "Planning", "Materializing", "PackReady"} <= set(reasons), reasons
    text = operator.metrics()
    assert 'packtrain_operator_reconciles_total{kind="PackJob"}' in text
    # One duration observation per stage of this pack, however many events each stage had.
    assert stage_counts(operator) == {stage: n + 1 for stage, n in observed.items()}
    assert {c["type"]: c["reason"] for c in pj["status"]["conditions"]} == {
        "Ready": "PackReady",
        "Created": "StageJobCreated",
        "Running": "Succeeded",
        "Suspended": "NotSuspended",
        "Succeeded": "PackReady",
        "Failed": "NoFailure",
        "Degraded": "AsExpected",
    }
    assert all(c["observedGeneration"] == 1 for c in pj["status"]["conditions"])
    assert pj["status"]["percentDone"] == 100 and set(pj["status"]["stageSeconds"]) == {
        "convert",
        "plan",
        "materialize",
    }
    for job in children.values():
        assert job.spec.ttl_seconds_after_finished == 86400


def test_config_error_fails_fast_with_a_warning(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    create(api, namespace, packjob("broken", count=2, annotations={EXIT_CODE: "2"}))
    wait_for(
        "PackJob broken to fail", lambda: phase(api, namespace, "packjobs", "broken") == "Failed", timeout=90
    )
    pj = get(api, namespace, "packjobs", "broken")
    failed = condition(pj, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "InvalidConfiguration"
    assert "Fix the spec" in failed["message"]
    batch = client.BatchV1Api(api)

    def failed_by_policy() -> bool:  # the Job controller may record it after the operator has read the pod
        job = batch.read_namespaced_job("broken-convert", namespace)
        return any(c.reason == "PodFailurePolicy" for c in job.status.conditions or [] if c.type == "Failed")

    wait_for("Job broken-convert to fail by its pod failure policy", failed_by_policy, timeout=60)
    job = batch.read_namespaced_job("broken-convert", namespace)
    assert (job.status.failed or 0) <= 2, "a config error must not be retried"
    # The operator posts its events in the background: on a busy machine the event may come after the
    # status it goes with.
    said = ("Warning", "InvalidConfiguration")
    wait_for(
        "the InvalidConfiguration Warning event",
        lambda: [e for e in events(api, namespace, "broken") if (e.type, e.reason) == said],
    )
    assert [j.metadata.name for j in jobs(api, namespace, "broken")] == ["broken-convert"]


def test_restart_mid_run_creates_no_duplicates(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    body = packjob("restart", count=2)
    body["spec"]["workers"]["podAnnotations"][DURATION] = "6"
    create(api, namespace, body)
    wait_for("convert to start", lambda: jobs(api, namespace, "restart"))
    uid = jobs(api, namespace, "restart")[0].metadata.uid
    operator.stop()
    try:
        time.sleep(8)  # convert finishes while no operator runs
    finally:
        operator.start()
    wait_for(
        "PackJob restart to succeed",
        lambda: phase(api, namespace, "packjobs", "restart") == "Succeeded",
        timeout=120,
    )
    children = {j.metadata.name: j for j in jobs(api, namespace, "restart")}
    assert sorted(children) == ["restart-convert", "restart-materialize", "restart-plan"]
    assert children["restart-convert"].metadata.uid == uid
    pods = (
        client.CoreV1Api(api)
        .list_namespaced_pod(namespace, label_selector="packtrain.dev/packjob=restart")
        .items
    )
    assert len(pods) == 5
    cms = client.CoreV1Api(api).list_namespaced_config_map(
        namespace, label_selector="packtrain.dev/packjob=restart"
    )
    assert [c.metadata.name for c in cms.items] == ["restart-pack-config"]
    # The restarted operator observed each stage of this pack once, and none of the packs finished before.
    assert stage_counts(operator) == {"convert": 1, "plan": 1, "materialize": 1}


@pytest.mark.parametrize("refusal", ["quota-403", "invalid-422"])
def test_a_child_the_api_server_refuses_fails_the_packjob_with_its_message(
    api: client.ApiClient, namespace: str, operator: Operator, refusal: str
) -> None:
    """The API server's own refusal: a ResourceQuota allowing no Jobs (403), or a Job it finds invalid
    (422)."""
    name = f"refused-{refusal[-3:]}"
    body = packjob(name, count=1)
    if refusal == "quota-403":
        client.CoreV1Api(api).create_namespaced_resource_quota(
            namespace, {"metadata": {"name": "no-jobs"}, "spec": {"hard": {"count/jobs.batch": "0"}}}
        )
        said = "exceeded quota: no-jobs"
    else:  # a request above its limit: valid for the CRD, refused by the Job's validation
        body["spec"]["workers"]["resources"] = {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}
        said = "must be less than or equal to cpu limit"
    create(api, namespace, body)
    wait_for(
        f"PackJob {name} to fail", lambda: phase(api, namespace, "packjobs", name) == "Failed", timeout=60
    )
    failed = condition(get(api, namespace, "packjobs", name), "Failed")
    code = refusal[-3:]
    assert failed["status"] == "True" and failed["reason"] == "ChildRefused", failed
    assert failed["message"].startswith(f"the API server refused to create Job {name}-convert ({code} "), (
        failed
    )
    assert said in failed["message"], failed
    warnings = wait_for(
        "the Warning event",
        lambda: [
            e for e in events(api, namespace, name) if e.type == "Warning" and e.reason == "ChildRefused"
        ],
    )
    assert said in warnings[0].message
    assert jobs(api, namespace, name) == []


def test_unschedulable_pods_are_explained(api: client.ApiClient, namespace: str, operator: Operator) -> None:
    body = packjob("stuck", count=1)
    body["spec"]["output"]["claimName"] = "no-such-claim"
    create(api, namespace, body)

    def reason() -> str | None:
        pj = get(api, namespace, "packjobs", "stuck")
        ready = [c for c in (pj.get("status") or {}).get("conditions", []) if c["type"] == "Ready"]
        return ready[0]["message"] if ready and ready[0]["reason"] == "Unschedulable" else None

    message = wait_for("the Unschedulable reason", reason, timeout=60)
    assert "no-such-claim" in message and "cannot be scheduled" in message
    # An SFTJob waiting on it says why the PackJob does not move, not only its phase.
    create(api, namespace, sftjob("stuck-sft", "stuck"))

    def data_message() -> str | None:
        sft = get(api, namespace, "sftjobs", "stuck-sft")
        data = [c for c in (sft.get("status") or {}).get("conditions", []) if c["type"] == "DataReady"]
        return data[0]["message"] if data and "Unschedulable" in data[0]["message"] else None

    said = wait_for("the PackJob's blocking reason on the SFTJob", data_message, timeout=60)
    assert (
        said.startswith("waiting for PackJob stuck: Converting (convert 0/1): Unschedulable: ")
        and "no-such-claim" in said
    )


def test_deleting_a_packjob_deletes_its_children(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    create(api, namespace, packjob("gone", count=1))
    wait_for("the convert Job", lambda: jobs(api, namespace, "gone"))
    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "packjobs", "gone")
    wait_for("the children to be garbage-collected", lambda: not jobs(api, namespace, "gone"), timeout=60)
    core = client.CoreV1Api(api)
    wait_for(
        "the ConfigMap to go",
        lambda: (
            not core.list_namespaced_config_map(namespace, label_selector="packtrain.dev/packjob=gone").items
        ),
        timeout=60,
    )


def test_a_packjob_recreated_under_its_name_waits_for_the_old_children(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    """Delete, then create again at once with another spec (Argo CD's Replace=true sync): the new PackJob
    adopts none of the old one's children while the garbage collector (kube-controller-manager's, real
    here) deletes them. A finalizer holds the old convert Job, so the wait lasts until the test lets go,
    not only the few milliseconds the collector takes."""
    hold = {"metadata": {"finalizers": ["packtrain.dev/test-hold"]}}
    old = create(api, namespace, packjob("again", count=1))
    wait_for("the old convert Job", lambda: jobs(api, namespace, "again"))
    batch = client.BatchV1Api(api)
    batch.patch_namespaced_job("again-convert", namespace, hold)
    wait_for(
        "the old convert to finish",
        lambda: phase(api, namespace, "packjobs", "again") in ("Planning", "Materializing", "Succeeded"),
    )
    custom(api).delete_namespaced_custom_object(
        GROUP, VERSION, namespace, "packjobs", "again", propagation_policy="Background"
    )
    new = create(api, namespace, packjob("again", count=2))
    old_uid, new_uid = old["metadata"]["uid"], new["metadata"]["uid"]
    assert new_uid != old_uid

    def waiting() -> dict[str, Any] | None:
        pj = get(api, namespace, "packjobs", "again")
        ready = [c for c in (pj.get("status") or {}).get("conditions", []) if c["type"] == "Ready"]
        return pj if ready and ready[0]["reason"] == "PreviousObjectBeingDeleted" else None

    pj = wait_for("the new PackJob to wait for the old Job", waiting)
    assert pj["status"]["phase"] == "Pending", pj["status"]
    assert condition(pj, "Ready")["message"] == (
        f"waiting for Job {namespace}/again-convert of the previous PackJob again (uid {old_uid}) to be "
        "deleted "
        "by the garbage collector (held by finalizers: packtrain.dev/test-hold); this PackJob (uid "
        f"{new_uid}) "
        "creates its own once it is gone"
    )
    time.sleep(3)  # events and rechecks come and go: still nothing of its own
    assert [(j.metadata.name, j.metadata.owner_references[0].uid) for j in jobs(api, namespace, "again")] == [
        ("again-convert", old_uid)
    ]
    assert phase(api, namespace, "packjobs", "again") == "Pending"
    describe(kube_cluster, namespace, "packjob", "again")

    batch.patch_namespaced_job("again-convert", namespace, {"metadata": {"finalizers": None}})
    wait_for(
        "PackJob again to succeed",
        lambda: phase(api, namespace, "packjobs", "again") == "Succeeded",
        timeout=120,
    )
    children = jobs(api, namespace, "again")
    assert sorted(j.metadata.name for j in children) == ["again-convert", "again-materialize", "again-plan"]
    assert {j.metadata.owner_references[0].uid for j in children} == {new_uid}
    convert = next(j for j in children if j.metadata.name == "again-convert")
    assert convert.spec.completions == 2  # the new spec's workers, not the old one's single worker
    cms = client.CoreV1Api(api).list_namespaced_config_map(
        namespace, label_selector="packtrain.dev/packjob=again"
    )
    assert [(c.metadata.name, c.metadata.owner_references[0].uid) for c in cms.items] == [
        ("again-pack-config", new_uid)
    ]


def test_a_packjob_whose_configmap_name_is_taken_fails_with_what_to_do(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    """A user's own ConfigMap under the name the PackJob gives its config: neither adopted nor overwritten."""
    core = client.CoreV1Api(api)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "taken-pack-config"}, "data": {"k": "v"}}
    )
    create(api, namespace, packjob("taken", count=1))
    wait_for("PackJob taken to fail", lambda: phase(api, namespace, "packjobs", "taken") == "Failed")
    failed = condition(get(api, namespace, "packjobs", "taken"), "Failed")
    assert failed["reason"] == "NameConflict", failed
    assert failed["message"].startswith(
        f"ConfigMap {namespace}/taken-pack-config already exists and is not this PackJob's (its owners: "
        "nothing)"
    ), failed
    assert "Delete or rename that ConfigMap" in failed["message"]
    assert jobs(api, namespace, "taken") == []
    assert core.read_namespaced_config_map("taken-pack-config", namespace).data == {"k": "v"}


def test_a_queued_packjob_starts_each_stage_suspended(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    """Created suspended with Kueue's label; what unsuspends it (Kueue admitting it) is played here by
    hand."""
    body = packjob("queued", count=1)
    body["spec"]["queueName"] = "cpu-queue"
    create(api, namespace, body)
    wait_for("the convert Job", lambda: jobs(api, namespace, "queued"))
    job = jobs(api, namespace, "queued")[0]
    assert job.spec.suspend is True and job.metadata.labels["kueue.x-k8s.io/queue-name"] == "cpu-queue"

    def suspended() -> dict[str, Any] | None:
        pj = get(api, namespace, "packjobs", "queued")
        c = [c for c in (pj.get("status") or {}).get("conditions", []) if c["type"] == "Suspended"]
        return c[0] if c and c[0]["status"] == "True" else None

    said = wait_for("Suspended=True", suspended)
    assert said["reason"] == "Queued" and "cpu-queue" in said["message"]
    assert condition(get(api, namespace, "packjobs", "queued"), "Running")["status"] == "False"
    batch = client.BatchV1Api(api)
    batch.patch_namespaced_job("queued-convert", namespace, {"spec": {"suspend": False}})
    wait_for("the plan Job, created suspended too", lambda: len(jobs(api, namespace, "queued")) == 2)
    assert batch.read_namespaced_job("queued-plan", namespace).spec.suspend is True


@pytest.mark.slow
def test_packjob_runs_the_real_packer(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator, shared_dir: Path
) -> None:
    """The node agent runs the pods' real commands: stats and digest come from the packer's termination
    messages."""
    body = packjob("real", count=2, annotations={"packtrain.dev/node-agent": "run"})
    body["spec"]["source"] = {"paths": [str(shared_dir / "datasets/llamafactory-mllm-demo/mllm_demo.json")]}
    body["spec"]["model"] = {"path": str(shared_dir / "models/qwen2-vl")}
    create(api, namespace, body)
    wait_for(
        "the real pack",
        lambda: phase(api, namespace, "packjobs", "real") in ("Succeeded", "Failed"),
        timeout=300,
        every=1,
    )
    pj = get(api, namespace, "packjobs", "real")
    assert pj["status"]["phase"] == "Succeeded", pj["status"]
    stats = pj["status"]["stats"]
    pods = (
        client.CoreV1Api(api)
        .list_namespaced_pod(namespace, label_selector="packtrain.dev/packjob=real")
        .items
    )
    terminated = [
        (
            p.metadata.name,
            p.metadata.annotations,
            [c.state.terminated for c in p.status.container_statuses or []],
        )
        for p in pods
    ]
    assert "samplesIn" in stats, (pj["status"], terminated)
    assert stats["samplesIn"] == stats["samplesPacked"] > 0 and 0 < stats["fillRatio"] <= 1
    assert stats["sequences"] >= 1 and stats["tokens"] > 0
    manifest = (
        Path(kube_cluster.root)
        / "node-agent"
        / "pvc"
        / namespace
        / CLAIM
        / "packs"
        / "real"
        / "manifest.json"
    )
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert pj["status"]["manifestDigest"] == f"sha256:{digest}"


@pytest.mark.slow
def test_a_pack_with_no_packed_sample_fails_and_names_the_reasons(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator, shared_dir: Path
) -> None:
    """The real packer rejects every sample (each is longer than maxLength): the PackJob fails NoSamples
    with the counts per reason, and an SFTJob on it says so instead of training on nothing."""
    body = packjob("empty", count=1, annotations={"packtrain.dev/node-agent": "run"})
    body["spec"]["source"] = {"paths": [str(shared_dir / "datasets/llamafactory-mllm-demo/mllm_demo.json")]}
    body["spec"]["model"] = {"path": str(shared_dir / "models/qwen2-vl")}
    body["spec"]["packing"] = {"maxLength": 16, "overlong": "drop"}
    create(api, namespace, body)
    create(api, namespace, sftjob("on-empty", "empty"))
    wait_for(
        "PackJob empty to fail",
        lambda: phase(api, namespace, "packjobs", "empty") == "Failed",
        timeout=300,
        every=1,
    )
    pj = get(api, namespace, "packjobs", "empty")
    failed = condition(pj, "Failed")
    assert failed["reason"] == "NoSamples", failed
    assert "no sample was packed" in failed["message"] and "overlong" in failed["message"]
    stats = pj["status"]["stats"]
    assert stats["samplesIn"] == stats["samplesRejected"] > 0 and stats["samplesPacked"] == 0
    assert stats["rejectedByReason"] == {"overlong": stats["samplesRejected"]}
    assert (pj["status"]["claimName"], pj["status"]["subPath"]) == (CLAIM, "packs/empty")
    assert [j.metadata.name for j in jobs(api, namespace, "empty")] == ["empty-convert", "empty-plan"]

    def waits_on_it() -> dict[str, Any] | None:
        c = condition(get(api, namespace, "sftjobs", "on-empty"), "DataReady")
        return c if c["reason"] == "PackJobFailed" else None

    said = wait_for("the SFTJob to name the failure", waits_on_it)
    assert "NoSamples" in said["message"]
    row = kube_cluster.kubectl("get", "pj", "empty", "-n", namespace).stdout
    print(row)
    text = describe(kube_cluster, namespace, "packjob", "empty")
    assert "NoSamples" in text and "Rejected By Reason" in text
