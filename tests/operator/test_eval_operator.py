"""An SFTJob's evaluation set on a cluster: the evaluation PackJob is waited for and mounted, and the
trainer's evaluation loss reaches `status.progress`."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import kubernetes_validate
import yaml
from test_handlers import FakeKube, sft_step

from packtrain.operator import builders
from packtrain.operator import status as st
from packtrain.operator.api import PackJobSpec, SFTJobSpec, SFTJobStatus
from packtrain.operator.settings import OperatorDefaults

DEFAULTS = OperatorDefaults(
    packer_image="ghcr.io/packtrain/packer:test", trainer_image="ghcr.io/packtrain/trainer:test"
)
NOW = "2026-01-01T00:00:00Z"


def _eval_packjob(packjob: dict[str, Any], claim: str) -> dict[str, Any]:
    evals = copy.deepcopy(packjob)
    evals["metadata"]["name"] = "demo-eval"
    evals["spec"]["output"] = {"claimName": claim}
    return evals


def _train_config(kube: FakeKube) -> dict[str, Any]:
    cm = kube.objects[("configmaps", "ml", "demo-sft-train-config")]
    return yaml.safe_load(next(iter(cm["data"].values())))["spec"]


def test_eval_loss_from_the_summary_reaches_the_status() -> None:
    summary = {"steps": 40, "final_loss": 1.5, "eval_loss": 1.75, "eval_units": 18, "tokens_per_second": 9.0}
    progress = st.train_progress(summary, NOW)
    assert progress == {"step": 40, "loss": 1.5, "evalLoss": 1.75, "tokensPerSecond": 9.0, "updatedAt": NOW}
    # The status model (and so the CRD's status schema, which the API server prunes by) has the field.
    assert SFTJobStatus.model_validate({"progress": progress}).progress.eval_loss == 1.75  # type: ignore[union-attr]
    assert "evalLoss" not in (
        st.train_progress({"steps": 1, "final_loss": 2.0, "eval_loss": None}, NOW) or {}
    )


def test_sftjob_waits_for_its_eval_packjob_and_mounts_its_claim(
    sftjob: dict[str, Any], packjob: dict[str, Any]
) -> None:
    sftjob["spec"]["data"]["evalPackJobRef"] = "demo-eval"
    kube = FakeKube()
    packjob["status"] = {"phase": "Succeeded", "outputPath": "/data/packs/demo"}
    kube.put("packjobs", packjob)
    status = sft_step(kube, sftjob)
    assert status["phase"] == "WaitingForData" and kube.created == []
    assert "demo-eval" in status["conditions"][0]["message"]
    evals = _eval_packjob(packjob, "eval-claim")
    evals["status"] = {"phase": "Succeeded", "outputPath": "/data/demo-eval"}
    kube.put("packjobs", evals)
    assert sft_step(kube, sftjob)["phase"] == "Pending"
    data = _train_config(kube)["data"]
    assert data["evalPath"] == "/eval-data/demo-eval" and data["evalPackJobRef"] is None
    assert data["path"] == "/data/packs/demo"
    ptj = kube.objects[("pytorchjobs", "ml", "demo-sft")]
    pod = ptj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert {
        "name": "eval-data",
        "persistentVolumeClaim": {"claimName": "eval-claim", "readOnly": True},
    } in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "eval-data", "mountPath": "/eval-data", "readOnly": True} in mounts
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "m"}, "spec": pod}, "1.34.0", strict=True
    )


def test_eval_pack_on_the_training_claim_reads_through_the_data_mount(
    sftjob: dict[str, Any], packjob: dict[str, Any]
) -> None:
    sftjob["spec"]["data"]["evalPackJobRef"] = "demo-eval"
    spec = SFTJobSpec.model_validate(sftjob["spec"])
    data = builders.data_source(
        spec, PackJobSpec.model_validate(packjob["spec"]), {"outputPath": "/data/packs/demo"}
    )
    evals = builders.eval_source(
        data, "demo-eval", PackJobSpec.model_validate(_eval_packjob(packjob, "packtrain-data")["spec"])
    )
    assert evals == builders.EvalSource("/data/demo-eval")  # same claim, mounted whole at /data
    job = builders.pytorch_job("demo-sft", "ml", spec, dataclasses.replace(data, eval=evals), DEFAULTS)
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert all(v["name"] != "eval-data" for v in pod["volumes"])
    # Without an evaluation PackJob the pods are unchanged.
    plain = builders.pytorch_job("demo-sft", "ml", spec, data, DEFAULTS)
    assert [
        v["name"] for v in plain["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["volumes"]
    ] == [v["name"] for v in pod["volumes"]]
