"""Pure builders: custom resource in, child manifests out.

Everything the operator creates is decided here, from the validated spec and the
operator's defaults (`settings.py`), without any API call, so each manifest is unit-tested (golden
files under `tests/operator/golden/`) and the kopf handlers stay thin. Names are
deterministic, which is what makes "create if absent" idempotent across restarts.

One module per kind (`packjob.py`: the stage Jobs; `sftjob.py`: the PyTorchJob or TrainJob) over
the pod pieces both share (this module: labels, scheduling, volumes, the restricted pod security);
`packtrain.operator.builders` is their public surface.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from packtrain.operator.api import ClaimMount
from packtrain.operator.settings import OperatorDefaults

CONFIG_DIR = "/etc/packtrain"
TERMINATION_LOG = "/dev/termination-log"
TMP_DIR = "/tmp"


def _labels(component: str, parent_label: str, parent: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "packtrain",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": "packtrain-operator",
        parent_label: parent,
        **extra,
    }


# Pod pieces


def _scheduling(
    node_selector: dict[str, str] | None,
    tolerations: list[Any] | None,
    affinity: dict[str, Any] | None,
    default_selector: dict[str, str],
    default_tolerations: list[dict[str, Any]],
) -> dict[str, Any]:
    pod: dict[str, Any] = {}
    selector = default_selector if node_selector is None else node_selector
    if selector:
        pod["nodeSelector"] = dict(selector)
    tols = (
        [dict(t) for t in default_tolerations]
        if tolerations is None
        else [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in tolerations]
    )
    if tols:
        pod["tolerations"] = tols
    if affinity:
        pod["affinity"] = affinity
    return pod


def _env() -> list[dict[str, str]]:
    # Where packtrain writes its JSON summary (the kubelet's default path, named so tools that run
    # the command outside a kubelet, like the test node agent, can redirect it). HOME is the writable
    # /tmp: the root filesystem is read-only, and caches (Hugging Face, Triton) live under HOME.
    return [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "PACKTRAIN_TERMINATION_LOG", "value": TERMINATION_LOG},
        {"name": "HOME", "value": TMP_DIR},
    ]


# Pod security: every pod the operator builds meets the `restricted` Pod Security Standard, so a
# namespace that enforces it runs PackJobs and SFTJobs, and a CR author cannot loosen it (no spec
# field reaches these settings; the identity is the admin's, from the chart's values).


def pod_security_context(defaults: OperatorDefaults) -> dict[str, Any]:
    """Pod level: a numeric non-root identity and the container runtime's default seccomp profile."""
    return {
        "runAsNonRoot": True,
        "runAsUser": defaults.run_as_user,
        "runAsGroup": defaults.run_as_group,
        "fsGroup": defaults.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Container level: no privilege escalation, no capabilities, a read-only root filesystem."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


def _tmp_volume() -> tuple[dict[str, Any], dict[str, Any]]:
    """The writable /tmp the read-only root filesystem leaves out (torchrun, tokenizers and caches use it)."""
    return {"name": "tmp", "emptyDir": {}}, _mount("tmp", TMP_DIR)


def with_default_requests(own: Mapping[str, Any] | None, default: Mapping[str, Any]) -> dict[str, Any]:
    """Container resources that always carry requests (a namespace quota refuses pods without them).

    Each resource the spec names (as a request or a limit) is the spec's alone, a limit without a
    request requesting as much (what the API server would default); every other resource takes
    the pool's default request and limit.
    """
    own = own or {}
    requests = dict(own.get("requests") or {})
    limits = dict(own.get("limits") or {})
    touched = set(requests) | set(limits)
    requests.update({k: v for k, v in limits.items() if k not in requests})
    for part, target in (("requests", requests), ("limits", limits)):
        target.update({k: v for k, v in (default.get(part) or {}).items() if k not in touched})
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _pod_metadata(labels: dict[str, str], annotations: dict[str, str] | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def _claim_volume(name: str, claim: str, read_only: bool = False) -> dict[str, Any]:
    source: dict[str, Any] = {"claimName": claim}
    if read_only:
        source["readOnly"] = True
    return {"name": name, "persistentVolumeClaim": source}


def _mount(name: str, path: str, read_only: bool = False, sub_path: str | None = None) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": path}
    if sub_path:
        mount["subPath"] = sub_path
    if read_only:
        mount["readOnly"] = True
    return mount


def _extra_volumes(extra: list[ClaimMount]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes = [_claim_volume(v.name, v.claim_name, v.read_only) for v in extra]
    mounts = [_mount(v.name, v.mount_path, v.read_only, v.sub_path) for v in extra]
    return volumes, mounts


def _config_map(
    name: str, namespace: str, labels: dict[str, str], filename: str, doc: dict[str, Any]
) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {filename: yaml.safe_dump(doc, sort_keys=False)},
    }
