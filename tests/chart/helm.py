"""Helm for the tests, through Helm's own Go library (the `helm-python-sdk` package: no binary).

`render`, `lint` and `package` work offline; `helm_install` installs the chart into a cluster
and is meant for other tests too (`from chart.helm import helm_install`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python
import yaml

from packtrain.operator.api import GROUP

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "packtrain"
RELEASE = "packtrain"
NAMESPACE = "packtrain-system"
# The Kubernetes minor the local control plane runs (tests/cluster/build.sh) and the schemas
# the objects are validated against.
KUBE_VERSION = "1.37"

Manifest = dict[str, Any]


class KubeYamlLoader(yaml.SafeLoader):
    """YAML as the API server reads it: `1e-05` is a float (YAML 1.2), not a string (PyYAML's 1.1)."""


KubeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_all(text: str) -> list[Manifest]:
    return [doc for doc in yaml.load_all(text, Loader=KubeYamlLoader) if doc]


def render_files(
    values: dict[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    chart: Path | str = CHART,
) -> dict[str, str]:
    """`helm template`: template path → rendered text (NOTES.txt included)."""
    with helm_python.Chart.load(chart) as loaded:
        return loaded.render(values, name=release, namespace=namespace, is_install=True)


def render(
    values: dict[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    chart: Path | str = CHART,
) -> list[Manifest]:
    """The objects the chart renders for `values`, in template order."""
    files = render_files(values, release=release, namespace=namespace, chart=chart)
    return [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in load_all(text)
    ]


def notes(values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE) -> str:
    files = render_files(values, release=release, namespace=namespace)
    return next(text for path, text in files.items() if path.endswith("templates/NOTES.txt"))


def lint(values: dict[str, Any] | None = None, *, namespace: str = NAMESPACE) -> dict[str, Any]:
    """`helm lint --strict` against the cluster's Kubernetes version."""
    return helm_python.lint(
        CHART, values, strict=True, namespace=namespace, kube_version=f"v{KUBE_VERSION}.0"
    )


def package(destination: Path) -> Path:
    """`helm package`: the chart archive, as a repository would serve it."""
    return Path(helm_python.package(CHART, destination=destination))


def helm_install(
    kubeconfig: str | Path,
    release: str,
    namespace: str,
    values: dict[str, Any] | None = None,
    *,
    timeout: int = 120,
) -> dict[str, Any]:
    """`helm install --create-namespace` of charts/packtrain; returns the release (with its manifest).

    Nothing is waited for: the cluster may run no kubelet, so the operator pod may never start.
    """
    with helm_python.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as config:
        release_info = config.install(
            CHART, release, values, namespace=namespace, create_namespace=True, timeout=timeout
        )
    return dict(release_info)


def helm_uninstall(kubeconfig: str | Path, release: str, namespace: str) -> None:
    with helm_python.Config(kubeconfig_path=str(kubeconfig), namespace=namespace) as config:
        config.uninstall(release, ignore_not_found=True)


def manifest_objects(release: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(release["manifest"]) if d]


CRD_NAMES = [f"packjobs.{GROUP}", f"sftjobs.{GROUP}"]
