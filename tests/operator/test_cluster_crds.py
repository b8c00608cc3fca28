"""The CRDs on the real API server (tests/cluster), no operator needed: printer columns, validation
messages, immutable specs and the defaults the server applies."""

from __future__ import annotations

from typing import Any

import pytest
from cluster_operator import GROUP, VERSION, create, custom, packjob, rejected, sftjob
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.cluster


def test_crds_are_served_with_printer_columns(
    kube_cluster: Any, api: client.ApiClient, namespace: str
) -> None:
    create(api, namespace, packjob("cols"))
    header = kube_cluster.kubectl("get", "pj", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STAGE", "DONE%", "SAMPLES", "REJECTED", "FILL", "AGE"]
    body = sftjob("cols-sft", "cols")
    create(api, namespace, body)
    out = kube_cluster.kubectl("get", "sft", "-n", namespace).stdout.splitlines()
    assert out[0].split() == ["NAME", "PHASE", "STEP", "MAX", "LOSS", "BACKEND", "NODES", "GPUS", "AGE"]
    assert out[1].split()[:4] == ["cols-sft", "pytorchjob", "2", "8"]  # no status yet: no operator here
    assert "cols" in kube_cluster.kubectl("get", "packtrain", "-n", namespace).stdout  # the category


def test_invalid_specs_are_rejected_with_clear_messages(api: client.ApiClient, namespace: str) -> None:
    body = packjob("bad")
    del body["spec"]["output"]
    assert "spec.output: Required value" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["workers"]["count"] = 0
    assert "spec.workers.count: Invalid value: 0" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["packing"]["algorithm"] = "best"
    assert 'spec.packing.algorithm: Unsupported value: "best"' in rejected(api, namespace, body)
    body = packjob("x" * 46)
    assert "metadata.name must be at most 45 characters" in rejected(api, namespace, body)
    body = packjob("bad")
    body["spec"]["volumes"] = [{"name": "output", "claimName": "c", "mountPath": "/c"}]
    assert "volume names output, config, tmp are the operator's own" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["data"]["path"] = "/data/p"
    assert "spec.data needs exactly one of path" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["training"]["metricsPort"] = 9000
    assert "set spec.metricsPort, not spec.training.metricsPort" in rejected(api, namespace, body)
    body = sftjob("bad-sft", "p")
    body["spec"]["backend"] = "mpijob"
    assert 'spec.backend: Unsupported value: "mpijob"' in rejected(api, namespace, body)


def test_spec_changes_are_refused_except_suspend(api: client.ApiClient, namespace: str) -> None:
    create(api, namespace, packjob("frozen"))
    with pytest.raises(ApiException) as err:
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "packjobs", "frozen", {"spec": {"packing": {"maxLength": 8192}}}
        )
    assert err.value.status == 422
    assert "spec.packing is immutable: delete the PackJob and create it again" in err.value.body
    create(api, namespace, sftjob("frozen-sft", "frozen"))
    with pytest.raises(ApiException) as err:
        custom(api).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "sftjobs", "frozen-sft", {"spec": {"resources": {"nodes": 4}}}
        )
    assert "spec.resources is immutable" in err.value.body
    patched = custom(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, "sftjobs", "frozen-sft", {"spec": {"suspend": True}}
    )
    assert patched["spec"]["suspend"] is True


def test_server_applies_the_model_defaults(api: client.ApiClient, namespace: str) -> None:
    created = create(api, namespace, packjob("defaults"))
    assert created["spec"]["packing"]["algorithm"] == "bfd"
    assert created["spec"]["output"]["mountPath"] == "/data"
    assert created["spec"]["source"]["fieldMap"]["images"] == "images"
    sft = create(api, namespace, sftjob("defaults-sft", "defaults"))
    assert sft["spec"]["backend"] == "pytorchjob" and sft["spec"]["training"]["maxGradNorm"] == 1.0
