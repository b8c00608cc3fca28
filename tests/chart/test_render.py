"""The chart, rendered by Helm's own library: lint, Kubernetes schemas, security, RBAC, CRDs."""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from packtrain.operator import builders, crdgen, rbac
from packtrain.operator.api import GROUP, KINDS, PackJobSpec, SFTJobSpec
from packtrain.operator.deadlines import Deadlines
from packtrain.operator.settings import OperatorDefaults

from .helm import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    REPO,
    Manifest,
    lint,
    load_all,
    notes,
    package,
    render,
)

# Value sets every test renders: the defaults and the non-default paths through the templates.
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespace-scope": {
        "rbac": {"scope": "namespace"},
        "operator": {"watchNamespaces": ["team-a", "team-b"], "extraArgs": ["--verbose"]},
    },
    "namespace-scope-release-ns": {"rbac": {"scope": "namespace"}},
    "everything-on": {
        "fullnameOverride": "pt",
        "commonLabels": {"team": "ml"},
        "crds": {"keep": False, "annotations": {"example.com/owner": "ml"}},
        "image": {"repository": "registry.example.com/pt/operator", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "workloadImages": {
            "packer": {"repository": "registry.example.com/pt/packer", "tag": "1.2.3"},
            "trainer": {"repository": "registry.example.com/pt/trainer", "tag": "1.2.3-cu128"},
        },
        "pools": {
            "cpu": {
                "nodeSelector": {"pool": "batch"},
                "tolerations": [{"key": "batch", "operator": "Exists", "effect": "NoSchedule"}],
            },
            "gpu": {"nodeSelector": {"gpu": "h100"}, "tolerations": []},
        },
        "operator": {
            "watchNamespaces": ["ml"],
            "metricsPort": 9090,
            "livenessPort": 9091,
            "verbose": True,
            "extraEnv": [{"name": "EXTRA", "value": "1"}],
            "deadlines": {"trainingStallSeconds": 600, "trainingStallFailSeconds": 0},
        },
        "serviceAccount": {"name": "pt-operator", "annotations": {"iam.example.com/role": "pt"}},
        "podAnnotations": {"example.com/scrape": "false"},
        "podLabels": {"team": "ml"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "system", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}
                            ]
                        }
                    ]
                }
            }
        },
        "priorityClassName": "system-cluster-critical",
        "service": {"port": 9090, "annotations": {"example.com/a": "b"}},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
            "podMonitor": {"enabled": True, "interval": "5s", "labels": {"release": "prom"}},
        },
        "argocd": {"healthChecks": {"enabled": True}},
        "policy": {
            "allowedImages": ["registry.example.com/pt/*"],
            "allowTolerations": True,
            "allowedPodAnnotationPrefixes": ["example.com/"],
            "maxGpusPerJob": 1000000,
        },
        "grafana": {
            "dashboard": {"enabled": True, "namespace": "monitoring", "annotations": {"grafana_folder": "ML"}}
        },
    },
    "externally-managed": {
        "crds": {"install": False},
        "rbac": {"create": False},
        "serviceAccount": {"create": False, "name": "preexisting"},
    },
}

Grant = tuple[str, str, str]

# kubernetes-validate has schemas for built-in kinds only; the Prometheus Operator kinds are
# checked against the fields their controller needs (below) instead.
MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "required": ["selector"],
            "properties": {
                "selector": {
                    "type": "object",
                    "required": ["matchLabels"],
                    "properties": {"matchLabels": {"type": "object", "minProperties": 1}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "oneOf": [
                        {"required": ["any"], "properties": {"any": {"const": True}}},
                        {
                            "required": ["matchNames"],
                            "properties": {
                                "matchNames": {"type": "array", "minItems": 1, "items": {"type": "string"}}
                            },
                        },
                    ],
                },
                "endpoints": {"$ref": "#/$defs/endpoints"},
                "podMetricsEndpoints": {"$ref": "#/$defs/endpoints"},
            },
        },
    },
    "$defs": {
        "endpoints": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["port"],
                "additionalProperties": False,
                "properties": {
                    "port": {"type": "string"},
                    "path": {"type": "string"},
                    "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                    "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                },
            },
        }
    },
}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[Manifest]]:
    values = VALUE_SETS[request.param]
    return values, render(values)


