"""The manifests the operator creates: golden files plus the properties that matter on a cluster."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from operator_fixtures import assert_golden

from packtrain.core.errors import EXIT_CONFIG
from packtrain.operator import builders
from packtrain.operator.api import PackJobSpec, SFTJobSpec
from packtrain.operator.settings import OperatorDefaults

DEFAULTS = OperatorDefaults(
    packer_image="ghcr.io/packtrain/packer:test", trainer_image="ghcr.io/packtrain/trainer:test"
)
K8S = "1.34.0"


def _pack(body: dict[str, Any]) -> PackJobSpec:
    return PackJobSpec.model_validate(body["spec"])


def _sft(body: dict[str, Any]) -> SFTJobSpec:
    return SFTJobSpec.model_validate(body["spec"])


def _data(sftjob: dict[str, Any], packjob: dict[str, Any]) -> builders.DataSource:
    return builders.data_source(_sft(sftjob), _pack(packjob), {"outputPath": "/data/packs/demo"})


@pytest.mark.parametrize("stage", ["convert", "plan", "materialize"])
def test_pack_job_golden_and_valid(packjob: dict[str, Any], stage: str) -> None:
    job = builders.pack_job("demo", "ml", _pack(packjob), stage, DEFAULTS)
    assert_golden(f"packjob-{stage}", job)
    kubernetes_validate.validate(job, K8S, strict=True)


def test_indexed_stages_split_across_workers(packjob: dict[str, Any]) -> None:
    spec = _pack(packjob)
    convert = builders.pack_job("demo", "ml", spec, "convert", DEFAULTS)["spec"]
    plan = builders.pack_job("demo", "ml", spec, "plan", DEFAULTS)["spec"]
    assert convert["completionMode"] == "Indexed"
    assert convert["completions"] == convert["parallelism"] == 4
    assert convert["backoffLimitPerIndex"] == 1 and convert["maxFailedIndexes"] == 0
    command = convert["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["packtrain", "pack", "convert"] and command[-2:] == ["--count", "4"]
    assert "--index" not in command  # every pod reads JOB_COMPLETION_INDEX
    assert plan["completionMode"] == "NonIndexed" and plan["completions"] == 1
    assert "--count" not in plan["template"]["spec"]["containers"][0]["command"]


def test_pod_failure_policy_fails_fast_on_config_errors(packjob: dict[str, Any]) -> None:
    rules = builders.pack_job("demo", "ml", _pack(packjob), "convert", DEFAULTS)["spec"]["podFailurePolicy"][
        "rules"
    ]
    assert rules[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": "packer", "operator": "In", "values": [EXIT_CONFIG]},
    }
    assert rules[1]["action"] == "Ignore" and rules[1]["onPodConditions"][0]["type"] == "DisruptionTarget"


def test_pack_pods_run_on_cpu_pool_with_output_and_config(packjob: dict[str, Any]) -> None:
    pod = builders.pack_job("demo", "ml", _pack(packjob), "materialize", DEFAULTS)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"packtrain.dev/pool": "cpu"}
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["output"]["persistentVolumeClaim"] == {"claimName": "packtrain-data"}
    assert volumes["config"]["configMap"]["name"] == "demo-pack-config"
    container = pod["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert "/data/packs/demo" in container["command"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data", "/etc/packtrain", "/tmp"}


def test_pack_scheduling_overrides_and_extra_volumes(packjob: dict[str, Any]) -> None:
    packjob["spec"]["workers"].update(
        nodeSelector={}, tolerations=[{"key": "spot", "operator": "Exists"}], serviceAccountName="packer"
    )
    packjob["spec"]["volumes"] = [{"name": "datasets", "claimName": "datasets", "mountPath": "/datasets"}]
    pod = builders.pack_job("demo", "ml", _pack(packjob), "convert", DEFAULTS)["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod  # an explicit {} opts out of the pool
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
    assert pod["serviceAccountName"] == "packer"
    assert {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}} in pod[
        "volumes"
    ]


def test_pack_config_map_holds_only_the_packer_sections(packjob: dict[str, Any]) -> None:
    cm = builders.pack_config_map("demo", "ml", _pack(packjob))
    assert cm["metadata"]["name"] == "demo-pack-config" and list(cm["data"]) == ["packjob.yaml"]
    doc = yaml.safe_load(cm["data"]["packjob.yaml"])
    assert doc["kind"] == "PackJob" and set(doc["spec"]) == {"source", "model", "packing"}
    from packtrain.core.config import PackConfig

    PackConfig.model_validate(doc["spec"])  # what `packtrain pack -c` will load


def test_output_dir_defaults_to_the_name(packjob: dict[str, Any]) -> None:
    del packjob["spec"]["output"]["subPath"]
    assert builders.pack_output_dir("demo", _pack(packjob)) == "/data/demo"


def test_pytorchjob_golden(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    job = builders.pytorch_job("demo-sft", "ml", _sft(sftjob), _data(sftjob, packjob), DEFAULTS)
    assert_golden("sftjob-pytorchjob", job)


def test_pytorchjob_shape(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    job = builders.pytorch_job("demo-sft", "ml", _sft(sftjob), _data(sftjob, packjob), DEFAULTS)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["metadata"]["name"] == "demo-sft"
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    spec = job["spec"]
    assert spec["nprocPerNode"] == "8"
    # Queued (queueName): created suspended, for Kueue to admit by unsuspending it.
    assert spec["runPolicy"] == {"backoffLimit": 0, "cleanPodPolicy": "None", "suspend": True}
    assert spec["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "cpu": 64, "memory": "512Gi"}
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert pod["nodeSelector"] == {"packtrain.dev/pool": "gpu"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["data"] == {"name": "data", "mountPath": "/data", "readOnly": True}
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints"
    assert container["command"][:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8"]
    assert container["command"][container["command"].index("--data") + 1] == "/data/packs/demo"
    assert container["command"][container["command"].index("--output") + 1] == "/checkpoints/demo-sft"


def test_single_node_pytorchjob_has_no_workers(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    sftjob["spec"]["resources"] = {"nodes": 1, "gpusPerNode": 1}
    job = builders.pytorch_job("demo-sft", "ml", _sft(sftjob), _data(sftjob, packjob), DEFAULTS)
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert (
        "--standalone"
        in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    )


def test_train_config_map_resolves_data_and_metrics(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    # No golden file: the content follows the trainer's config model, checked by validating it below.
    cm = builders.train_config_map("demo-sft", "ml", _sft(sftjob), _data(sftjob, packjob))
    assert cm["metadata"]["name"] == "demo-sft-train-config" and list(cm["data"]) == ["sftjob.yaml"]
    doc = yaml.safe_load(cm["data"]["sftjob.yaml"])
    assert doc["spec"]["data"]["path"] == "/data/packs/demo" and doc["spec"]["data"]["packJobRef"] is None
    assert doc["spec"]["training"]["metricsPort"] == 9400
    from packtrain.core.sft_config import SFTSpecCore

    SFTSpecCore.model_validate(doc["spec"])  # what `packtrain train -c` will load


def test_trainjob_golden(sftjob: dict[str, Any], packjob: dict[str, Any]) -> None:
    sftjob["spec"]["backend"] = "trainjob"
    job = builders.training_job("demo-sft", "ml", _sft(sftjob), _data(sftjob, packjob), DEFAULTS)
    assert_golden("sftjob-trainjob", job)
    assert job["kind"] == "TrainJob"
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }
    assert job["spec"]["trainer"]["numNodes"] == 2 and job["spec"]["trainer"]["numProcPerNode"] == 8
    override = job["spec"]["podTemplateOverrides"][0]
    assert override["targetJobs"] == [{"name": "node"}]
    assert override["spec"]["containers"][0]["name"] == "node"


def test_data_path_mode_uses_the_named_claim(sftjob: dict[str, Any]) -> None:
    sftjob["spec"]["data"] = {"path": "/data/packs/other"}
    sftjob["spec"]["volumes"]["data"] = {"claimName": "packs", "subPath": "team-a"}
    data = builders.data_source(_sft(sftjob), None, None)
    assert data == builders.DataSource("packs", "/data", "/data/packs/other", "team-a")


def test_defaults_from_env() -> None:
    env = {
        "PACKTRAIN_PACKER_IMAGE": "registry.local/packer:1",
        "PACKTRAIN_GPU_NODE_SELECTOR": '{"pool": "h100"}',
        "PACKTRAIN_GPU_TOLERATIONS": "[]",
    }
    d = OperatorDefaults.from_env(env)
    assert d.packer_image == "registry.local/packer:1"
    assert d.trainer_image.startswith("ghcr.io/packtrain/trainer:")
    assert d.gpu_node_selector == {"pool": "h100"} and d.gpu_tolerations == []
    assert d.cpu_node_selector == {"packtrain.dev/pool": "cpu"}
    with pytest.raises(ValueError, match="PACKTRAIN_CPU_TOLERATIONS must be JSON"):
        OperatorDefaults.from_env({"PACKTRAIN_CPU_TOLERATIONS": "key=x"})
