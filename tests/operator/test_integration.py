"""The operator against the real local control plane (tests/cluster).

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
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_operator import (
    CLAIM,
    DURATION,
    EXIT_CODE,
    GROUP,
    OPERATOR_NS,
    OPERATOR_SA,
    VERSION,
    Operator,
    _free_port,
    condition,
    create,
    custom,
    events,
    get,
    jobs,
    metric,
    packjob,
    phase,
    rejected,
    sftjob,
    stage_counts,
    wait_for,
)
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]


# Tests: the API server and the CRDs (no operator needed)


def test_crds_are_served_with_printer_columns(
    kube_cluster: Any, api: client.ApiClient, namespace: str
) -> None:
    create(api, namespace, packjob("cols"))
    header = kube_cluster.kubectl("get", "pj", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STAGE", "DONE%", "SAMPLES", "REJECTED", "FILL", "AGE"]
    body = sftjob("cols-sft", "cols")
    create(api, namespace, body)
    out = kube_cluster.kubectl("get", "sft", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "STEP", "MAX", "LOSS", "BACKEND", "NODES", "GPUS", "AGE"]
    assert out[1].split()[:4] == ["cols-sft", "pytorchjob", "2", "8"]  # no status yet: no operator here
    assert "cols" in kube_cluster.kubectl("get", "packtrain", "-n", namespace).stdout  # the category


def test_invalid_specs_are_rejected_with_clear_messages(api: client.ApiClient, namespace: str) -> None:
    body = packjob("bad")
    del body["spec"]["output"]
    assert "spec.output: Required value" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["workers"]["count"] = 0
    assert "spec.workers.count: Invalid value: 0" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["packing"]["algorithm"] = "best"
    assert 'spec.packing.algorithm: Unsupported value: "best"' in rejected(api, namespace, body)
    body = packjob("x" * 46)
    assert "metadata.name must be at most 45 characters" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["volumes"] = [{"name": "output", "claimName": "c", "mountPath": "/c"}]
    assert "volume names output, config, tmp are the operator's own" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["data"]["path"] = "/data/p"
    assert "spec.data needs exactly one of path" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["training"]["metricsPort"] = 9000
    assert "set spec.metricsPort, not spec.training.metricsPort" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["backend"] = "mpijob"
    assert 'spec.backend: Unsupported value: "mpijob"' in rejected(api, namespace, body)


def test_spec_changes_are_refused_except_suspend(api: client.ApiClient, namespace: str) -> None:
    create(api, namespace, packjob("frozen"))
    with pytest.raises(ApiException) as err:
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "packjobs", "frozen", {"spec": {"packing": {"maxLength": 8192}}}
        )
    assert err.value.status == 422
    assert "spec.packing is immutable: delete the PackJob and create it again" in err.value.body
    create(api, namespace, sftjob("frozen-sft", "frozen"))
    with pytest.raises(ApiException) as err:
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "sftjobs", "frozen-sft", {"spec": {"resources": {"nodes": 4}}}
        )
    assert "spec.resources is immutable" in err.value.body
    patched = custom(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "sftjobs", "frozen-sft", {"spec": {"suspend": True}}
    )
    assert patched["spec"]["suspend"] is True


def test_server_applies_the_model_defaults(api: client.ApiClient, namespace: str) -> None:
    created = create(api, namespace, packjob("defaults"))
    assert created["spec"]["packing"]["algorithm"] == "bfd"
    assert created["spec"]["output"]["mountPath"] == "/data"
    assert created["spec"]["source"]["fieldMap"]["images"] == "images"
    sft = create(api, namespace, sftjob("defaults-sft", "defaults"))
    assert sft["spec"]["backend"] == "pytorchjob" and sft["spec"]["training"]["maxGradNorm"] == 1.0


# Tests: the operator


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
    warnings = [e for e in events(api, namespace, "broken") if e.type == "Warning"]
    assert any(e.reason == "InvalidConfiguration" for e in warnings)
    assert [j.metadata.name for j in jobs(api, namespace, "broken")] == ["broken-convert"]


def test_sftjob_waits_for_its_packjob_then_creates_a_pytorchjob(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    create(api, namespace, sftjob("train", "later"))
    wait_for("SFTJob to wait for data", lambda: phase(api, namespace, "sftjobs", "train") == "WaitingForData")
    assert condition(get(api, namespace, "sftjobs", "train"), "DataReady")["reason"] == "PackJobNotFound"
    create(api, namespace, packjob("later", count=1))
    kf = client.CustomObjectsApi(api)

    def pytorchjob() -> dict[str, Any] | None:
        try:
            return dict(
                kf.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "train")
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    ptj = wait_for("the PyTorchJob", pytorchjob, timeout=120)
    assert phase(api, namespace, "packjobs", "later") == "Succeeded"
    sft = get(api, namespace, "sftjobs", "train")
    assert ptj["metadata"]["ownerReferences"][0]["uid"] == sft["metadata"]["uid"]
    assert ptj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 1
    container = replicas["Master"]["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert ptj["spec"]["nprocPerNode"] == "8"
    cm = client.CoreV1Api(api).read_namespaced_config_map("train-train-config", namespace)
    assert yaml.safe_load(cm.data["sftjob.yaml"])["spec"]["data"]["path"] == "/data/packs/later"

    # What the training-operator would report, mirrored into the SFTJob.
    def report(*conds: tuple[str, str]) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status = {
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "message": f"{t} now",
                    "lastTransitionTime": now,
                    "lastUpdateTime": now,
                }
                for t, r in conds
            ],
            "replicaStatuses": {"Master": {"active": 1}, "Worker": {"active": 1}},
        }
        kf.patch_namespaced_custom_object_status(
            "kubeflow.org", "v1", namespace, "pytorchjobs", "train", {"status": status}
        )

    report(("Created", "PyTorchJobCreated"), ("Running", "PyTorchJobRunning"))
    wait_for("SFTJob Running", lambda: phase(api, namespace, "sftjobs", "train") == "Running")
    sft = get(api, namespace, "sftjobs", "train")
    assert sft["status"]["replicaStatuses"]["Master"] == {"active": 1}
    assert sft["status"]["trainingJob"] == {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "name": "train",
    }
    custom(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "sftjobs", "train", {"spec": {"suspend": True}}
    )
    wait_for(
        "suspend to reach the PyTorchJob",
        lambda: (pytorchjob() or {})["spec"]["runPolicy"]["suspend"] is True,
    )
    report(("Created", "PyTorchJobCreated"), ("Succeeded", "PyTorchJobSucceeded"))
    wait_for("SFTJob Succeeded", lambda: phase(api, namespace, "sftjobs", "train") == "Succeeded")
    row = kube_cluster.kubectl("get", "sft", "train", "-n", namespace).stdout.splitlines()[1].split()
    assert row[:5] == ["train", "Succeeded", "pytorchjob", "2", "8"]


def test_trainjob_backend_is_accepted_by_the_trainer_crd(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    body = sftjob("tj", "unused")
    body["spec"].update(backend="trainjob", data={"path": "/data/packs/ready"})
    body["spec"]["volumes"]["data"] = {"claimName": CLAIM}
    create(api, namespace, body)
    kf = client.CustomObjectsApi(api)

    def trainjob() -> dict[str, Any] | None:
        try:
            return dict(
                kf.get_namespaced_custom_object(
                    "trainer.kubeflow.org", "v1alpha1", namespace, "trainjobs", "tj"
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    tj = wait_for("the TrainJob", trainjob, timeout=60)
    assert tj["spec"]["runtimeRef"]["name"] == "torch-distributed"
    assert tj["spec"]["trainer"]["numNodes"] == 2
    sft = wait_for(
        "the SFTJob to point at it",
        lambda: (get(api, namespace, "sftjobs", "tj").get("status") or {}).get("trainingJob"),
    )
    assert sft == {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": "tj"}


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


def test_operator_service_account_is_not_admin(kube_cluster: Any, operator: Operator) -> None:
    who = f"--as=system:serviceaccount:{OPERATOR_NS}:{OPERATOR_SA}"
    assert (
        kube_cluster.kubectl("auth", "can-i", "create", "jobs.batch", who, check=False).stdout.strip()
        == "yes"
    )
    for verb, resource in (
        ("delete", "jobs.batch"),
        ("get", "secrets"),
        ("create", "pods"),
        ("delete", "packjobs"),
    ):
        out = kube_cluster.kubectl("auth", "can-i", verb, resource, who, check=False).stdout.strip()
        assert out == "no", f"{verb} {resource}: {out}"


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


# Tests: failures explained, bounded waits, honest metrics, lifecycle, queueing


def describe(kube_cluster: Any, namespace: str, kind: str, name: str) -> str:
    """`kubectl describe`, as a user reads it (printed, so a run's log holds the transcript)."""
    out = kube_cluster.kubectl("describe", kind, name, "-n", namespace).stdout
    print(f"$ kubectl describe {kind} {name}\n{out}")
    return out


def report_pytorchjob(api: client.ApiClient, ns: str, name: str, *conds: tuple[str, str, str]) -> None:
    """What the training-operator would write: conditions (type, reason, message)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "conditions": [
            {
                "type": t,
                "status": "True",
                "reason": r,
                "message": m,
                "lastTransitionTime": now,
                "lastUpdateTime": now,
            }
            for t, r, m in conds
        ],
    }
    custom(api).patch_namespaced_custom_object_status(
        "kubeflow.org", "v1", ns, "pytorchjobs", name, {"status": status}
    )


def pytorchjob_of(api: client.ApiClient, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return dict(custom(api).get_namespaced_custom_object("kubeflow.org", "v1", ns, "pytorchjobs", name))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def test_a_failed_trainer_pod_is_explained_after_the_pod_is_gone(
    kube_cluster: Any, api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    """The trainer's own error reaches the SFTJob although its pod is deleted at once (as the
    training-operator deletes it), from the termination message the real trainer CLI wrote."""
    body = sftjob("boom", "unused")
    body["spec"]["data"] = {"path": "/data/packs/ready"}
    body["spec"]["volumes"]["data"] = {"claimName": CLAIM}
    del body["spec"]["queueName"]
    create(api, namespace, body)
    wait_for("the PyTorchJob", lambda: pytorchjob_of(api, namespace, "boom"))
    report_pytorchjob(api, namespace, "boom", ("Running", "PyTorchJobRunning", "PyTorchJob boom is running."))
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {
                "name": "boom-master-0",
                "labels": {"packtrain.dev/sftjob": "boom", "training.kubeflow.org/replica-type": "master"},
                "annotations": {"packtrain.dev/node-agent": "run"},
            },
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"packtrain.dev/pool": "cpu"},
                "containers": [
                    {
                        "name": "pytorch",
                        "image": "ghcr.io/packtrain/trainer:test",
                        # The real trainer entry point, given a config that is not there.
                        "command": [
                            "python",
                            "-m",
                            "packtrain.trainer",
                            "-c",
                            "/etc/packtrain/missing-sftjob.yaml",
                        ],
                        "env": [{"name": "PACKTRAIN_TERMINATION_LOG", "value": "/dev/termination-log"}],
                        "terminationMessagePolicy": "FallbackToLogsOnError",
                    }
                ],
            },
        },
    )
    wait_for(
        "the trainer pod to fail",
        lambda: core.read_namespaced_pod("boom-master-0", namespace).status.phase == "Failed",
        timeout=60,
    )
    core.delete_namespaced_pod("boom-master-0", namespace, grace_period_seconds=0)
    report_pytorchjob(
        api,
        namespace,
        "boom",
        (
            "Failed",
            "BackoffLimitExceeded",
            "Job boom has failed because it has reached the specified backoff limit",
        ),
    )
    wait_for("SFTJob boom to fail", lambda: phase(api, namespace, "sftjobs", "boom") == "Failed")
    sft = get(api, namespace, "sftjobs", "boom")
    failed = condition(sft, "Failed")
    assert failed["reason"] == "TrainerFailed", failed
    assert "exited with code 2 in pod boom-master-0: configuration error" in failed["message"], failed
    assert "missing-sftjob.yaml" in failed["message"] and "backoff limit" in failed["message"]
    assert sft["status"]["lastFailure"]["exitCode"] == 2
    warnings = wait_for(
        "the Warning event",
        lambda: [
            e for e in events(api, namespace, "boom") if e.type == "Warning" and e.reason == "TrainerFailed"
        ],
    )
    assert "missing-sftjob.yaml" in warnings[0].message
    text = describe(kube_cluster, namespace, "sftjob", "boom")
    assert "TrainerFailed" in text and "missing-sftjob.yaml" in text


def test_gauges_drop_deleted_jobs(api: client.ApiClient, namespace: str, operator: Operator) -> None:
    body = packjob("doomed", count=1)
    body["spec"]["workers"]["podAnnotations"][DURATION] = "60"
    create(api, namespace, body)
    wait_for("PackJob doomed to convert", lambda: phase(api, namespace, "packjobs", "doomed") == "Converting")
    converting = wait_for(
        "the gauge",
        lambda: metric(operator.metrics(), "packtrain_operator_jobs", kind="PackJob", phase="Converting"),
    )
    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "packjobs", "doomed")
    wait_for(
        "the deleted PackJob to leave the gauge",
        lambda: (
            metric(operator.metrics(), "packtrain_operator_jobs", kind="PackJob", phase="Converting")
            == converting - 1
        ),
    )


def test_a_packjob_deleted_under_a_running_sftjob_is_surfaced(
    api: client.ApiClient, namespace: str, operator: Operator
) -> None:
    create(api, namespace, packjob("src", count=1))
    body = sftjob("user", "src")
    del body["spec"]["queueName"]
    create(api, namespace, body)
    wait_for("the PyTorchJob", lambda: pytorchjob_of(api, namespace, "user"), timeout=120)
    report_pytorchjob(api, namespace, "user", ("Running", "PyTorchJobRunning", "running"))
    wait_for("SFTJob Running", lambda: phase(api, namespace, "sftjobs", "user") == "Running")
    custom(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, "packjobs", "src")

    def data() -> dict[str, Any] | None:
        c = condition(get(api, namespace, "sftjobs", "user"), "DataReady")
        return c if c["reason"] == "PackJobDeleted" else None

    said = wait_for("DataReady=False PackJobDeleted", data)
    assert said["status"] == "False" and "PackJob src was deleted" in said["message"]
    wait_for(
        "the Warning event",
        lambda: [
            e for e in events(api, namespace, "user") if e.type == "Warning" and e.reason == "PackJobDeleted"
        ],
    )
    assert phase(api, namespace, "sftjobs", "user") == "Running"  # the pack stays on the claim


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


# Seconds without a step before the strict operator fails a training: room for a restart in between.
TRAINING_STALL_FAIL = 60


@pytest.fixture
def strict_operator(operator: Operator, operator_kubeconfig: Path, tmp_path: Path) -> Iterator[Operator]:
    """The operator with deadlines of seconds, alone on the cluster while the test runs."""
    operator.stop()
    strict = Operator(
        operator_kubeconfig,
        tmp_path / "operator.log",
        env={
            "PACKTRAIN_DEADLINES": json.dumps(
                {
                    "dataWaitSeconds": 4,
                    "unschedulableSeconds": 4,
                    "stallSeconds": 4,
                    "trainingStallSeconds": 4,
                    "trainingStallFailSeconds": TRAINING_STALL_FAIL,
                }
            ),
            "PACKTRAIN_PROGRESS_INTERVAL": "1",  # the live progress scrape every second
        },
    )
    strict.start()
    try:
        yield strict
    finally:
        strict.stop()
        print(f"strict operator log:\n{strict.tail(40)}")
        operator.start()


def test_waits_are_bounded(
    kube_cluster: Any, api: client.ApiClient, namespace: str, strict_operator: Operator
) -> None:
    body = packjob("nowhere", count=1)
    body["spec"]["output"]["claimName"] = "no-such-claim"
    create(api, namespace, body)
    slow = packjob("slow", count=1)
    slow["spec"]["workers"]["podAnnotations"][DURATION] = "120"
    create(api, namespace, slow)
    create(api, namespace, sftjob("orphan", "never-created"))

    def degraded(name: str) -> dict[str, Any] | None:
        pj = get(api, namespace, "packjobs", name)
        c = [c for c in (pj.get("status") or {}).get("conditions", []) if c["type"] == "Degraded"]
        return c[0] if c and c[0]["status"] == "True" else None

    unschedulable = wait_for("Degraded: Unschedulable", lambda: degraded("nowhere"), timeout=60)
    assert unschedulable["reason"] == "Unschedulable" and "4s deadline" in unschedulable["message"]
    assert phase(api, namespace, "packjobs", "nowhere") == "Converting"  # an autoscaler may still place it
    stalled = wait_for("Degraded: StageStalled", lambda: degraded("slow"), timeout=60)
    assert stalled["reason"] == "StageStalled" and "convert 0/1" in stalled["message"]
    wait_for(
        "SFTJob orphan to give up", lambda: phase(api, namespace, "sftjobs", "orphan") == "Failed", timeout=60
    )
    failed = condition(get(api, namespace, "sftjobs", "orphan"), "Failed")
    assert failed["reason"] == "PackJobNotFound" and "gave up after" in failed["message"]
    # The deadlines passed in the operator's sweep, not in an event handler: their Events are posted too.
    for name, said in (("nowhere", "4s deadline"), ("slow", "4s deadline"), ("orphan", "gave up after")):
        wait_for(
            f"the Warning event of {name}",
            lambda name=name, said=said: [
                e for e in events(api, namespace, name) if e.type == "Warning" and said in e.message
            ],
        )
    describe(kube_cluster, namespace, "packjob", "nowhere")
    describe(kube_cluster, namespace, "sftjob", "orphan")


# A stand-in trainer: the real trainer's step gauge (its name from the contract) on a real prometheus_client
# server, advancing twice a second while the file named by argv[2] exists and standing still otherwise.
STEPPER = """
import os, sys, time
from prometheus_client import Gauge, start_http_server
from packtrain.packer.core.contract import TRAIN_STEP
port, go = int(sys.argv[1]), sys.argv[2]
step = Gauge(TRAIN_STEP, "Optimizer steps completed.", ["rank"])
start_http_server(port)
n = 0
while True:
    if os.path.exists(go):
        n += 1
        step.labels(rank="0").set(n)
    time.sleep(0.5)
