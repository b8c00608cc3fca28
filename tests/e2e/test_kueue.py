"""Queueing for real: Kueue's own controller admits packtrain's Jobs against a ClusterQueue's quota.

Kueue's controller manager is built from its Go module by tests/cluster/build.sh and runs as the
training-operator does here, with its admission webhooks unregistered (see ControlPlane). That
leaves untested only what the webhooks do: Kueue's defaulting (suspending a queued Job as it is
created; the operator creates queued children suspended itself, so nothing relies on it) and
Kueue's validation of Jobs, queues and workloads (the CRD schemas still apply).

Two PackJobs on one LocalQueue whose ClusterQueue has quota for one stage pod: the second
PackJob's stage Job waits (suspended, its Workload pending on quota) while the first runs, then
runs when quota frees; no two admitted stage pods ever run at once. An SFTJob on a second queue
shows the PyTorchJob path: created suspended, admitted by Kueue, run by the training-operator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml
from cluster.controlplane import free_port
from e2e_harness import Background, Harness, of_kind, quickstart_docs, table, wait_for

pytestmark = pytest.mark.cluster

KUEUE = ("kueue.x-k8s.io", "v1beta2")
NS = "queued"
POD_REQUESTS = {"cpu": "500m", "memory": "768Mi"}
PACKS = ("pack-a", "pack-b")


def _packjob(name: str) -> dict[str, Any]:
    """A small text-only pack on the `packs` queue: one stage pod at a time, with fixed requests."""
    return {
        "apiVersion": "packtrain.dev/v1alpha1",
        "kind": "PackJob",
        "metadata": {"name": name},
        "spec": {
            "queueName": "packs",
            "source": {"paths": ["../shared/datasets/text-sft/fastchat/*.json"]},
            "model": {"family": "qwen2-vl", "path": "../shared/models/qwen2-vl"},
            "packing": {"maxLength": 1024, "sequencesPerShard": 64},
            "output": {"claimName": "packtrain-data"},
            "workers": {"count": 1, "resources": {"requests": POD_REQUESTS, "limits": {"memory": "2Gi"}}},
        },
    }


def _queues() -> list[dict[str, Any]]:
    group, version = KUEUE
    api = f"{group}/{version}"

    def cluster_queue(name: str, cpu: str, memory: str) -> dict[str, Any]:
        return {
            "apiVersion": api,
            "kind": "ClusterQueue",
            "metadata": {"name": name},
            "spec": {
                "namespaceSelector": {},
                "resourceGroups": [
                    {
                        "coveredResources": ["cpu", "memory"],
                        "flavors": [
                            {
                                "name": "default",
                                "resources": [
                                    {"name": "cpu", "nominalQuota": cpu},
                                    {"name": "memory", "nominalQuota": memory},
                                ],
                            }
                        ],
                    }
                ],
            },
        }

    def local_queue(name: str) -> dict[str, Any]:
        return {
            "apiVersion": api,
            "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"clusterQueue": name},
        }

    return [
        {"apiVersion": api, "kind": "ResourceFlavor", "metadata": {"name": "default"}, "spec": {}},
        # Quota for exactly one stage pod.
        cluster_queue("packs", POD_REQUESTS["cpu"], POD_REQUESTS["memory"]),
        local_queue("packs"),
        cluster_queue("training", "64", "256Gi"),
        local_queue("training"),
    ]


@dataclass
class QueueWatch(Background):
    """Polls the namespace's Workloads and pods while the run goes on."""

    h: Harness
    max_running_pods: int = 0
    pending_on_quota: dict[str, str] = field(default_factory=dict)  # workload -> message, while another ran
    admitted_order: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def _run(self) -> None:
        group, version = KUEUE
        while not self._stop.wait(0.3):
            try:
                workloads = self.h.custom.list_namespaced_custom_object(group, version, NS, "workloads")[
                    "items"
                ]
                pods = self.h.core.list_namespaced_pod(
                    NS, label_selector="app.kubernetes.io/component!=training"
                ).items
            except Exception as e:  # a failed poll is recorded, the next one tries again
                self.errors.append(repr(e))
                continue
            running = [p for p in pods if p.status.phase == "Running"]
            self.max_running_pods = max(self.max_running_pods, len(running))
            admitted = []
            for w in workloads:
                name = w["metadata"]["name"]
                conds = {c["type"]: c for c in (w.get("status") or {}).get("conditions", [])}
                if conds.get("Admitted", {}).get("status") == "True" and "Finished" not in conds:
                    admitted.append(name)
                    if name not in self.admitted_order:
                        self.admitted_order.append(name)
            for w in workloads:
                name = w["metadata"]["name"]
                reserved = {c["type"]: c for c in (w.get("status") or {}).get("conditions", [])}.get(
                    "QuotaReserved"
                )
                if (
                    admitted
                    and name not in admitted
                    and reserved
                    and reserved["status"] == "False"
                    and "quota" in reserved.get("message", "")
                ):
                    self.pending_on_quota.setdefault(name, reserved["message"])


def _workload_owner(w: dict[str, Any]) -> tuple[str, str]:
    ref = w["metadata"]["ownerReferences"][0]
    return ref["kind"], ref["name"]


