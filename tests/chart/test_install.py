"""`helm install` into the local control plane, then the operator runs as the chart's ServiceAccount.

The cluster has no container runtime, so the operator process runs here, with the arguments and
environment of the chart's Deployment and a kubeconfig holding a token of the chart's
ServiceAccount (TokenRequest): every API call it makes is authorized by the chart's RBAC alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.controlplane import ControlPlane, free_port
from cluster.waiting import wait_for
from kubernetes import client

from packtrain.operator import rbac
from packtrain.operator.api import GROUP, VERSION

from .helm import (
    CHART,
    CRD_NAMES,
    NAMESPACE,
    RELEASE,
    REPO,
    load_all,
    manifest_objects,
    render,
)

pytestmark = pytest.mark.cluster


def service_account_kubeconfig(cluster: ControlPlane, namespace: str, account: str, path: Path) -> Path:
    token = cluster.kubectl("create", "token", account, "-n", namespace, "--duration=1h").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "sa",
        "clusters": [{"name": "local", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [
            {"name": "sa", "context": {"cluster": "local", "user": account, "namespace": namespace}}
        ],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def run_operator(
    cluster: ControlPlane, deployment: dict[str, Any], kubeconfig: Path, log: Path
) -> subprocess.Popen[bytes]:
    """`packtrain operator` with the Deployment's arguments and environment, as its ServiceAccount."""
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    env.update(
        KUBECONFIG=str(kubeconfig), POD_NAMESPACE=deployment["metadata"]["namespace"], HOME=str(log.parent)
    )
    packtrain = Path(sys.executable).with_name("packtrain")
    return subprocess.Popen(
        [str(packtrain), "operator", *container["args"]],
        env=env,
        cwd=REPO,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def pack_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PackJob",
        "metadata": {"name": name},
        "spec": {
            "source": {"paths": ["/data/demo.json"]},
            "model": {"path": "/models/qwen2-vl"},
            "output": {"claimName": "packs"},
        },
    }


def sft_job(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "SFTJob",
        "metadata": {"name": name},
        "spec": {
            "data": {"path": "/data/packs/demo"},
            "model": {"path": "/models/qwen2-vl"},
            "volumes": {"data": {"claimName": "packs"}, "checkpoints": {"claimName": "ckpt"}},
        },
    }


def phase(custom: client.CustomObjectsApi, plural: str, namespace: str, name: str) -> str | None:
    obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    return (obj.get("status") or {}).get("phase")


