"""The admin's policy in the operator: what a CR may put into its pods, checked before any child exists.

`HOSTILE` is the list of specs a CR author could use to get a pod they should not have; the
chart's admission policy is tested against the same list on the real API server
(tests/chart/test_admission_policy.py), with the same messages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart.policy_cases import BASE_POLICY, HOSTILE, manifest
from cluster_operator import condition, create, events, get, jobs, wait_for
from operator_fixtures import PACKJOB, SFTJOB
from test_handlers import FakeKube

from packtrain.operator import handlers, policy
from packtrain.operator import status as st
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.settings import OperatorDefaults

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = OperatorDefaults(packer_image="ghcr.io/packtrain/packer:1", trainer_image="trainer:1")


def spec_of(doc: dict[str, Any]) -> PackJobSpec | SFTJobSpec:
    return (PackJobSpec if doc["kind"] == "PackJob" else SFTJobSpec).model_validate(doc["spec"])


def defaults_with(**values: Any) -> OperatorDefaults:
    return OperatorDefaults.from_env(
        {
            "PACKTRAIN_PACKER_IMAGE": DEFAULTS.packer_image,
            "PACKTRAIN_TRAINER_IMAGE": DEFAULTS.trainer_image,
            "PACKTRAIN_POLICY": json.dumps(values),
        }
    )


def test_the_fixtures_and_the_quickstart_pass_the_default_policy() -> None:
    assert policy.check(spec_of(PACKJOB), DEFAULTS) == []
    assert policy.check(spec_of(SFTJOB), DEFAULTS) == []
    for doc in yaml.safe_load_all((REPO / "examples" / "quickstart.yaml").read_text()):
        assert policy.check(spec_of(doc), OperatorDefaults()) == [], doc["kind"]
    # The operator's own images, named explicitly, are allowed.
    named = manifest("PackJob", {"workers": {"image": DEFAULTS.packer_image}})
    assert policy.check(spec_of(named), DEFAULTS) == []


@pytest.mark.parametrize(
    ("name", "kind", "patch", "field", "key", "allow"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_hostile_spec_is_refused_naming_field_and_key(
    name: str, kind: str, patch: dict[str, Any], field: str, key: str, allow: dict[str, Any]
) -> None:
    spec = spec_of(manifest(kind, patch))
    violations = policy.check(spec, defaults_with(**BASE_POLICY))
    assert [(v.field, v.key) for v in violations] == [(field, key)]
    assert field in violations[0].message and key in violations[0].message
    # The values key the message names is the one that allows it.
    assert policy.check(spec, defaults_with(**{**BASE_POLICY, **allow})) == []


def test_several_violations_are_all_reported() -> None:
    spec = spec_of(
        manifest(
            "SFTJob",
            {
                "image": "x:1",
                "serviceAccountName": "admin",
                "resources": {"nodeSelector": {}, "podAnnotations": {"b": "1", "a": "2"}},
            },
        )
    )
    violations = policy.check(spec, DEFAULTS)
    assert [v.field for v in violations] == [
        "spec.image",
        "spec.serviceAccountName",
        "spec.resources.nodeSelector",
        "spec.resources.podAnnotations",
    ]
    assert violations[3].message.startswith(
        "spec.resources.podAnnotations has keys no prefix"
    ) and ": a, b;" in (violations[3].message)


@pytest.mark.parametrize(
    ("pattern", "image", "allowed"),
    [
        ("registry.example.com/ml/*", "registry.example.com/ml/trainer:2", True),
        ("registry.example.com/ml/*", "registry.example.com/ml/team/x@sha256:ab", True),
        ("registry.example.com/ml/*", "registry.example.com/other/x:1", False),
        ("registry.example.com/ml/*", "evil.io/registry.example.com/ml/x", False),  # anchored at the start
        ("registry.example.com/x:?", "registry.example.com/x:1", True),
        ("registry.example.com/x:?", "registry.example.com/x:12", False),
        ("registry.example.com/x", "registryXexample.com/x", False),  # a dot is a dot
        ("registry.example.com/x", "registry.example.com/x:latest", False),  # anchored at the end
    ],
)
def test_image_patterns(pattern: str, image: str, allowed: bool) -> None:
    assert policy.image_allowed(image, policy.Policy(allowed_images=[pattern]), ()) is allowed


def test_the_runtime_is_checked_only_for_trainjob_and_defaults_to_torch_distributed() -> None:
    own = manifest("SFTJob", {"runtime": {"kind": "TrainingRuntime", "name": "mine"}})
    assert policy.check(spec_of(own), DEFAULTS) == []  # pytorchjob: the runtime is not used
    assert policy.check(spec_of(manifest("SFTJob", {"backend": "trainjob"})), DEFAULTS) == []
    (violation,) = policy.check(
        spec_of(manifest("SFTJob", {"backend": "trainjob"})), defaults_with(allowedRuntimes=[])
    )
    assert violation.message.startswith(
        f'spec.runtime "{policy.DEFAULT_RUNTIME}" is not an allowed training runtime'
    )
    assert policy.DEFAULT_RUNTIME == "ClusterTrainingRuntime/torch-distributed"


def test_a_packer_pod_may_request_cpu_memory_storage_and_hugepages() -> None:
    resources = {
        "requests": {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "10Gi", "hugepages-2Mi": "1Gi"},
        "limits": {"hugepages-1Gi": "2Gi", "nvidia.com/gpu": 1},
    }
    assert policy.check(spec_of(manifest("PackJob", {"workers": {"resources": resources}})), DEFAULTS) == []
    odd = {
        "limits": {"example.com/fpga": 1, "amd.com/gpu": 1},
        "requests": {"example.com/fpga": 1, "a.io/b": 2},
    }
    (violation,) = policy.check(spec_of(manifest("PackJob", {"workers": {"resources": odd}})), DEFAULTS)
    assert ": a.io/b, example.com/fpga;" in violation.message  # each once, sorted


def test_bad_policy_values_are_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="PACKTRAIN_POLICY"):
        OperatorDefaults.from_env({"PACKTRAIN_POLICY": json.dumps({"allowTolerance": True})})
    with pytest.raises(ValueError, match="PACKTRAIN_POLICY"):
        OperatorDefaults.from_env({"PACKTRAIN_POLICY": json.dumps({"maxPackWorkers": 0})})


def test_operator_fails_a_violating_packjob_without_creating_anything() -> None:
    body = manifest("PackJob", {"workers": {"image": "evil.example.com/miner:1"}})
    body["metadata"] = {"name": "hostile", "namespace": "ml", "uid": "u1", "generation": 1}
    kube = FakeKube()
    status = handlers.reconcile_packjob(kube, body, DEFAULTS)  # type: ignore[arg-type]
    assert status["phase"] == "Failed" and kube.created == []
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PolicyViolation"
    assert "spec.workers.image" in failed["message"] and "policy.allowedImages" in failed["message"]
    # The transition posts a Warning Event carrying the same reason and message.
    assert st.transition_event(None, None, status) == ("Warning", "PolicyViolation", failed["message"])
    body["status"] = status
    assert handlers.reconcile_packjob(kube, body, DEFAULTS) == status and kube.created == []  # type: ignore[arg-type]


def test_operator_fails_a_violating_sftjob_before_waiting_for_data() -> None:
    body = manifest(
        "SFTJob", {"resources": {"nodes": 1, "gpusPerNode": 1, "tolerations": [{"operator": "Exists"}]}}
    )
    body["spec"]["data"] = {"packJobRef": "not-there-yet"}
    body["spec"]["volumes"].pop("data")
    body["metadata"] = {"name": "hostile", "namespace": "ml", "uid": "u2", "generation": 1}
    kube = FakeKube()
    status = handlers.reconcile_sftjob(kube, body, DEFAULTS)  # type: ignore[arg-type]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert status["phase"] == "Failed" and kube.created == []
    assert failed["reason"] == "PolicyViolation" and "policy.allowTolerations" in failed["message"]


@pytest.mark.cluster
def test_operator_refuses_a_violating_packjob_on_the_cluster(
    api: Any,
    namespace: str,
    operator: Any,
) -> None:
    """No admission policy here (the CRDs alone): the operator's own check stops it, with an Event."""
    body = manifest("PackJob", {"workers": {"image": "evil.example.com/miner:1"}}, name="hostile")
    body["spec"]["output"] = {"claimName": "packtrain-data", "subPath": "packs/hostile"}
    create(api, namespace, body)
    wait_for(
        "the PackJob to fail",
        lambda: (get(api, namespace, "packjobs", "hostile").get("status") or {}).get("phase") == "Failed",
    )
    failed = condition(get(api, namespace, "packjobs", "hostile"), "Failed")
    assert failed["reason"] == "PolicyViolation"
    assert 'spec.workers.image "evil.example.com/miner:1"' in failed["message"]
    assert "policy.allowedImages" in failed["message"]
    warning = wait_for(
        "the PolicyViolation Event",
        lambda: [
            e
            for e in events(api, namespace, "hostile")
            if e.reason == "PolicyViolation" and e.type == "Warning"
        ],
    )
    assert "policy.allowedImages" in warning[0].message
    assert jobs(api, namespace, "hostile") == []
