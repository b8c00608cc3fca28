"""Every pod the operator builds meets the `restricted` Pod Security Standard.

Two checks. `restricted_violations` is the standard's restricted profile (which includes the
baseline one) written out from https://kubernetes.io/docs/concepts/security/pod-security-standards/,
control by control, so it runs without a cluster. The cluster test hands the same pods to the
real kube-apiserver's PodSecurity admission (a server-side dry run in a namespace that enforces
`restricted`), which is the check a shared cluster applies.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_fixtures import PACKJOB, SFTJOB

from packtrain.operator import builders
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.settings import OperatorDefaults

DEFAULTS = OperatorDefaults(packer_image="packer:test", trainer_image="trainer:test")

# Baseline: capabilities a container may add; restricted narrows it to NET_BIND_SERVICE.
RESTRICTED_ADD_CAPABILITIES = {"NET_BIND_SERVICE"}
# Restricted: the only volume types allowed.
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def restricted_violations(pod: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    """The restricted-profile controls a pod spec breaks (empty: it is admitted)."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    containers = [
        *pod.get("initContainers", []),
        *pod.get("containers", []),
        *pod.get("ephemeralContainers", []),
    ]
    # Baseline controls.
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            out.append(f"host namespaces: {host}")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess")
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and not (
            value in ("runtime/default",) or value.startswith("localhost/")
        ):
            out.append(f"AppArmor annotation {key}={value}")
    for vol in pod.get("volumes", []):
        kinds = set(vol) - {"name"}
        if "hostPath" in kinds:
            out.append(f"hostPath volume {vol['name']}")
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']} of type {sorted(kinds - RESTRICTED_VOLUMES)}")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"unsafe sysctl {sysctl.get('name')}")
    # Restricted, pod level (each may instead be set on every container).
    pod_non_root = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    if pod_seccomp not in (None, "RuntimeDefault", "Localhost"):
        out.append(f"pod seccompProfile {pod_seccomp}")
    for scope, ctx in (("pod", psc), *((c["name"], c.get("securityContext") or {}) for c in containers)):
        selinux = ctx.get("seLinuxOptions") or {}
        if selinux.get("type") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{scope}: seLinuxOptions {selinux}")
        apparmor = (ctx.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{scope}: appArmorProfile {apparmor}")
    for c in containers:
        name, sc = c["name"], c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{name}: procMount {sc.get('procMount')}")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot")
        if non_root is False or (non_root is None and not pod_non_root):
            out.append(f"{name}: runAsNonRoot must be true")
        if sc.get("runAsUser") == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if seccomp is None and pod_seccomp is None:
            out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
        elif seccomp not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{name}: capabilities must drop ALL")
        added = set(caps.get("add") or []) - RESTRICTED_ADD_CAPABILITIES
        if added:
            out.append(f"{name}: adds capabilities {sorted(added)}")
    return out


def _specs() -> tuple[PackJobSpec, SFTJobSpec]:
    pack = copy.deepcopy(PACKJOB["spec"])
    pack["volumes"] = [
        {"name": "datasets", "claimName": "datasets", "mountPath": "/datasets", "subPath": "a"}
    ]
    return PackJobSpec.model_validate(pack), SFTJobSpec.model_validate(SFTJOB["spec"])


def built_pods(defaults: OperatorDefaults = DEFAULTS) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod template) of every pod the operator creates: three pack stages, PyTorchJob replicas."""
    pack, sft = _specs()
    for stage in ("convert", "plan", "materialize"):
        yield f"pack {stage}", builders.pack_job("demo", "ml", pack, stage, defaults)["spec"]["template"]
    data = builders.data_source(sft, pack, {"outputPath": "/data/packs/demo"})
    job = builders.pytorch_job("demo-sft", "ml", sft, data, defaults)
    for replica, rspec in job["spec"]["pytorchReplicaSpecs"].items():
        yield f"PyTorchJob {replica}", rspec["template"]


@pytest.mark.parametrize("where,template", list(built_pods()), ids=[w for w, _ in built_pods()])
def test_built_pods_meet_the_restricted_profile(where: str, template: dict[str, Any]) -> None:
    spec = template["spec"]
    assert restricted_violations(spec, template["metadata"].get("annotations")) == [], where
    assert spec["automountServiceAccountToken"] is False
    for c in spec["containers"]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp"}, (
            "a read-only root needs a writable /tmp"
        )
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["resources"]


def test_the_check_catches_what_the_standard_forbids() -> None:
    """The checker is not vacuous: each control it implements refuses a pod that breaks it."""
    pod = copy.deepcopy(next(built_pods())[1]["spec"])
    assert restricted_violations(pod) == []
    broken = copy.deepcopy(pod)
    del broken["securityContext"]
    for c in broken["containers"]:
        del c["securityContext"]
    found = restricted_violations(broken)
    assert any("allowPrivilegeEscalation" in v for v in found)
    assert any("runAsNonRoot" in v for v in found)
    assert any("seccompProfile" in v for v in found)
    assert any("drop ALL" in v for v in found)
    host = copy.deepcopy(pod)
    host["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    host["hostNetwork"] = True
    assert len(restricted_violations(host)) == 3
    assert restricted_violations(pod, {APPARMOR_ANNOTATION + "packer": "unconfined"})


def test_trainjob_pods_get_what_trainer_v2_lets_a_trainjob_set() -> None:
    """A TrainJob's pod template belongs to its runtime: the overrides add only allowed volumes and env."""
    pack, sft = _specs()
    sft = sft.model_copy(update={"backend": "trainjob"})
    data = builders.data_source(sft, pack, {"outputPath": "/data/packs/demo"})
    job = builders.train_job("demo-sft", "ml", sft, data, DEFAULTS)
    (override,) = job["spec"]["podTemplateOverrides"]
    assert restricted_violations({"volumes": override["spec"]["volumes"]}) == []
    assert {m["mountPath"] for m in override["spec"]["containers"][0]["volumeMounts"]} >= {"/tmp"}
    assert {"cpu", "memory"} <= set(job["spec"]["trainer"]["resourcesPerNode"]["requests"])