"""


def running_sftjob(
    api: client.ApiClient,
    namespace: str,
    name: str,
    port: int,
    container: dict[str, Any],
    annotations: dict[str, str],
) -> None:
    """An SFTJob Running on a PyTorchJob whose master pod (owned by it, as the training-operator makes
    it) runs `container` on the node agent; the SFTJob's metrics port is `port`."""
    body = sftjob(name, "unused")
    body["spec"]["data"] = {"path": "/data/packs/ready"}
    body["spec"]["volumes"]["data"] = {"claimName": CLAIM}
    body["spec"]["metricsPort"] = port
    del body["spec"]["queueName"]
    create(api, namespace, body)
    child = wait_for(f"the PyTorchJob {name}", lambda: pytorchjob_of(api, namespace, name))
    report_pytorchjob(
        api, namespace, name, ("Running", "PyTorchJobRunning", f"PyTorchJob {name} is running.")
    )
    client.CoreV1Api(api).create_namespaced_pod(
        namespace,
        {
            "metadata": {
                "name": f"{name}-master-0",
                "labels": {"packtrain.dev/sftjob": name, "training.kubeflow.org/replica-type": "master"},
                "annotations": annotations,
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": name,
                        "uid": child["metadata"]["uid"],
                        "controller": True,
                    }
                ],
            },
            "spec": {
                "restartPolicy": "Never",
                "nodeSelector": {"packtrain.dev/pool": "cpu"},
                "containers": [{"name": "pytorch", "image": "ghcr.io/packtrain/trainer:test", **container}],
            },
        },
    )
    wait_for(f"SFTJob {name} Running", lambda: phase(api, namespace, "sftjobs", name) == "Running")


