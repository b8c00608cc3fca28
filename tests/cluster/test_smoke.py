"""Smoke tests of the local control plane: real API server, controllers, scheduler and node agent."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from . import waiting
from .controlplane import BUILD_SCRIPT, ControlPlane

pytestmark = pytest.mark.cluster


# Pods here wait on the real scheduler and controllers: 90 s unless a test says otherwise.
wait_for = partial(waiting.wait_for, timeout=90, every=0.5)


@pytest.fixture
def api(kube_cluster: ControlPlane) -> Iterator[client.ApiClient]:
    with kube_cluster.api_client() as api_client:
        yield api_client


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def test_server_reports_its_real_version(kube_cluster: ControlPlane, api: client.ApiClient) -> None:
    m = re.search(r"^K8S_VERSION=(\S+)$", BUILD_SCRIPT.read_text(), re.M)
    assert m, "K8S_VERSION not found in build.sh"
    info = client.VersionApi(api).get_code()
    assert info.git_version == m.group(1) == kube_cluster.server_version
    assert (info.major, info.minor) == tuple(m.group(1).lstrip("v").split(".")[:2])
    assert info.git_tree_state == "clean"
    client_version = kube_cluster.kubectl("version", "--client", "-o", "json").stdout
    assert f'"gitVersion": "{m.group(1)}"' in client_version


def test_namespace_and_configmap_round_trip(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    assert core.read_namespace(namespace).status.phase == "Active"
    data = {"config.yaml": "a: 1\nb: [x, y]\n", "empty": ""}
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cm", "labels": {"t": "smoke"}}, "data": data}
    )
    got = core.read_namespaced_config_map("cm", namespace)
    assert got.data == data
    assert got.metadata.labels == {"t": "smoke"}
    assert [
        c.metadata.name for c in core.list_namespaced_config_map(namespace, label_selector="t=smoke").items
    ] == ["cm"]


def _ready_nodes(core: client.CoreV1Api) -> dict[str, Any] | None:
    """The nodes once the node lifecycle controller has lifted its `not-ready` taint, which it puts
    on every node it sees before that node's agent has reported Ready."""
    nodes = {n.metadata.name: n for n in core.list_node().items}
    lifecycle = [
        n for n in nodes.values() for t in n.spec.taints or () if t.key.startswith("node.kubernetes.io/")
    ]
    return None if lifecycle else nodes


def test_nodes_carry_the_chart_pool_labels_and_taints(api: client.ApiClient) -> None:
    nodes = waiting.wait_for("the nodes to be Ready", partial(_ready_nodes, client.CoreV1Api(api)))
    cpu, gpu = nodes["cpu-0"], nodes["gpu-0"]
    assert cpu.metadata.labels["packtrain.dev/pool"] == "cpu"
    assert not cpu.spec.taints
    assert cpu.status.capacity["cpu"] == "16" and cpu.status.capacity["memory"] == "64Gi"
    assert gpu.metadata.labels["packtrain.dev/pool"] == "gpu"
    assert [(t.key, t.value, t.effect) for t in gpu.spec.taints] == [
        ("nvidia.com/gpu", "present", "NoSchedule")
    ]
    assert gpu.status.allocatable["nvidia.com/gpu"] == "8"


def indexed_job(
    name: str,
    completions: int,
    container: dict[str, Any],
    pod_meta: dict[str, Any] | None = None,
    pod_spec: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": completions,
            "parallelism": completions,
            "backoffLimit": 0,
            "template": {
                "metadata": pod_meta or {},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": "busybox", **container}],
                    **(pod_spec or {}),
                },
            },
        },
    }


def job_condition(batch: client.BatchV1Api, name: str, namespace: str) -> str | None:
    job = batch.read_namespaced_job(name, namespace)
    for c in job.status.conditions or []:
        if c.type in ("Complete", "Failed") and c.status == "True":
            return str(c.type)
    return None


