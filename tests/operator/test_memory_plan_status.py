"""The SFTJob's GPU memory plan before its training job exists: from the sizes its PackJob's convert
stage reported (`status.modelSizes`), refused (Failed, InsufficientGPUMemory, naming the fix, no
child created) or recorded in `status.memoryPlan` with its Event; not planned when the operator
cannot know the model."""

from __future__ import annotations

import json
from typing import Any

from support.paths import MODELS
from support.qwen_sizes import released_overrides
from test_handlers import FakeKube, sft_step

from packtrain.core.model_size import planning_config, read_config
from packtrain.operator import status as st
from packtrain.operator.status.pack import pack_status

SEVEN_B = released_overrides("7B")


def _ready_pack(kube: FakeKube, packjob: dict[str, Any]) -> None:
    sizes = planning_config(read_config(MODELS / "qwen2.5-vl"))
    packjob["status"] = {"phase": "Succeeded", "outputPath": "/data/packs/demo", "modelSizes": sizes}
    kube.put("packjobs", packjob)


def test_a_job_that_cannot_fit_fails_before_its_training_job(sftjob, packjob):
    kube = FakeKube()
    _ready_pack(kube, packjob)
    sftjob["spec"]["model"] = {"path": packjob["spec"]["model"]["path"], "configOverrides": SEVEN_B}
    sftjob["spec"]["resources"]["gpuMemory"] = "80Gi"
    status = sft_step(kube, sftjob)
    assert status["phase"] == "Failed" and kube.created == []
    ready = st.get_condition(status["conditions"], "Ready")
    assert ready["reason"] == "InsufficientGPUMemory"
    assert "training.strategy: fsdp" in ready["message"] and "delete and re-create" in ready["message"]


def test_a_job_that_fits_records_its_plan_and_posts_it_once(sftjob, packjob):
    kube = FakeKube()
    _ready_pack(kube, packjob)
    sftjob["spec"]["training"].update(strategy="fsdp", activationCheckpointing=True)
    previous = dict(sftjob.get("status") or {})
    status = sft_step(kube, sftjob)
    assert kube.created[-1] == "PyTorchJob/demo-sft"
    plan = status["memoryPlan"]
    assert plan["planned"] and plan["fits"] and plan["gpuMemoryBytes"] == 80 * 2**30  # the policy default
    assert plan["perGpuBytes"] < plan["gpuMemoryBytes"] and "maxLength 4096" in plan["message"]
    assert st.memory_plan_event(previous, status) == ("Normal", "MemoryPlanned", plan["message"])
    assert sft_step(kube, sftjob)["memoryPlan"] == plan  # kept while the child is mirrored
    assert st.memory_plan_event(status, sft_step(kube, sftjob)) is None


def test_without_the_models_sizes_the_operator_says_it_did_not_plan(sftjob, packjob):
    kube = FakeKube()
    _ready_pack(kube, packjob)
    sftjob["spec"]["model"]["path"] = "/models/elsewhere"
    plan = sft_step(kube, sftjob)["memoryPlan"]
    assert not plan["planned"] and "is not PackJob demo's model.path" in plan["message"]
    assert "exits 2" in plan["message"]
    assert st.memory_plan_event({}, {"memoryPlan": plan})[1] == "MemoryNotPlanned"


def test_the_convert_stage_reports_the_sizes_into_the_packjob_status(packjob):
    from packtrain.operator.api import PackJobSpec

    sizes = planning_config(read_config(MODELS / "qwen3.5"))
    summary = {"stage": "convert", "index": 0, "count": 1, "samples": 1, "converted": 1, "rejected": 0,
               "tokens": 9, "model_sizes": sizes}  # fmt: skip
    pod = {
        "metadata": {"name": "demo-convert-0"},
        "status": {
            "phase": "Succeeded",
            "containerStatuses": [
                {"name": "packer", "state": {"terminated": {"exitCode": 0, "message": json.dumps(summary)}}}
            ],
        },
    }
    spec = PackJobSpec.model_validate(packjob["spec"])
    decision = pack_status("demo", 1, spec, {}, {"convert": [pod]}, None, "2026-01-01T00:00:00Z")
    assert decision.status["modelSizes"] == sizes
    later = pack_status("demo", 1, spec, {}, {}, decision.status, "2026-01-01T00:01:00Z")
    assert later.status["modelSizes"] == sizes  # kept once the pods are gone
    assert len(json.dumps(summary)) < 4096  # fits a termination message
