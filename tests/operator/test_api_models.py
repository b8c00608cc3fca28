"""Validation the operator applies with the same models the CRDs are generated from."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from packtrain.operator.api import PackJobSpec, SFTJobSpec


def test_sftjob_needs_exactly_one_data_source(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["data"] = {"packJobRef": "demo", "path": "/data/p"}
    with pytest.raises(ValidationError, match="exactly one of path"):
        SFTJobSpec.model_validate(sftjob["spec"])
    sftjob["spec"]["data"] = {"path": "/data/p"}
    with pytest.raises(ValidationError, match="spec.volumes.data is required"):
        SFTJobSpec.model_validate(sftjob["spec"])
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs"}
    assert SFTJobSpec.model_validate(sftjob["spec"]).data.path == "/data/p"


def test_metrics_port_belongs_to_the_cluster_section(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["training"]["metricsPort"] = 9000
    with pytest.raises(ValidationError, match="set spec.metricsPort"):
        SFTJobSpec.model_validate(sftjob["spec"])


def test_defaults(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    spec = SFTJobSpec.model_validate(sftjob["spec"])
    assert (spec.backend, spec.suspend, spec.metrics_port, spec.clean_pod_policy) == (
        "pytorchjob",
        False,
        9400,
        "None",
    )
    pj = PackJobSpec.model_validate(packjob["spec"])
    assert pj.output.mount_path == "/data" and pj.workers.backoff_limit_per_index == 1


def test_unknown_keys_are_errors(packjob: dict[str, Any]) -> None:
    packjob["spec"]["workers"]["replicas"] = 3
    with pytest.raises(ValidationError, match="replicas"):
        PackJobSpec.model_validate(packjob["spec"])


def test_train_config_resolves_the_pack(sftjob: dict[str, Any]) -> None:
    cfg = SFTJobSpec.model_validate(sftjob["spec"]).train_config("/data/packs/demo")
    assert cfg["data"]["path"] == "/data/packs/demo" and cfg["data"]["packJobRef"] is None
    assert cfg["training"]["metricsPort"] == 9400 and cfg["training"]["maxSteps"] == 1000


def test_extra_volumes_cannot_take_the_operators_names(packjob: dict[str, Any]) -> None:
    packjob["spec"]["volumes"] = [{"name": "config", "claimName": "c", "mountPath": "/c"}]
    with pytest.raises(ValidationError, match="are the operator's own"):
        PackJobSpec.model_validate(packjob["spec"])