@pytest.mark.parametrize("scope", ["cluster", "namespace"])
def test_operator_works_with_the_chart_permissions(
    kube_cluster: ControlPlane,
    install: Callable[[dict[str, Any]], dict[str, Any]],
    tmp_path: Path,
    scope: str,
) -> None:
    work_ns = f"ml-{uuid.uuid4().hex[:6]}"
    kube_cluster.kubectl("create", "namespace", work_ns)
    values: dict[str, Any] = {"operator": {"metricsPort": free_port(), "livenessPort": free_port()}}
    if scope == "namespace":
        values = {
            **values,
            "rbac": {"scope": "namespace"},
            "operator": {**values["operator"], "watchNamespaces": [work_ns]},
        }
    release = install(values)
    namespace = release["namespace"]
    objects = manifest_objects(release)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{namespace}:{account}"

    with kube_cluster.api_client() as api:
        # The CRDs came with the release and are served.
        ext = client.ApiextensionsV1Api(api)
        for name in CRD_NAMES:
            crd = ext.read_custom_resource_definition(name)
            assert any(c.type == "Established" and c.status == "True" for c in crd.status.conditions)
            assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"

        # What the API server itself says the ServiceAccount may do: rbac.RULES, and not more.
        auth = client.AuthorizationV1Api(api)

        def allowed(verb: str, group: str, resource: str, ns: str | None) -> bool:
            resource, _, sub = resource.partition("/")
            review = auth.create_subject_access_review(
                {
                    "spec": {
                        "user": user,
                        "resourceAttributes": {
                            "verb": verb,
                            "group": group,
                            "resource": resource,
                            "subresource": sub or None,
                            "namespace": ns,
                        },
                    }
                }
            )
            return bool(review.status.allowed)

        for rule in rbac.NAMESPACED_RULES:
            for g in rule["apiGroups"]:
                for r in rule["resources"]:
                    for v in rule["verbs"]:
                        assert allowed(v, g, r, work_ns), (v, g, r)
        for rule in rbac.CLUSTER_RULES:
            for v in rule["verbs"]:
                assert allowed(v, rule["apiGroups"][0], rule["resources"][0], None), rule
        for verb, group, resource in [
            ("get", "", "secrets"),
            ("delete", GROUP, "packjobs"),
            ("create", "", "pods"),
            ("get", "", "pods/log"),
            ("create", "rbac.authorization.k8s.io", "rolebindings"),
        ]:
            assert not allowed(verb, group, resource, work_ns), (verb, group, resource)
        if scope == "namespace":
            assert not allowed("list", GROUP, "packjobs", "default")

        kubeconfig = service_account_kubeconfig(kube_cluster, namespace, account, tmp_path / "sa.kubeconfig")
        log = tmp_path / "operator.log"
        proc = run_operator(kube_cluster, deployment, kubeconfig, log)
        try:
            custom = client.CustomObjectsApi(api)
            custom.create_namespaced_custom_object(GROUP, VERSION, work_ns, "packjobs", pack_job("pack"))
            custom.create_namespaced_custom_object(GROUP, VERSION, work_ns, "sftjobs", sft_job("sft"))

            def alive() -> None:
                assert proc.poll() is None, f"operator exited:\n{log.read_text()[-4000:]}"

            def pack_progress() -> str | None:
                alive()
                return phase(custom, "packjobs", work_ns, "pack")

            def sft_progress() -> str | None:
                alive()
                return phase(custom, "sftjobs", work_ns, "sft")

            assert wait_for("the PackJob to get a phase", pack_progress, timeout=90)
            assert wait_for("the SFTJob to get a phase", sft_progress, timeout=90)
            # The operator created children with the chart's permissions and the chart's pools.
            batch = client.BatchV1Api(api)
            jobs = wait_for("the convert Job", lambda: batch.list_namespaced_job(work_ns).items)
            pod_spec = jobs[0].spec.template.spec
            assert pod_spec.node_selector == {"packtrain.dev/pool": "cpu"}
            assert client.CoreV1Api(api).read_namespaced_config_map("pack-pack-config", work_ns)
            wait_for(
                "the PyTorchJob",
                lambda: custom.list_namespaced_custom_object("kubeflow.org", "v1", work_ns, "pytorchjobs")[
                    "items"
                ],
            )
        finally:
            stop(proc)
            # With the operator gone its finalizers would block deletion: drop them, so no
            # later test's operator finds these objects.
            for plural, name in (("packjobs", "pack"), ("sftjobs", "sft")):
                kube_cluster.kubectl(
                    "patch",
                    plural,
                    name,
                    "-n",
                    work_ns,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
            kube_cluster.kubectl("delete", "namespace", work_ns, "--wait=false", check=False)
        text = log.read_text()
        assert "Forbidden" not in text and " 403" not in text, text[-4000:]


def test_helm3_lints_and_renders_like_the_sdk(kube_cluster: ControlPlane, tmp_path: Path) -> None:
    """Most users run Helm 3: its lint is clean and its `helm template` renders what Helm 4's library does."""
    from .test_render import VALUE_SETS

    for name, values in VALUE_SETS.items():
        values_file = tmp_path / f"{name}.yaml"
        values_file.write_text(yaml.safe_dump(values))
        lint = kube_cluster.helm("lint", "--strict", str(CHART), "-f", str(values_file))
        assert "0 chart(s) failed" in lint.stdout and "[WARNING]" not in lint.stdout, lint.stdout
        out = kube_cluster.helm(
            "template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file)
        ).stdout

        def key(obj: dict[str, Any]) -> tuple[str, str, str]:
            return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]

        assert sorted(load_all(out), key=key) == sorted(render(values), key=key), name