def test_a_training_whose_step_stands_still_is_degraded_then_failed(
    kube_cluster: Any, api: client.ApiClient, namespace: str, strict_operator: Operator, tmp_path: Path
) -> None:
    """The training-stall deadline (4 s here, failing after 60 s) against a trainer whose step stops.

    No real trainer runs: the master pod serves the trainer's step gauge from a real prometheus_client
    server (`STEPPER`) that the test lets advance and stops, and the operator scrapes it at the pod's
    IP as on a cluster. A second SFTJob's master pod serves nothing: it must say that it cannot see
    progress rather than call a stall, and is never failed for it.
    """
    go = tmp_path / "go"
    go.touch()
    port = _free_port()
    running_sftjob(
        api,
        namespace,
        "hangs",
        port,
        {"command": ["python", "-c", STEPPER, str(port), str(go)]},
        {"packtrain.dev/node-agent": "run"},
    )
    running_sftjob(api, namespace, "dark", _free_port(), {}, {DURATION: "900"})

    def sft(name: str) -> dict[str, Any]:
        return get(api, namespace, "sftjobs", name)

    def degraded(name: str, reason: str) -> dict[str, Any] | None:
        c = condition(sft(name), "Degraded")
        return c if (c["status"], c["reason"]) == ("True", reason) else None

    def progress() -> dict[str, Any]:
        return dict(sft("hangs")["status"].get("progress") or {})

    def warned(name: str, reason: str) -> list[Any]:
        return [e for e in events(api, namespace, name) if e.type == "Warning" and e.reason == reason]

    wait_for("live steps", lambda: progress().get("step", 0) >= 3, timeout=60)
    go.unlink()  # the step stands still from here
    stalled = wait_for("Degraded: TrainingStalled", lambda: degraded("hangs", "TrainingStalled"), timeout=60)
    still = progress()
    assert stalled["message"].startswith(
        f"training step {still['step']} has not advanced since {still['lastAdvanceTime']}, longer than the "
        "4s "
    )
    assert f"kubectl logs -n {namespace} hangs-master-0" in stalled["message"]
    assert "packtrain_train_data_wait_seconds" in stalled["message"]
    assert phase(api, namespace, "sftjobs", "hangs") == "Running"
    wait_for("the TrainingStalled Warning event", lambda: warned("hangs", "TrainingStalled"))
    describe(kube_cluster, namespace, "sftjob", "hangs")

    # Restart-safe: the clock is in the status, so a new operator process neither resets nor clears it.
    strict_operator.stop()
    strict_operator.start()
    wait_for("scrapes by the new process", lambda: progress()["updatedAt"] > still["updatedAt"], timeout=60)
    again = condition(sft("hangs"), "Degraded")
    assert progress()["lastAdvanceTime"] == still["lastAdvanceTime"]
    assert (again["status"], again["lastTransitionTime"]) == ("True", stalled["lastTransitionTime"])

    go.touch()  # training moves again: Degraded clears
    wait_for(
        "Degraded to clear", lambda: condition(sft("hangs"), "Degraded")["status"] == "False", timeout=60
    )
    assert condition(sft("hangs"), "Degraded")["reason"] == "AsExpected"
    go.unlink()  # ...and stops for good: Degraded, then Failed, the PyTorchJob deleted
    wait_for("Degraded again", lambda: degraded("hangs", "TrainingStalled"), timeout=60)
    wait_for(
        "SFTJob hangs Failed",
        lambda: phase(api, namespace, "sftjobs", "hangs") == "Failed",
        timeout=TRAINING_STALL_FAIL + 60,
        every=1,
    )
    failed = condition(sft("hangs"), "Failed")
    assert failed["reason"] == "TrainingStalled" and "Failed after 1m without a step" in failed["message"]
    wait_for("the PyTorchJob deleted", lambda: pytorchjob_of(api, namespace, "hangs") is None)
    core = client.CoreV1Api(api)
    wait_for(
        "its pod gone with it",
        lambda: not core.list_namespaced_pod(namespace, label_selector="packtrain.dev/sftjob=hangs").items,
        timeout=60,
    )
    assert len(warned("hangs", "TrainingStalled")) >= 2
    describe(kube_cluster, namespace, "sftjob", "hangs")

    # Nothing serves the other one's metrics: it says so, and runs on (the operator cannot tell a hang).
    dark = degraded("dark", "NoLiveProgress")
    assert dark is not None and dark["message"].startswith("no live progress: metrics endpoint http://127.")
    assert "could not be read" in dark["message"] and sft("dark")["status"]["scrapeError"]["since"]
    assert phase(api, namespace, "sftjobs", "dark") == "Running" and pytorchjob_of(api, namespace, "dark")
    assert warned("dark", "NoLiveProgress")
    describe(kube_cluster, namespace, "sftjob", "dark")


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


