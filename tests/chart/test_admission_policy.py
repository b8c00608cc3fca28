"""The chart's ValidatingAdmissionPolicy: the `policy` values enforced by the API server itself.

Offline: what the template renders from the values. On the local API server: every hostile
spec of `policy_cases.HOSTILE` is refused by `kubectl apply` with the message the operator's
own check (`packtrain.operator.policy`) gives, and accepted once the values allow it.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster.controlplane import ControlPlane, free_port
from cluster.waiting import wait_for

from packtrain.operator import policy
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.settings import OperatorDefaults

from .helm import manifest_objects, render
from .policy_cases import BASE_POLICY, HOSTILE, manifest

REPO = Path(__file__).resolve().parents[2]
# Every value that allows one of the hostile cases, at once.
ALLOW_ALL: dict[str, Any] = {**BASE_POLICY}
for *_, _allow in HOSTILE:
    for _key, _value in _allow.items():
        if isinstance(_value, list):
            ALLOW_ALL[_key] = sorted({*ALLOW_ALL.get(_key, []), *_value})
        else:  # a flag, or the highest ceiling any case needs
            ALLOW_ALL[_key] = max(ALLOW_ALL.get(_key, _value), _value)


def admission(values: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    objects = render(values)
    vap = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    binding = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert len(vap) == len(binding) == 1
    return vap[0], binding[0]


def test_policy_and_binding_match_creates_of_packtrain_resources() -> None:
    vap, binding = admission()
    assert vap["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert vap["spec"]["failurePolicy"] == "Fail"
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE"] and rule["resources"] == ["packjobs", "sftjobs"]
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # cluster scope: every namespace
    assert not [o for o in render({"policy": {"admissionPolicy": False}}) if "Admission" in o["kind"]]


def test_namespace_scope_binds_only_the_watched_namespaces() -> None:
    _, binding = admission({"rbac": {"scope": "namespace"}, "operator": {"watchNamespaces": ["a", "b"]}})
    (expr,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert expr == {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}


def test_allowed_placement_drops_its_rule() -> None:
    def rules(values: dict[str, Any]) -> str:
        return json.dumps(admission({"policy": values})[0]["spec"]["validations"])

    assert all(f"policy.{k}" in rules({}) for k in ("allowTolerations", "allowNodeSelector", "allowAffinity"))
    assert "policy.allowTolerations" not in rules({"allowTolerations": True})
    assert "policy.allowNodeSelector" in rules({"allowTolerations": True})


def test_the_chart_defaults_are_the_operators() -> None:
    """The values' runtime and GPU lists are Policy's defaults, and the template's default runtime is the
    API's."""
    values = yaml.safe_load((REPO / "charts" / "packtrain" / "values.yaml").read_text())["policy"]
    ours = policy.Policy()
    assert values["allowedRuntimes"] == ours.allowed_runtimes == [policy.DEFAULT_RUNTIME]
    assert values["gpuResources"] == ours.gpu_resources
    vap, _ = admission()
    runtime = next(v["expression"] for v in vap["spec"]["variables"] if v["name"] == "runtime")
    kind, name = policy.DEFAULT_RUNTIME.split("/")
    assert f"orValue('{kind}')" in runtime and f"orValue('{name}')" in runtime
    resources = next(v["expression"] for v in vap["spec"]["variables"] if v["name"] == "badResources")
    assert f"k in {json.dumps(list(policy.PACKER_RESOURCES), separators=(',', ':'))}" in resources
    assert f"k.startsWith('{policy.HUGEPAGES_PREFIX}')" in resources


IMAGES = [
    "registry.example.com/ml/trainer:2",
    "registry.example.com/ml/a/b@sha256:ab",
    "registry.example.com/x:1",
    "registry.example.com/x:12",
    "registryXexample.com/x:1",
    "evil.io/registry.example.com/ml/x",
    "ghcr.io/packtrain/packer:0.1.0",
    "ghcr.io/packtrain/packer:0.1.0-evil",
    "ghcr.io/packtrain/trainer:9",
]
PATTERNS = ["registry.example.com/ml/*", "registry.example.com/x:?", "a+b(c)|[d]{e}^$.f"]