def one(objects: Iterable[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    """Every (apiGroup, resource, verb) a rule list allows; wildcards and name limits are refused."""
    out: set[Grant] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def test_lint_is_clean() -> None:
    for name, values in VALUE_SETS.items():
        report = lint(values)
        problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
        assert not problems, f"{name}: {problems}"
        # Only the missing icon (severity 1, informational) may remain.
        assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}, name


def test_every_object_validates_against_kubernetes_schemas(
    rendered: tuple[dict[str, Any], list[Manifest]],
) -> None:
    _, objects = rendered
    assert objects
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            jsonschema.validate(obj, MONITOR_SCHEMA)
            continue
        # strict: unknown fields are errors, as with the API server's field validation.
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"


def test_namespaced_objects_live_in_the_release_namespace(
    rendered: tuple[dict[str, Any], list[Manifest]],
) -> None:
    values, objects = rendered
    roles_in = set(values.get("operator", {}).get("watchNamespaces") or [NAMESPACE])
    dashboard_ns = values.get("grafana", {}).get("dashboard", {}).get("namespace") or NAMESPACE
    for obj in objects:
        kind, ns = obj["kind"], obj["metadata"].get("namespace")
        if kind in (
            "ClusterRole",
            "ClusterRoleBinding",
            "CustomResourceDefinition",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ):
            assert ns is None
        elif kind in ("Role", "RoleBinding"):
            assert ns in roles_in
        elif obj["metadata"]["name"].endswith("-dashboard"):
            assert ns == dashboard_ns
        else:
            assert ns == NAMESPACE, obj["metadata"]["name"]


def test_deployment_is_single_recreate_and_restricted(
    rendered: tuple[dict[str, Any], list[Manifest]],
) -> None:
    values, objects = rendered
    deployment = one(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    # The restricted Pod Security Standard, pod and container level.
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "hostNetwork" not in pod and "hostPID" not in pod
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]["memory"]
    # A read-only root needs a writable /tmp.
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    # Liveness: kopf's /healthz on the port passed with --liveness.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert f"--liveness=http://0.0.0.0:{ports[probe['port']]}/healthz" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]
    # The pod runs as the ServiceAccount the bindings name.
    sa_name = pod["serviceAccountName"]
    if values.get("serviceAccount", {}).get("create", True):
        assert one(objects, "ServiceAccount")["metadata"]["name"] == sa_name
    else:
        assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    for binding in (o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa_name, "namespace": NAMESPACE}]


def test_operator_arguments_and_environment(rendered: tuple[dict[str, Any], list[Manifest]]) -> None:
    values, objects = rendered
    merged = helm_python.Chart.load(CHART).merge_values(values)
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    # What the operator makes of that environment is what the values asked for.
    defaults = OperatorDefaults.from_env(env)
    for kind in ("cpu", "gpu"):
        pool = merged["pools"][kind]
        assert getattr(defaults, f"{kind}_node_selector") == pool["nodeSelector"]
        assert getattr(defaults, f"{kind}_tolerations") == pool["tolerations"]
    app_version = helm_python.Chart.load(CHART).metadata["appVersion"]
    for kind in ("packer", "trainer"):
        image = merged["workloadImages"][kind]
        assert getattr(defaults, f"{kind}_image") == f"{image['repository']}:{image['tag'] or app_version}"
    assert container["image"] == f"{merged['image']['repository']}:{merged['image']['tag'] or app_version}"
    assert defaults.deadlines == Deadlines.from_dict(merged["operator"]["deadlines"])
    watched = [a.removeprefix("--namespace=") for a in container["args"] if a.startswith("--namespace=")]
    if merged["rbac"]["scope"] == "namespace":
        assert watched == (merged["operator"]["watchNamespaces"] or [NAMESPACE])
    else:
        assert watched == merged["operator"]["watchNamespaces"]
    extra = merged["operator"]["extraArgs"]
    assert container["args"][len(container["args"]) - len(extra) :] == extra


def test_chart_defaults_are_the_operator_defaults() -> None:
    """Images and pools by default agree, so the operator behaves the same with or without the chart."""
    container = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert OperatorDefaults.from_env(env) == OperatorDefaults()


def test_cluster_role_grants_exactly_what_the_operator_needs() -> None:
    objects = render()
    role = one(objects, "ClusterRole")
    assert grants(role["rules"]) == grants(rbac.RULES)
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }


