"""The operator on the local control plane (tests/cluster): its fixtures, and the helpers its tests share.

The fixtures reach the tests through this folder's conftest.py; the helpers are imported.

The operator runs as a subprocess (`packtrain operator`, exactly what the chart's
Deployment runs) with a ServiceAccount token bound to `packtrain.operator.rbac.RULES`,
so a missing permission fails here. The controllers are real: the Job controller
creates pods, the scheduler puts them on the CPU/GPU pool, the node agent plays the
kubelet (simulating exits, or really running the packer with
`packtrain.dev/node-agent: run`). No training-operator runs, so the test moves the
PyTorchJob along by writing its status, as the training-operator would.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster import waiting
from kubernetes import client
from kubernetes.client.rest import ApiException
from operator_fixtures import PACKJOB, SFTJOB

from packtrain.operator import rbac

REPO = Path(__file__).resolve().parents[2]
GROUP, VERSION = "packtrain.dev", "v1alpha1"
OPERATOR_NS, OPERATOR_SA = "packtrain-system", "packtrain-operator"
DURATION = "packtrain.dev/node-agent-duration"
EXIT_CODE = "packtrain.dev/node-agent-exit-code"
CLAIM = "packtrain-data"


# The operator reacts within a watch event: poll often, 90 s unless a test says otherwise.
wait_for = partial(waiting.wait_for, timeout=90, every=0.25)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Fixtures


@pytest.fixture(scope="module")
def api(kube_cluster: Any) -> Iterator[client.ApiClient]:
    with kube_cluster.api_client() as api_client:
        yield api_client


@pytest.fixture(scope="module")
def crds(kube_cluster: Any) -> None:
    kube_cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube_cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        "crd/packjobs.packtrain.dev",
        "crd/sftjobs.packtrain.dev",
    )


@pytest.fixture(scope="module")
def operator_kubeconfig(kube_cluster: Any, crds: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kubeconfig holding a token of a ServiceAccount bound to exactly rbac.RULES (not admin)."""
    rbac_docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NS}},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": OPERATOR_SA, "namespace": OPERATOR_NS},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": OPERATOR_SA},
            "rules": rbac.RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": OPERATOR_SA},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": OPERATOR_SA},
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NS}],
        },
    ]
    kube_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac_docs))
    token = kube_cluster.kubectl(
        "create", "token", OPERATOR_SA, "-n", OPERATOR_NS, "--duration=10h"
    ).stdout.strip()
    admin = yaml.safe_load(Path(kube_cluster.kubeconfig).read_text())
    cluster = admin["clusters"][0]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": OPERATOR_SA, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": cluster["name"], "user": OPERATOR_SA}}],
        "current-context": "operator",
    }
    path = tmp_path_factory.mktemp("operator") / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


class Operator:
    """`packtrain operator` in a subprocess; restartable."""

    def __init__(self, kubeconfig: Path, log: Path, env: dict[str, str] | None = None) -> None:
        self.kubeconfig, self.log, self.extra_env = kubeconfig, log, env or {}
        self.metrics_port, self.health_port = _free_port(), _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "PACKTRAIN_PACKER_IMAGE": "ghcr.io/packtrain/packer:test",
            "PACKTRAIN_TRAINER_IMAGE": "ghcr.io/packtrain/trainer:test",
            # The node agent's opt-in annotations, which the default policy refuses.
            "PACKTRAIN_POLICY": json.dumps({"allowedPodAnnotationPrefixes": ["packtrain.dev/node-agent"]}),
            # The deadline sweep every second, so the bounded-wait tests take seconds, not minutes.
            "PACKTRAIN_RESYNC_INTERVAL": "1",
            **self.extra_env,
        }
        cmd = [
            sys.executable,
            "-m",
            "packtrain.operator.cli",
            "operator",
            "--verbose",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness",
            f"http://127.0.0.1:{self.health_port}/healthz",
        ]
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        wait_for("the operator's liveness endpoint", self.healthy, timeout=60)

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def operator(operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Operator]:
    op = Operator(operator_kubeconfig, tmp_path_factory.mktemp("operator-log") / "operator.log")
    op.start()
    yield op
    op.stop()
    print(f"operator log: {op.log}\n{op.tail(40)}")


@pytest.fixture
def namespace(api: client.ApiClient, crds: None) -> Iterator[str]:
    """A namespace with a bound ReadWriteMany claim `packtrain-data` (a hostPath PersistentVolume)."""
    name = f"pt-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    core.create_persistent_volume(
        {
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "packtrain-test",
                "hostPath": {"path": f"/tmp/{name}"},
                "claimRef": {"namespace": name, "name": CLAIM},
            },
        }
    )
    core.create_namespaced_persistent_volume_claim(
        name,
        {
            "metadata": {"name": CLAIM},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "packtrain-test",
                "volumeName": name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    wait_for(
        "the claim to bind",
        lambda: core.read_namespaced_persistent_volume_claim(CLAIM, name).status.phase == "Bound",
        timeout=60,
    )
    yield name
    core.delete_namespace(name)
    core.delete_persistent_volume(name)


def custom(api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api)


def packjob(name: str, count: int = 2, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    body = copy.deepcopy(PACKJOB)
    body["metadata"] = {"name": name}
    body["spec"]["output"] = {"claimName": CLAIM, "subPath": f"packs/{name}"}
    body["spec"]["workers"] = {"count": count, "podAnnotations": {DURATION: "1", **(annotations or {})}}
    return body


def sftjob(name: str, pack: str) -> dict[str, Any]:
    body = copy.deepcopy(SFTJOB)
    body["metadata"] = {"name": name}
    body["spec"]["data"] = {"packJobRef": pack}
    return body


def create(api: client.ApiClient, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    plural = body["kind"].lower() + "s"
    return dict(custom(api).create_namespaced_custom_object(GROUP, VERSION, ns, plural, body))


def get(api: client.ApiClient, ns: str, plural: str, name: str) -> dict[str, Any]:
    return dict(custom(api).get_namespaced_custom_object(GROUP, VERSION, ns, plural, name))


def phase(api: client.ApiClient, ns: str, plural: str, name: str) -> str | None:
    return (get(api, ns, plural, name).get("status") or {}).get("phase")


def condition(obj: dict[str, Any], type_: str) -> dict[str, Any]:
    return next(c for c in obj["status"]["conditions"] if c["type"] == type_)


def jobs(api: client.ApiClient, ns: str, pack: str) -> list[Any]:
    return list(
        client.BatchV1Api(api).list_namespaced_job(ns, label_selector=f"packtrain.dev/packjob={pack}").items
    )


def events(api: client.ApiClient, ns: str, name: str) -> list[Any]:
    return list(
        client.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
    )


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the operator's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def stage_counts(operator: Operator) -> dict[str, float]:
    text = operator.metrics()
    return {
        stage: metric(text, "packtrain_operator_stage_duration_seconds_count", stage=stage)
        for stage in ("convert", "plan", "materialize")
    }


def rejected(api: client.ApiClient, ns: str, body: dict[str, Any]) -> str:
    with pytest.raises(ApiException) as err:
        create(api, ns, body)
    assert err.value.status == 422, err.value.body
    return str(json.loads(err.value.body)["message"])


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