def test_image_regexes_agree_with_the_operator() -> None:
    """The template's pattern translation (RE2 regexes in the CEL) decides every image as policy.py does."""
    values = {"policy": {"allowedImages": PATTERNS}}
    vap, _ = admission(values)
    rule = next(v["expression"] for v in vap["spec"]["validations"] if "variables.image" in v["expression"])
    regexes = json.loads(rule.split("|| ", 1)[1].rsplit(".exists", 1)[0])
    deployment = next(o for o in render(values) if o["kind"] == "Deployment")
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
        if "value" in e
    }
    defaults = OperatorDefaults.from_env(env)
    decided = {}
    for image in [*IMAGES, "a+b(c)|[d]{e}^$.f", "ab(c)|[d]{e}^$.f", "a+b(c)|[d]{e}^$xf"]:
        ours = policy.image_allowed(image, defaults.policy, (defaults.packer_image, defaults.trainer_image))
        assert any(re.search(r, image) for r in regexes) is ours, image
        decided[image] = ours
    assert decided["registry.example.com/ml/a/b@sha256:ab"] and not decided["registry.example.com/x:12"]
    assert (
        decided["a+b(c)|[d]{e}^$.f"] and not decided["ab(c)|[d]{e}^$.f"] and not decided["a+b(c)|[d]{e}^$xf"]
    )


# On the local API server


def operator_defaults(release: dict[str, Any]) -> OperatorDefaults:
    """What the operator installed by this release would enforce: its Deployment's environment."""
    deployment = next(o for o in manifest_objects(release) if o["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return OperatorDefaults.from_env({e["name"]: e["value"] for e in env if "value" in e})


def apply(cluster: ControlPlane, namespace: str, doc: dict[str, Any]) -> tuple[bool, str]:
    """`kubectl apply --dry-run=server`: (accepted, kubectl's stderr)."""
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False
    )
    return proc.returncode == 0, proc.stderr


def spec_of(doc: dict[str, Any]) -> PackJobSpec | SFTJobSpec:
    return (PackJobSpec if doc["kind"] == "PackJob" else SFTJobSpec).model_validate(doc["spec"])


@pytest.mark.cluster
def test_api_server_refuses_what_the_operator_refuses_with_the_same_message(
    kube_cluster: ControlPlane, install: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    strict_ns, open_ns = f"strict-{uuid.uuid4().hex[:6]}", f"open-{uuid.uuid4().hex[:6]}"
    for ns in (strict_ns, open_ns):
        kube_cluster.kubectl("create", "namespace", ns)
    try:

        def values(ns: str, allowed: dict[str, Any], crds: bool) -> dict[str, Any]:
            return {
                "crds": {"install": crds},
                "rbac": {"scope": "namespace"},
                "operator": {
                    "watchNamespaces": [ns],
                    "metricsPort": free_port(),
                    "livenessPort": free_port(),
                },
                "policy": allowed,
            }

        strict = operator_defaults(install(values(strict_ns, BASE_POLICY, crds=True)))
        permissive = operator_defaults(install(values(open_ns, ALLOW_ALL, crds=False)))

        # The policies take effect within moments of their creation; an image no value allows shows when.
        probe = manifest("PackJob", {"workers": {"image": "other.example.com/x:1"}}, name="probe")
        for ns in (strict_ns, open_ns):
            wait_for(
                f"the admission policy of {ns}",
                lambda ns=ns: not apply(kube_cluster, ns, probe)[0],
                timeout=60,
            )

        # The quickstart needs nothing the default policy forbids.
        for doc in yaml.safe_load_all((REPO / "examples" / "quickstart.yaml").read_text()):
            accepted, err = apply(kube_cluster, strict_ns, doc)
            assert accepted, err

        for name, kind, patch, field, key, _ in HOSTILE:
            doc = manifest(kind, patch, name=name)
            (violation,) = policy.check(spec_of(doc), strict)
            assert (violation.field, violation.key) == (field, key)
            accepted, err = apply(kube_cluster, strict_ns, doc)
            assert not accepted, f"{name} was admitted"
            assert "denied request" in err and violation.message in err, (name, violation.message, err)
            # The values that allow it make both the operator and the API server accept it.
            assert policy.check(spec_of(doc), permissive) == []
            accepted, err = apply(kube_cluster, open_ns, doc)
            assert accepted, (name, err)
    finally:
        for ns in (strict_ns, open_ns):
            kube_cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.mark.cluster
def test_api_server_type_checks_the_policy_cleanly(
    kube_cluster: ControlPlane, install: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """The API server checks each expression against the CRD schemas: a misspelt field would show here."""
    release = install({"operator": {"metricsPort": free_port(), "livenessPort": free_port()}})
    name = next(o for o in manifest_objects(release) if o["kind"] == "ValidatingAdmissionPolicy")["metadata"][
        "name"
    ]

    def checked() -> dict[str, Any] | None:
        out = kube_cluster.kubectl("get", "validatingadmissionpolicy", name, "-o", "json").stdout
        status = json.loads(out).get("status") or {}
        return status if status.get("observedGeneration") else None

    status = wait_for("the policy's type check", checked, timeout=60)
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status