@pytest.mark.parametrize("watch", [["team-a", "team-b"], []])
def test_namespace_scope_grants_roles_per_namespace(watch: list[str]) -> None:
    objects = render({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": watch}})
    namespaces = watch or [NAMESPACE]
    # Only kopf's own discovery (CRDs, namespaces) stays cluster-wide; the rest is per namespace.
    assert grants(one(objects, "ClusterRole")["rules"]) == grants(rbac.CLUSTER_RULES)
    roles = [o for o in objects if o["kind"] == "Role"]
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == sorted(namespaces)
    assert sorted(b["metadata"]["namespace"] for b in bindings) == sorted(namespaces)
    for role in roles:
        assert grants(role["rules"]) == grants(rbac.NAMESPACED_RULES)
    for binding in bindings:
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }


def test_rbac_can_be_left_to_the_user() -> None:
    objects = render(VALUE_SETS["externally-managed"])
    assert not [
        o
        for o in objects
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount")
    ]
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "preexisting"


def test_service_and_monitors_select_the_right_pods() -> None:
    objects = render(VALUE_SETS["everything-on"])
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    service = one(objects, "Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] in {p["name"] for p in container["ports"]}
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    pod_monitor = one(objects, "PodMonitor")
    # It selects the trainer pods the operator really builds, on a port they really have.
    trainer_pods = [replica["template"] for replica in _pytorch_job()["spec"]["pytorchReplicaSpecs"].values()]
    for pod in trainer_pods:
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        port_names = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] in port_names
    # TrainJob pods get their labels through the runtime's pod template overrides.
    for override in _train_job()["spec"]["podTemplateOverrides"]:
        assert (
            pod_monitor["spec"]["selector"]["matchLabels"].items() <= override["metadata"]["labels"].items()
        )
    packer_pod = _pack_job()["spec"]["template"]
    assert (
        not pod_monitor["spec"]["selector"]["matchLabels"].items() <= packer_pod["metadata"]["labels"].items()
    )
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    assert one(render({"metrics": {"podMonitor": {"enabled": True}}}), "PodMonitor")["spec"][
        "namespaceSelector"
    ] == {"any": True}
    # Off by default: the Prometheus Operator CRDs may be absent.
    assert not [o for o in render() if o["apiVersion"].startswith("monitoring.coreos.com/")]


def _sft_spec() -> SFTJobSpec:
    return SFTJobSpec.model_validate(
        {
            "data": {"path": "/data/pack"},
            "model": {"path": "/models/m"},
            "resources": {"nodes": 2},
            "volumes": {"data": {"claimName": "data"}, "checkpoints": {"claimName": "ckpt"}},
        }
    )


def _pytorch_job() -> Manifest:
    spec = _sft_spec()
    return builders.pytorch_job("run", "ml", spec, builders.data_source(spec, None, None), OperatorDefaults())


def _train_job() -> Manifest:
    spec = _sft_spec().model_copy(update={"backend": "trainjob"})
    return builders.train_job("run", "ml", spec, builders.data_source(spec, None, None), OperatorDefaults())


def _pack_job() -> Manifest:
    spec = PackJobSpec.model_validate(
        {
            "source": {"paths": ["/data/in.jsonl"]},
            "model": {"path": "/models/m"},
            "output": {"claimName": "out"},
        }
    )
    return builders.pack_job("pack", "ml", spec, "plan", OperatorDefaults())


def _crd_sources() -> dict[str, Manifest]:
    return {f"{kind.PLURAL}.{GROUP}": yaml.safe_load(crdgen.render(kind)) for kind in KINDS}


def test_chart_ships_the_generated_crds() -> None:
    """files/crds links to the top-level crds/ that `packtrain crds` writes, so the two cannot drift."""
    chart_dir = CHART / "files" / "crds"
    assert chart_dir.is_symlink() and chart_dir.resolve() == (REPO / "crds").resolve()
    expected = {crdgen.filename(kind): crdgen.render(kind) for kind in KINDS}
    assert {p.name: p.read_text() for p in chart_dir.glob("*.yaml")} == expected, (
        "crds/ is stale: run `packtrain crds`"
    )


@pytest.mark.parametrize("keep", [True, False])
def test_crds_render_unchanged_and_updatable(keep: bool) -> None:
    objects = render({"crds": {"keep": keep}})
    crds = {o["metadata"]["name"]: o for o in objects if o["kind"] == "CustomResourceDefinition"}
    sources = _crd_sources()
    assert crds.keys() == sources.keys()
    for name, crd in crds.items():
        # Templating must not alter the schema (numbers, defaults, descriptions).
        assert crd["spec"] == sources[name]["spec"], name
        assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}
        annotations = crd["metadata"]["annotations"]
        assert ("helm.sh/resource-policy" in annotations) is keep
        assert ("Delete=false" in annotations["argocd.argoproj.io/sync-options"]) is keep
        # CRDs outgrow the last-applied annotation of client-side apply.
        assert "ServerSideApply=true" in annotations["argocd.argoproj.io/sync-options"]
        assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert not [o for o in render({"crds": {"install": False}}) if o["kind"] == "CustomResourceDefinition"]


