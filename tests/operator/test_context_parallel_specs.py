"""An SFTJob's training.contextParallel checked where the operator decides a training job: a world
(resources.nodes x gpusPerNode) it does not divide, or padded rows, fail the SFTJob at once, before it
waits for its data; attention heads it does not divide fail it once the PackJob reported the model's
sizes (InvalidConfiguration, a Warning Event naming what to set, nothing created); a job that splits
is planned per rank. `packtrain render` refuses the same specs at the hand-off."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from support.paths import MODELS
from support.qwen_sizes import released_overrides
from test_handlers import FakeKube, sft_step

from packtrain.core.model_size import planning_config, read_config
from packtrain.operator import handoff, policy
from packtrain.operator import status as st
from packtrain.operator.api import PackJobSpec, SFTJobSpec

SEVEN_B = released_overrides("7B")  # 28 attention heads, 4 KV heads


def _ready_pack(kube: FakeKube, packjob: dict[str, Any]) -> None:
    sizes = planning_config(read_config(MODELS / "qwen2.5-vl"))
    packjob["status"] = {"phase": "Succeeded", "outputPath": "/data/packs/demo", "modelSizes": sizes}
    kube.put("packjobs", packjob)


def _failed(kube: FakeKube, sftjob: dict[str, Any]) -> str:
    """The Ready message of an SFTJob that failed InvalidConfiguration with nothing created, checked to
    be the Warning Event its transition posts."""
    status = sft_step(kube, sftjob)
    assert status["phase"] == "Failed" and kube.created == [], status
    ready = st.get_condition(status["conditions"], "Ready")
    assert ready["reason"] == "InvalidConfiguration", ready
    assert ready["message"].endswith("Fix it, then delete and re-create the SFTJob.")
    assert st.transition_event(None, None, status) == ("Warning", "InvalidConfiguration", ready["message"])
    return str(ready["message"])


@pytest.mark.parametrize(
    "training,resources,named",
    [
        (
            {"contextParallel": 8},
            {"nodes": 2, "gpusPerNode": 6},
            "training.contextParallel 8 does not divide the world size 12 (resources.nodes 2 x gpusPerNode "
            "6): the world is data-parallel x contextParallel ranks; set training.contextParallel to one of "
            "1, 2, 3, 4, 6, 12, or make the world a multiple of 8",
        ),
        (
            {"contextParallel": 2, "mode": "padded"},
            {},
            "training.mode is padded (one sample a row): set training.mode: packed, or "
            "training.contextParallel: 1",
        ),
    ],
)
def test_a_spec_that_cannot_split_fails_before_it_waits_for_data(sftjob, training, resources, named):
    kube = FakeKube()  # no PackJob: the job would otherwise wait for it
    sftjob["spec"]["training"].update(training)
    sftjob["spec"]["resources"].update(resources)
    assert named in _failed(kube, sftjob)


def test_heads_the_degree_does_not_divide_fail_once_the_sizes_are_known(sftjob, packjob):
    kube = FakeKube()
    sftjob["spec"]["model"] = {"path": packjob["spec"]["model"]["path"], "configOverrides": SEVEN_B}
    sftjob["spec"]["training"].update(strategy="fsdp", contextParallel=8)  # 16 GPUs: the world divides
    assert sft_step(kube, sftjob)["phase"] == "WaitingForData"
    _ready_pack(kube, packjob)
    message = _failed(kube, sftjob)
    assert "training.contextParallel 8 does not divide the model's 28 attention heads" in message
    assert "set training.contextParallel to one of 1, 2, 4" in message


def test_a_job_that_splits_is_planned_per_rank(sftjob, packjob):
    plans = []
    for degree in (1, 4):
        kube = FakeKube()
        _ready_pack(kube, packjob)
        job = copy.deepcopy(sftjob)
        job["spec"]["training"].update(strategy="fsdp", contextParallel=degree)
        status = sft_step(kube, job)
        assert kube.created[-1] == "PyTorchJob/demo-sft", status
        plans.append(status["memoryPlan"])
    one, four = plans
    assert "contextParallel" not in one["message"]
    assert "maxLength 4096 from PackJob demo, contextParallel 4: 1024 tokens a GPU" in four["message"]
    assert four["fits"] and four["perGpuBytes"] < one["perGpuBytes"]


def _render(sftjob: dict[str, Any], packjob: dict[str, Any]) -> tuple[str | None, str | None]:
    pack = PackJobSpec.model_validate(packjob["spec"])
    return handoff.memory_plan("demo-sft", SFTJobSpec.model_validate(sftjob["spec"]), pack, policy.Policy())


def test_render_refuses_what_the_operator_refuses(sftjob, packjob):
    packjob["spec"]["model"]["path"] = str(MODELS / "qwen2.5-vl")  # read on this machine, as render does
    sftjob["spec"]["model"] = {"path": packjob["spec"]["model"]["path"], "configOverrides": SEVEN_B}
    sftjob["spec"]["training"].update(strategy="fsdp", contextParallel=3)
    refusal, note = _render(sftjob, packjob)
    assert note is None and refusal is not None
    assert refusal.startswith("SFTJob demo-sft: training.contextParallel 3 does not divide the world size 16")
    sftjob["spec"]["training"]["contextParallel"] = 8
    refusal, _ = _render(sftjob, packjob)
    assert refusal is not None and "does not divide the model's 28 attention heads" in refusal
    sftjob["spec"]["training"]["contextParallel"] = 2
    assert _render(sftjob, packjob) == (None, None)
