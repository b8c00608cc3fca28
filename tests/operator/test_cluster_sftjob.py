"""An SFTJob reconciled by the operator on the real local control plane (tests/cluster): it waits for its
PackJob, creates the training job of its backend, mirrors its status, and explains a failed trainer pod
or a PackJob deleted under it. No training-operator runs: the tests write the PyTorchJob's status.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from cluster_operator import (
    CLAIM,
    GROUP,
    VERSION,
    Operator,
    condition,
    create,
    custom,
    describe,
    events,
    get,
    packjob,
    phase,
    pytorchjob_of,
    report_pytorchjob,
    sftjob,
    wait_for,
)
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster


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
