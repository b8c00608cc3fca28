"""The operator's deadlines on the real local control plane (tests/cluster), with an operator whose
deadlines are seconds: unschedulable and stalled stages, an SFTJob waiting for a PackJob that never
comes, and a training whose step stands still (Degraded, then Failed; restart-safe).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_operator import (
    CLAIM,
    DURATION,
    Operator,
    _free_port,
    condition,
    create,
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

pytestmark = pytest.mark.cluster


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
from packtrain.core.contract import TRAIN_STEP
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