def test_api_requests_of_one_quickstart(
    kube_cluster: Any,
    api: client.ApiClient,
    namespace: str,
    operator: Operator,
    operator_kubeconfig: Path,
    tmp_path: Path,
) -> None:
    """What one quickstart (a PackJob of 2 workers, an SFTJob training on it) costs the API server,
    counted by a proxy between the operator and the API server; reads come from the watch cache."""
    from api_counter import ApiCounter

    counter = ApiCounter(kube_cluster.server, kube_cluster.pki_dir / "ca.crt").start()
    config = yaml.safe_load(operator_kubeconfig.read_text())
    config["clusters"][0]["cluster"] = {"server": f"http://127.0.0.1:{counter.port}"}
    proxied = tmp_path / "kubeconfig"
    proxied.write_text(yaml.safe_dump(config))
    operator.stop()
    counted = Operator(proxied, tmp_path / "operator.log")
    try:
        counted.start()
        time.sleep(3)  # startup: discovery, the initial lists, the watches
        startup = counter.reset()
        create(api, namespace, packjob("qs", count=2))
        body = sftjob("qs-sft", "qs")
        del body["spec"]["queueName"]
        create(api, namespace, body)
        wait_for("the PyTorchJob", lambda: pytorchjob_of(api, namespace, "qs-sft"), timeout=120)
        report_pytorchjob(api, namespace, "qs-sft", ("Running", "PyTorchJobRunning", "running"))
        wait_for("SFTJob Running", lambda: phase(api, namespace, "sftjobs", "qs-sft") == "Running")
        report_pytorchjob(api, namespace, "qs-sft", ("Succeeded", "PyTorchJobSucceeded", "done"))
        wait_for("SFTJob Succeeded", lambda: phase(api, namespace, "sftjobs", "qs-sft") == "Succeeded")
        time.sleep(3)  # late events (pods finishing, garbage) settle
        run = counter.reset()
    finally:
        counted.stop()
        counter.stop()
        operator.start()
    rows = "\n".join(f"  {n:4d}  {what}" for what, n in sorted(run.items(), key=lambda kv: -kv[1]))
    print(f"API requests: startup {sum(startup.values())}, one quickstart {sum(run.values())}\n{rows}")
    assert not any(
        what.startswith(("get ", "list ")) and "packjobs" in what or what.startswith("list pods")
        for what in run
    ), run
    assert sum(run.values()) < 60, rows