def test_second_job_waits_for_quota_then_runs(e2e: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    e2e.cp.start_kueue()
    e2e.namespace_with_claims(NS)
    e2e.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(_queues()))
    group, version = KUEUE
    wait_for(
        "the LocalQueues to be active",
        lambda: all(
            any(
                c["type"] == "Active" and c["status"] == "True"
                for c in (q.get("status") or {}).get("conditions", [])
            )
            for q in e2e.custom.list_namespaced_custom_object(group, version, NS, "localqueues")["items"]
        ),
        timeout=60,
    )

    t0 = time.monotonic()
    with QueueWatch(e2e) as watch:
        e2e.cp.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump_all([_packjob(n) for n in PACKS]))

        # Every stage Job carries the queue label (the operator creates it suspended: Kueue admits it).
        def convert_jobs() -> list[Any] | None:
            jobs = [
                j for j in e2e.batch.list_namespaced_job(NS).items if j.metadata.name.endswith("-convert")
            ]
            return jobs if len(jobs) == len(PACKS) else None

        first_jobs = wait_for(
            "both convert Jobs", convert_jobs, timeout=120, diagnostics=lambda: e2e.diagnostics(NS)
        )
        for job in first_jobs:
            assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == "packs", job.metadata.labels
        for name in PACKS:
            phase = e2e.wait_phase("packjobs", NS, name, ("Succeeded", "Failed"), 600)
            assert phase == "Succeeded", e2e.diagnostics(NS)
    seconds = time.monotonic() - t0
    assert len(watch.errors) < 5, watch.errors  # a transient failed poll is fine, a broken watch is not

    workloads = e2e.custom.list_namespaced_custom_object(group, version, NS, "workloads")["items"]
    owners = {w["metadata"]["name"]: _workload_owner(w) for w in workloads}
    assert {kind for kind, _ in owners.values()} == {"Job"}, owners
    # Kueue admitted every stage Job of both packs, through the `packs` ClusterQueue.
    for w in workloads:
        admission = (w.get("status") or {}).get("admission") or {}
        assert admission.get("clusterQueue") == "packs", w
    # One admitted at a time: the quota holds one stage pod, so a second Job waited on quota...
    assert watch.pending_on_quota, (
        f"no Workload was ever seen pending on quota; admitted: {watch.admitted_order}"
    )
    waited = {owners[w][1] for w in watch.pending_on_quota if w in owners}
    assert waited, watch.pending_on_quota
    # ...and then ran: each of the waiting Jobs was admitted later and succeeded.
    for name in waited:
        job = e2e.batch.read_namespaced_job(name, NS)
        assert job.status.succeeded == 1 and not job.spec.suspend, (name, job.status)
    assert watch.max_running_pods == 1, (
        f"{watch.max_running_pods} stage pods ran at once under a one-pod quota"
    )

    rows = [
        ("Kueue", "sigs.k8s.io/kueue controller manager, built from its module"),
        ("stage Jobs admitted through ClusterQueue packs", str(len(workloads))),
        ("admission order", ", ".join(owners[w][1] for w in watch.admitted_order if w in owners)),
        ("Jobs that waited on quota", ", ".join(sorted(waited))),
        ("a pending Workload's message", next(iter(watch.pending_on_quota.values()))),
        ("most stage pods running at once", str(watch.max_running_pods)),
        ("wall time (apply → both PackJobs Succeeded)", f"{seconds:.0f} s"),
    ]
    with capsys.disabled():
        print("\n" + table(("Kueue admission (two PackJobs, quota for one pod)", ""), rows))


def test_queued_sftjob_runs_once_kueue_admits_its_pytorchjob(e2e: Harness) -> None:
    """The SFTJob's PyTorchJob is created suspended with the queue label; Kueue admits it; it trains.

    It trains on the first test's pack.
    """
    docs = quickstart_docs()
    sft = of_kind(docs, "SFTJob")
    sft["metadata"]["name"] = "queued-sft"
    sft["spec"]["data"]["packJobRef"] = PACKS[0]
    sft["spec"]["queueName"] = "training"
    sft["spec"]["training"].update(maxSteps=4, checkpointEvery=4)
    sft["spec"]["metricsPort"] = free_port()
    e2e.cp.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(sft))
    child = wait_for(
        "the PyTorchJob",
        lambda: (e2e.get("sftjobs", NS, "queued-sft").get("status") or {}).get("trainingJob", {}).get("name"),
        timeout=120,
        diagnostics=lambda: e2e.diagnostics(NS),
    )
    pj = e2e.custom.get_namespaced_custom_object("kubeflow.org", "v1", NS, "pytorchjobs", child)
    assert pj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "training"
    assert e2e.wait_phase("sftjobs", NS, "queued-sft", ("Succeeded", "Failed"), 480) == "Succeeded", (
        e2e.diagnostics(NS)
    )
    group, version = KUEUE
    workloads = e2e.custom.list_namespaced_custom_object(group, version, NS, "workloads")["items"]
    mine = [w for w in workloads if _workload_owner(w) == ("PyTorchJob", child)]
    assert len(mine) == 1, [w["metadata"]["name"] for w in workloads]
    status = mine[0]["status"]
    assert status["admission"]["clusterQueue"] == "training", status
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds.get("Admitted") == "True" or conds.get("Finished") == "True", status