def job_pods(core: client.CoreV1Api, name: str, namespace: str) -> list[Any]:
    return list(core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items)


def test_indexed_job_runs_to_complete(api: client.ApiClient, namespace: str) -> None:
    """Job controller creates the pods, the scheduler binds them to the CPU pool, the agent completes them."""
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    job = indexed_job(
        "idx", 3, {"command": ["true"]}, pod_spec={"nodeSelector": {"packtrain.dev/pool": "cpu"}}
    )
    batch.create_namespaced_job(namespace, job)
    assert wait_for("Job idx to finish", lambda: job_condition(batch, "idx", namespace)) == "Complete"
    status = batch.read_namespaced_job("idx", namespace).status
    assert status.succeeded == 3 and status.completed_indexes == "0-2"
    pods = job_pods(core, "idx", namespace)
    assert sorted(p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods) == [
        "0",
        "1",
        "2",
    ]
    for p in pods:
        assert p.spec.node_name == "cpu-0"
        assert p.status.phase == "Succeeded"
        assert p.status.container_statuses[0].state.terminated.exit_code == 0


def test_node_agent_really_runs_commands(api: client.ApiClient, namespace: str) -> None:
    """In run mode the container command executes locally, with the pod's env and termination message."""
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    script = (
        "import os, sys; idx = os.environ['JOB_COMPLETION_INDEX']; "
        "open('/dev/termination-log', 'w').write(f'index {idx} of {os.environ[\"GREETING\"]}'); "
        "sys.exit(int(idx))"
    )
    container = {"command": ["python", "-c", script], "env": [{"name": "GREETING", "value": "hello"}]}
    gpu = {
        "nodeSelector": {"packtrain.dev/pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    container["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    job = indexed_job(
        "run", 2, container, pod_meta={"annotations": {"packtrain.dev/node-agent": "run"}}, pod_spec=gpu
    )
    job["spec"]["backoffLimitPerIndex"] = 0
    job["spec"].pop("backoffLimit")
    batch.create_namespaced_job(namespace, job)
    # Index 0 exits 0, index 1 exits 1: the Job fails with exactly index 1 failed.
    assert wait_for("Job run to finish", lambda: job_condition(batch, "run", namespace)) == "Failed"
    status = batch.read_namespaced_job("run", namespace).status
    assert status.completed_indexes == "0" and status.failed_indexes == "1"
    by_index = {
        p.metadata.annotations["batch.kubernetes.io/job-completion-index"]: p
        for p in job_pods(core, "run", namespace)
    }
    for idx, phase in (("0", "Succeeded"), ("1", "Failed")):
        pod = by_index[idx]
        assert pod.spec.node_name == "gpu-0"
        assert pod.status.phase == phase
        term = pod.status.container_statuses[0].state.terminated
        assert term.exit_code == int(idx)
        assert term.message == f"index {idx} of hello"


def test_deleting_a_job_garbage_collects_its_pods(api: client.ApiClient, namespace: str) -> None:
    batch, core = client.BatchV1Api(api), client.CoreV1Api(api)
    job = indexed_job(
        "long",
        2,
        {"command": ["sleep", "3600"]},
        pod_meta={"annotations": {"packtrain.dev/node-agent-duration": "3600"}},
    )
    batch.create_namespaced_job(namespace, job)
    wait_for(
        "both pods Running",
        lambda: [p.status.phase for p in job_pods(core, "long", namespace)] == ["Running", "Running"],
    )
    batch.delete_namespaced_job("long", namespace, propagation_policy="Background")
    wait_for("the pods to be garbage-collected", lambda: not job_pods(core, "long", namespace), timeout=60)
    with pytest.raises(ApiException) as err:
        batch.read_namespaced_job("long", namespace)
    assert err.value.status == 404


def pytorchjob(name: str, replica_specs: dict[str, Any] | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nprocPerNode": "2"}
    if replica_specs is not None:
        spec["pytorchReplicaSpecs"] = replica_specs
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name}, "spec": spec}


def master(replicas: Any = 1, with_containers: bool = True) -> dict[str, Any]:
    pod: dict[str, Any] = {"restartPolicy": "OnFailure"}
    if with_containers:
        pod["containers"] = [
            {"name": "pytorch", "image": "packtrain:latest", "command": ["torchrun", "train.py"]}
        ]
    return {"Master": {"replicas": replicas, "restartPolicy": "OnFailure", "template": {"spec": pod}}}


def test_pytorchjob_validates_against_the_kubeflow_crd(api: client.ApiClient, namespace: str) -> None:
    custom = client.CustomObjectsApi(api)

    def create(body: dict[str, Any]) -> dict[str, Any]:
        return dict(
            custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", body)
        )

    created = create(pytorchjob("good", {**master(), "Worker": master(replicas=3)["Master"]}))
    assert created["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3

    invalid = {
        "missing replica specs": (pytorchjob("bad1", None), "spec.pytorchReplicaSpecs: Required value"),
        "replicas not an integer": (pytorchjob("bad2", master(replicas="two")), "replicas: Invalid value"),
        "pod without containers": (
            pytorchjob("bad3", master(with_containers=False)),
            "containers: Required value",
        ),
    }
    for case, (body, expected) in invalid.items():
        with pytest.raises(ApiException) as err:
            create(body)
        assert err.value.status == 422, case
        assert expected in err.value.body, f"{case}: {err.value.body}"


def test_kubeflow_trainer_v2_crds_are_established(api: client.ApiClient) -> None:
    crds = {
        c.metadata.name: c for c in client.ApiextensionsV1Api(api).list_custom_resource_definition().items
    }
    for name in (
        "pytorchjobs.kubeflow.org",
        "trainjobs.trainer.kubeflow.org",
        "trainingruntimes.trainer.kubeflow.org",
        "clustertrainingruntimes.trainer.kubeflow.org",
    ):
        assert name in crds, f"{name} not installed"
        assert any(c.type == "Established" and c.status == "True" for c in crds[name].status.conditions), name


def test_training_operator_runs_a_pytorchjob(
    kube_cluster: ControlPlane, api: client.ApiClient, namespace: str
) -> None:
    """The real Kubeflow training-operator turns a PyTorchJob into pods that the node agent completes."""
    if not (kube_cluster.bin / "training-operator").is_file():
        pytest.skip("training-operator was not built (build.sh --no-training-operator)")
    operator = kube_cluster.start_training_operator()
    try:
        custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
        replica = master()["Master"]
        job = pytorchjob("pt", {"Master": replica, "Worker": {**replica, "replicas": 2}})
        custom.create_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", job)

        def finished() -> str | None:
            obj = custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs", "pt")
            done = [
                c["type"]
                for c in obj.get("status", {}).get("conditions", [])
                if c["type"] in ("Succeeded", "Failed") and c["status"] == "True"
            ]
            return done[0] if done else None

        assert wait_for("PyTorchJob pt to finish", finished, timeout=120) == "Succeeded"

        # The job succeeds with its master (Kubeflow's default success policy); the workers finish
        # on their own a moment later.
        def pods_done() -> list[Any] | None:
            pods = core.list_namespaced_pod(
                namespace, label_selector="training.kubeflow.org/job-name=pt"
            ).items
            return pods if {p.status.phase for p in pods} == {"Succeeded"} else None

        pods = wait_for("the PyTorchJob's pods to succeed", pods_done, timeout=60)
        roles = sorted(p.metadata.labels["training.kubeflow.org/replica-type"] for p in pods)
        assert roles == ["master", "worker", "worker"]
        services = {s.metadata.name for s in core.list_namespaced_service(namespace).items}
        assert "pt-master-0" in services
    finally:
        kube_cluster.stop_component(operator)
