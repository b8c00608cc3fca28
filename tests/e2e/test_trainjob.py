"""TrainJob for real: the quickstart with `backend: trainjob`, run by the Kubeflow Trainer v2 controller.

The Trainer v2 controller manager and the JobSet controller it drives are built from their Go
modules by tests/cluster/build.sh; the `torch-distributed` ClusterTrainingRuntime is applied from
the trainer module's manifests, unchanged. The SFTJob's TrainJob becomes a JobSet (Trainer), the
JobSet a Job (JobSet), the Job a pod (Kubernetes) that the node agent runs: the real chain.

JobSet's webhooks for JobSet objects are registered and called (its controller needs their
defaults); the Trainer's run unregistered, like the training-operator's (see ControlPlane), so its
TrainJob/runtime defaulting and validation webhooks are what stays untested.

The runtime is the cluster admin's and sets no security context, and a TrainJob cannot override
one (see the operator's TrainJob builder), so this namespace enforces the `baseline` Pod Security
Standard instead of `restricted`.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml
from cluster.controlplane import free_port
from e2e_harness import Harness, of_kind, quickstart_docs, table

pytestmark = pytest.mark.cluster

NS = "trainjob"
NAME = "quickstart"
TRAINER = ("trainer.kubeflow.org", "v1alpha1")
JOBSET = ("jobset.x-k8s.io", "v1alpha2")


def _quickstart() -> str:
    docs = quickstart_docs()
    sft = of_kind(docs, "SFTJob")
    sft["spec"]["backend"] = "trainjob"
    sft["spec"]["metricsPort"] = free_port()  # not the default: other runs on this machine may hold it
    return yaml.safe_dump_all(docs)


def _owner(obj: dict[str, Any]) -> tuple[str, str]:
    ref = next(r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller"))
    return ref["kind"], ref["name"]


def test_quickstart_runs_through_trainer_v2(e2e: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    e2e.cp.start_jobset()
    e2e.cp.start_trainer()
    runtime = e2e.custom.get_cluster_custom_object(*TRAINER, "clustertrainingruntimes", "torch-distributed")
    assert runtime["spec"]["mlPolicy"]["torch"], runtime["spec"]

    e2e.namespace_with_claims(NS)
    e2e.cp.kubectl("label", "namespace", NS, "--overwrite", "pod-security.kubernetes.io/enforce=baseline")
    t0 = time.monotonic()
    e2e.cp.kubectl("apply", "-n", NS, "-f", "-", input=_quickstart())
    assert e2e.wait_phase("packjobs", NS, NAME, ("Succeeded", "Failed"), 300) == "Succeeded", e2e.diagnostics(
        NS
    )
    assert e2e.wait_phase("sftjobs", NS, NAME, ("Succeeded", "Failed"), 480) == "Succeeded", e2e.diagnostics(
        NS
    )
    seconds = time.monotonic() - t0

    sftjob = e2e.get("sftjobs", NS, NAME)
    child = sftjob["status"]["trainingJob"]
    assert child["kind"] == "TrainJob", child
    trainjob = e2e.custom.get_namespaced_custom_object(*TRAINER, NS, "trainjobs", child["name"])
    assert _owner(trainjob) == ("SFTJob", NAME)
    assert trainjob["spec"]["runtimeRef"]["name"] == "torch-distributed"
    conditions = {c["type"]: c["status"] for c in trainjob["status"]["conditions"]}
    assert conditions.get("Complete") == "True", trainjob["status"]

    # Trainer made the JobSet, JobSet the Job, the Job the pod.
    jobset = e2e.custom.get_namespaced_custom_object(*JOBSET, NS, "jobsets", child["name"])
    assert _owner(jobset) == ("TrainJob", child["name"])
    jobs = [
        j
        for j in e2e.batch.list_namespaced_job(NS).items
        if j.metadata.owner_references and j.metadata.owner_references[0].kind == "JobSet"
    ]
    assert len(jobs) == 1 and jobs[0].status.succeeded == 1, [j.status for j in jobs]
    pods = e2e.core.list_namespaced_pod(
        NS, label_selector=f"batch.kubernetes.io/job-name={jobs[0].metadata.name}"
    ).items
    assert len(pods) == 1, [p.metadata.name for p in pods]
    pod = pods[0]
    container = next(c for c in pod.spec.containers if c.name == "node")
    env = {e.name: e.value for e in container.env or []}
    # Set by the Trainer's torch plugin, not by the operator.
    assert env.get("PET_NNODES") == "1" and env.get("PET_MASTER_ADDR"), env
    assert pod.spec.node_name == "cpu-0"  # the quickstart's gpusPerNode: 0 runs on the CPU pool
    assert pod.status.container_statuses[0].state.terminated.exit_code == 0

    progress = sftjob["status"]["progress"]
    max_steps = of_kind(quickstart_docs(), "SFTJob")["spec"]["training"]["maxSteps"]
    assert progress["step"] == max_steps and progress["loss"] > 0, sftjob["status"]

    rows = [
        ("controllers", "Trainer v2 controller manager + JobSet controller, built from their modules"),
        ("runtime", "ClusterTrainingRuntime torch-distributed from the trainer module's manifests"),
        (
            "chain",
            f"SFTJob → TrainJob {child['name']} → JobSet → Job {jobs[0].metadata.name} → pod "
            f"{pod.metadata.name} on {pod.spec.node_name}",
        ),
        ("TrainJob conditions", ", ".join(f"{k}={v}" for k, v in conditions.items())),
        ("steps / final loss", f"{progress['step']} / {progress['loss']:.4f}"),
        ("wall time (apply → SFTJob Succeeded)", f"{seconds:.0f} s"),
    ]
    with capsys.disabled():
        print("\n" + table(("quickstart with backend: trainjob", ""), rows))
