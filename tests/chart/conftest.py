"""Fixtures of the chart tests: `install`, the chart installed into the local control plane."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster.controlplane import ControlPlane

from .helm import CRD_NAMES, helm_install, helm_uninstall


def adopt_crds(cluster: ControlPlane, release: str, namespace: str) -> None:
    """CRDs another test applied with kubectl: hand them to the release, as README.md describes."""
    for name in CRD_NAMES:
        if cluster.kubectl("get", "crd", name, check=False).returncode == 0:
            cluster.kubectl(
                "annotate",
                "--overwrite",
                "crd",
                name,
                f"meta.helm.sh/release-name={release}",
                f"meta.helm.sh/release-namespace={namespace}",
            )
            cluster.kubectl("label", "--overwrite", "crd", name, "app.kubernetes.io/managed-by=Helm")


@pytest.fixture
def install(
    kube_cluster: ControlPlane, tmp_path: Path
) -> Iterator[Callable[[dict[str, Any]], dict[str, Any]]]:
    """Installs the chart once per test under a fresh release and namespace; uninstalls after."""
    installed: list[tuple[str, str]] = []

    def do(values: dict[str, Any]) -> dict[str, Any]:
        suffix = uuid.uuid4().hex[:6]
        release, namespace = f"pt-{suffix}", f"packtrain-{suffix}"
        adopt_crds(kube_cluster, release, namespace)
        installed.append((release, namespace))
        return helm_install(kube_cluster.kubeconfig, release, namespace, values)

    yield do
    for release, namespace in installed:
        helm_uninstall(kube_cluster.kubeconfig, release, namespace)
        kube_cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