def test_values_schema_rejects_bad_values() -> None:
    chart = helm_python.Chart.load(CHART)
    bad = [
        {"rbac": {"scope": "everywhere"}},
        {"replicas": 2},
        {"operator": {"metricsPort": "8080"}},
        {"operator": {"watchNamespaces": ["Not_A_Namespace"]}},
        {"pools": {"gpu": {"tolerations": [{"key": "x", "operator": "Maybe"}]}}},
        {"metrics": {"podMonitor": {"enabled": True, "interval": "often"}}},
    ]
    for values in bad:
        with pytest.raises(helm_python.HelmError):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    chart.validate_schema(chart.merge_values(VALUE_SETS["everything-on"]))


def undocumented_values(text: str) -> list[str]:
    """Leaf lines of a values file with no comment above them or above one of their parents.

    A comment directly above a key documents the key and everything under it (KubeRay style:
    one comment per key, data such as a default nodeSelector needs none of its own).
    """
    lines = [ln for ln in text.splitlines() if ln.strip()]
    missing: list[str] = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        documented = i > 0 and lines[i - 1].lstrip().startswith("#")
        covered = documented or any(d for _, d in stack)
        following = next((ln for ln in lines[i + 1 :] if not ln.lstrip().startswith("#")), "")
        is_leaf = len(following) - len(following.lstrip()) <= indent
        if is_leaf and not covered:
            missing.append(line)
        stack.append((indent, documented))
    return missing


def test_values_are_documented() -> None:
    assert undocumented_values((CHART / "values.yaml").read_text()) == []
    assert undocumented_values("a:\n  # -- doc\n  b: 1\n  c: 2\n") == ["  c: 2"]
    assert undocumented_values("# -- doc\na:\n  b:\n    - x\n") == []
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) <= set(schema["properties"])
    assert all("description" in p for p in schema["properties"].values())


def test_dashboard_and_health_check_configmaps() -> None:
    objects = render(VALUE_SETS["everything-on"])
    dashboard = one(objects, "ConfigMap", "pt-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["packtrain.json"]) == json.loads(
        (CHART / "files" / "grafana-dashboard.json").read_text()
    )
    health = one(objects, "ConfigMap", "pt-argocd-health")
    for kind in KINDS:
        script = (CHART / "files" / f"argocd-health-{kind.KIND.lower()}.lua").read_text()
        assert health["data"][f"resource.customizations.health.{GROUP}_{kind.KIND}"].strip() == script.strip()
    assert not [o for o in render() if o["kind"] == "ConfigMap"]


def test_notes_render() -> None:
    text = notes()
    assert "all namespaces" in text and f"deployment/{RELEASE}" in text
    scoped = notes(VALUE_SETS["namespace-scope"])
    assert "namespaces team-a, team-b" in scoped
    everything = notes(VALUE_SETS["everything-on"])
    assert "kubectl -n argocd patch configmap argocd-cm" in everything and "pt-dashboard" in everything


def test_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    archive = package(tmp_path)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {
        "packtrain/files/crds/packtrain.dev_packjobs.yaml",
        "packtrain/files/crds/packtrain.dev_sftjobs.yaml",
        "packtrain/files/argocd-health-packjob.lua",
        "packtrain/files/grafana-dashboard.json",
        "packtrain/values.schema.json",
    } <= names
    # The dashboard generator is a development tool, not part of the chart.
    assert not [n for n in names if n.endswith(".py")]
    values = VALUE_SETS["everything-on"]
    assert render(values, chart=archive) == render(values)


def test_load_all_reads_exponent_floats_as_the_api_server_does() -> None:
    assert load_all("a: 1e-05\nb: 1.0e-5\nc: '1e-05'\nd: 10\n") == [
        {"a": 1e-05, "b": 1e-05, "c": "1e-05", "d": 10}
    ]