def test_identity_and_default_requests_come_from_the_operator_settings() -> None:
    env = {
        "PACKTRAIN_RUN_AS_USER": "1000",
        "PACKTRAIN_RUN_AS_GROUP": "2000",
        "PACKTRAIN_FS_GROUP": "3000",
        "PACKTRAIN_CPU_RESOURCES": '{"requests": {"cpu": "250m", "memory": "1Gi"}, "limits": {"memory": '
        '"4Gi"}}',
    }
    defaults = OperatorDefaults.from_env(env)
    pack, _ = _specs()
    pack = pack.model_copy(update={"workers": pack.workers.model_copy(update={"resources": None})})
    pod = builders.pack_job("demo", "ml", pack, "convert", defaults)["spec"]["template"]["spec"]
    assert pod["securityContext"] | {"seccompProfile": None} == {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 2000,
        "fsGroup": 3000,
        "seccompProfile": None,
    }
    assert pod["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "1Gi"},
        "limits": {"memory": "4Gi"},
    }
    with pytest.raises(ValueError, match="run_as_user must be a positive integer"):
        OperatorDefaults.from_env({"PACKTRAIN_RUN_AS_USER": "0"})
    with pytest.raises(ValueError, match="cpu_resources must be a container `resources`"):
        OperatorDefaults.from_env({"PACKTRAIN_CPU_RESOURCES": '{"requests": {"cpu": "lots"}}'})


def test_spec_resources_keep_their_own_values_and_gain_requests() -> None:
    default = {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"memory": "8Gi"}}
    # A limit alone requests as much; resources the spec leaves out take the defaults.
    assert builders.with_default_requests({"limits": {"cpu": "500m"}}, default) == {
        "limits": {"cpu": "500m", "memory": "8Gi"},
        "requests": {"cpu": "500m", "memory": "2Gi"},
    }
    # A spec memory request above the default limit is not capped by it (that would be invalid).
    assert builders.with_default_requests({"requests": {"memory": "16Gi"}}, default) == {
        "requests": {"memory": "16Gi", "cpu": "1"},
    }


# On the real API server: its PodSecurity admission decides.


@pytest.mark.cluster
def test_the_api_server_admits_every_built_pod_in_a_restricted_namespace(kube_cluster: Any) -> None:
    ns = f"pss-{uuid.uuid4().hex[:8]}"
    labels = {"pod-security.kubernetes.io/enforce": "restricted"}
    kube_cluster.kubectl(
        "create",
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}
        ),
    )

    def dry_run(spec: dict[str, Any], metadata: dict[str, Any]) -> Any:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**metadata, "name": "probe"}, "spec": spec}
        return kube_cluster.kubectl(
            "create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(pod), check=False
        )

    try:
        refused = {}
        for where, template in built_pods():
            result = dry_run(template["spec"], template["metadata"])
            if result.returncode != 0:  # PodSecurity names the controls the pod breaks
                refused[where] = result.stderr
        assert refused == {}
        # The namespace really enforces: a pod without its security settings is refused.
        spec = copy.deepcopy(next(built_pods())[1]["spec"])
        del spec["securityContext"]
        for c in spec["containers"]:
            del c["securityContext"]
        result = dry_run(spec, {})
        assert result.returncode != 0 and 'violates PodSecurity "restricted' in result.stderr, result.stderr
    finally:
        kube_cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_the_chart_values_set_the_identity_and_default_requests() -> None:
    """The admin's values reach the pods through the operator's environment; the schema refuses bad ones."""
    import helm_python
    from chart.helm import render

    values = {
        "workloadSecurityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000},
        "pools": {"cpu": {"resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}},
    }
    deployment = next(o for o in render(values) if o["kind"] == "Deployment")
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    defaults = OperatorDefaults.from_env(env)
    pack, _ = _specs()
    pack = pack.model_copy(update={"workers": pack.workers.model_copy(update={"resources": None})})
    pod = builders.pack_job("demo", "ml", pack, "plan", defaults)["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]) == (1000, 2000)
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "250m", "memory": "1Gi"}}
    for bad in (
        {"workloadSecurityContext": {"runAsUser": 0, "runAsGroup": 1, "fsGroup": 1}},
        {"pools": {"cpu": {"resources": {"requests": {"cpu": "lots"}}}}},
        {"pools": {"gpu": {"resources": {"requsts": {"cpu": "1"}}}}},
    ):
        with pytest.raises(helm_python.HelmError):
            render(bad)
