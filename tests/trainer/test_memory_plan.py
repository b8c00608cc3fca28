"""The memory planner: `packtrain train --plan` (table, JSON, exit 2 naming the fix), the start-up
refusal before any model is built, the planner's arithmetic moving the right way with each
option, context parallelism (per-rank figures, the suggested degree, the world and heads it must
divide), and its figure against a measured CPU training step (tests/bench/bench_memory_plan.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import MODELS
from support.qwen_sizes import released_overrides

from packtrain.core.errors import EXIT_CONFIG, ConfigError
from packtrain.core.memory_plan import GIB, PlanInputs, parse_bytes, plan_memory, refusal
from packtrain.core.model_size import LoraShape, model_dims, planning_config, read_config
from packtrain.core.pack.schema import FORMAT_VERSION
from packtrain.trainer import cli, memory_check

# Measures the memory of processes it starts: they run with glibc's default malloc settings.
pytestmark = pytest.mark.measures_memory

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_memory_plan.py"
SEVEN_B = released_overrides("7B")
SEVENTY_TWO_B = released_overrides("72B")


def _job(
    tmp_path: Path,
    training: dict[str, Any] | None = None,
    overrides: dict[str, Any] = SEVEN_B,
    **resources: Any,
) -> Path:
    doc = {
        "kind": "SFTJob",
        "spec": {
            "data": {"path": str(tmp_path / "pack")},
            "model": {"path": str(MODELS / "qwen2.5-vl"), "configOverrides": overrides},
            "training": training or {},
            "resources": {"nodes": 1, "gpusPerNode": 8, **resources},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_plan_refuses_a_7b_ddp_job_on_80gib_and_names_the_fix(tmp_path, capsys):
    job = _job(tmp_path, gpuMemory="80Gi")
    assert cli.main(["--plan", "--json", "-c", str(job), "--max-length", "8192"]) == EXIT_CONFIG
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["parameters"] == 8_292_166_656  # Qwen2.5-VL-7B as released
    assert not out["fits"] and out["inputs"]["world_size"] == 8
    assert "training.strategy: fsdp" in out["refusal"] and "activationCheckpointing" in out["refusal"]
    per_gpu = out["checkpointing_per_gpu_bytes"]
    assert per_gpu["decoder + vision"] < per_gpu["decoder"] < per_gpu["none"]


def test_plan_fits_with_fsdp_and_checkpointing_and_prints_a_table(tmp_path, capsys):
    ckpt = {"strategy": "fsdp", "activationCheckpointing": True, "visionCheckpointing": True}
    job = _job(tmp_path, ckpt)
    assert cli.main(["--plan", "-c", str(job), "--max-length", "8192", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "AdamW m, v (fp32)" in out and "per host" in out and "fits:" in out


EMPTY_PACK = {"format_version": FORMAT_VERSION, "shards": []}  # the least a manifest holds


def test_plan_reads_the_packs_max_length_and_asks_for_one_without(tmp_path, capsys):
    job = _job(tmp_path)
    assert cli.main(["--plan", "--json", "-c", str(job)]) == EXIT_CONFIG
    assert "--max-length" in capsys.readouterr().err
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({**EMPTY_PACK, "max_length": 2048}))
    assert cli.main(["--plan", "--json", "-c", str(job)]) == 0  # no gpuMemory: nothing to refuse
    assert json.loads(capsys.readouterr().out)["inputs"]["max_length"] == 2048


def test_the_trainer_refuses_at_start_up_before_building_the_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "pack").mkdir()
    (tmp_path / "pack" / "manifest.json").write_text(json.dumps({**EMPTY_PACK, "max_length": 8192}))
    monkeypatch.setattr(memory_check, "device_memory", lambda: 80 * GIB)
    monkeypatch.setattr("packtrain.trainer.loop.train", lambda *a, **k: pytest.fail("the model was built"))
    assert cli.main(["-c", str(_job(tmp_path))]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "per GPU" in err and "training.planCheck: false" in err
    skip = _job(tmp_path, {"planCheck": False})
    assert memory_check.startup_refusal(cli.load_train_config(skip), 8, 8) is None


def test_options_move_the_plan_the_right_way():
    d = model_dims(read_config(MODELS / "qwen2.5-vl", SEVEN_B))
    base = PlanInputs(world_size=8, gpus_per_host=8, strategy="fsdp", max_length=8192)
    total = plan_memory(d, base).total
    assert plan_memory(d, replace(base, world_size=16)).total < total
    assert plan_memory(d, replace(base, activation_checkpointing=True)).total < total
    assert plan_memory(d, replace(base, freeze=("vision",))).total < total
    assert plan_memory(d, replace(base, max_length=4096)).total < total
    assert plan_memory(d, replace(base, strategy="ddp")).total > total
    lora = plan_memory(d, replace(base, strategy="ddp", lora=LoraShape(16, ("q_proj",), False)))
    assert lora.counts.trainable < 10**7 and lora.total < plan_memory(d, replace(base, strategy="ddp")).total
    fits = plan_memory(d, replace(base, gpu_memory=141 * GIB, activation_checkpointing=True))
    assert fits.fits and refusal(d, fits) is None


def test_planning_config_keeps_exactly_what_the_sizes_need():
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3.5"):
        raw = read_config(MODELS / family)
        small = planning_config(raw)
        assert model_dims(small) == model_dims(raw)
        assert len(json.dumps(small)) < 2500  # it travels in a 4 KiB termination message


def test_gpu_memory_quantities():
    assert parse_bytes("141Gi") == 141 * GIB == parse_bytes("141GiB")
    assert parse_bytes("80G") == 80 * 10**9
    with pytest.raises(ConfigError, match="80Gi"):
        parse_bytes("lots")


ACTIVATIONS = ("activations: decoder", "activations: vision")


@pytest.mark.parametrize("family,overrides", [("qwen2.5-vl", SEVEN_B), ("qwen3.5", {})])
def test_context_parallel_splits_a_ranks_activations_and_nothing_else(family, overrides):
    """CP 1 / 2 / 4 on the same 8 GPUs: each rank's decoder and vision activations are 1/C of CP 1's
    (the hybrid's Gated DeltaNet layers too: they exchange heads, not tokens), weights, gradients,
    AdamW state and the loss chunk stay, and the all-to-all buffers are a small row of their own."""
    d = model_dims(read_config(MODELS / family, overrides))
    base = PlanInputs(world_size=8, gpus_per_host=8, strategy="fsdp", max_length=32768)
    for ckpt in (False, True):
        x = replace(base, activation_checkpointing=ckpt, vision_checkpointing=ckpt)
        one = plan_memory(d, x)
        assert "context-parallel all-to-all buffers" not in one.rows
        for n in (2, 4):
            split = plan_memory(d, replace(x, context_parallel=n))
            for row in ACTIVATIONS:
                assert split.rows[row] == pytest.approx(one.rows[row] / n, rel=0.01), (row, n)
            for row, value in one.rows.items():
                if row not in ACTIVATIONS and not row.startswith("reserve"):
                    assert split.rows[row] == value, (row, n)
            assert 0 < split.rows["context-parallel all-to-all buffers"] < 0.02 * split.total
            assert split.total < one.total


def test_kv_heads_fewer_than_the_ranks_are_repeated_in_the_plan():
    """Qwen3.5's full-attention layers have 4 K/V heads: split 8 ways each is repeated to one a rank,
    so the attention kernel's k and v there hold twice the bytes a token that an even split would."""
    d = model_dims(read_config(MODELS / "qwen3.5"))
    assert d.kv_heads < 8 and d.heads % 8 == 0
    x = PlanInputs(world_size=8, strategy="fsdp", max_length=32768)
    even = plan_memory(d, replace(x, context_parallel=4)).rows["activations: decoder"]
    repeated = plan_memory(d, replace(x, context_parallel=8)).rows["activations: decoder"]
    assert even / 2 < repeated < even / 2 * 1.05


def _seventy_two_b(tmp_path: Path, training: dict[str, Any], nodes: int) -> Path:
    ckpt = {"strategy": "fsdp", "activationCheckpointing": True, "visionCheckpointing": True}
    return _job(tmp_path, {**ckpt, **training}, SEVENTY_TWO_B, nodes=nodes, gpuMemory="141Gi")


def test_72b_at_32k_on_8_h200_is_refused_and_told_the_context_parallel_that_fits(tmp_path, capsys):
    """Qwen2.5-VL-72B at maxLength 32768 on one node of 8 x H200, fsdp and checkpointing on: its fp32
    weights, gradients and AdamW state alone fill 8 GPUs, so no degree fits one node; the refusal names
    2 nodes with training.contextParallel (about a third of CP 1's activations), before the 25 nodes
    CP 1 would take. With that change the plan fits."""
    before = _seventy_two_b(tmp_path, {}, nodes=1)
    assert cli.main(["--plan", "--json", "-c", str(before), "--max-length", "32768"]) == EXIT_CONFIG
    out = json.loads(capsys.readouterr().out)
    assert out["context_parallel"] == 1 and out["tokens_per_gpu"] == 32768 and not out["fits"]
    states = sum(v for k, v in out["per_gpu_bytes"].items() if "fp32" in k)
    assert states > 0.95 * 141 * GIB  # no split of the rows makes room on 8 GPUs
    refused = out["refusal"]
    assert "resources.nodes: 2 with fsdp, training.contextParallel: 4 (16 GPUs" in refused
    assert refused.index("training.contextParallel") < refused.index("resources.nodes: 25 with fsdp")
    after = _seventy_two_b(tmp_path, {"contextParallel": 4}, nodes=2)
    assert cli.main(["--plan", "--json", "-c", str(after), "--max-length", "32768"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert fits["fits"] and fits["inputs"]["context_parallel"] == fits["context_parallel"] == 4
    assert fits["tokens_per_gpu"] == 8192 and fits["data_parallel"] == 4
    assert fits["per_gpu_bytes"]["activations: decoder"] < out["per_gpu_bytes"]["activations: decoder"] / 3
    assert cli.main(["--plan", "-c", str(after), "--max-length", "32768"]) == 0
    table = " ".join(capsys.readouterr().out.split())  # the title wraps at the terminal's width
    assert "contextParallel 4 (4 data-parallel x 4): 8192 tokens a GPU" in table


@pytest.mark.parametrize(
    "training,argv,named",
    [
        ({"contextParallel": 4}, ["--world-size", "6"], "does not divide the world size 6 (--world-size)"),
        ({"contextParallel": 8}, [], "does not divide the model's 28 attention heads"),
        ({"contextParallel": 2, "mode": "padded"}, [], "training.mode is padded"),
    ],
)
def test_plan_refuses_a_context_parallel_the_job_cannot_split(tmp_path, capsys, training, argv, named):
    """Qwen2.5-VL-7B (28 heads) on 8 GPUs: exit 2 naming what does not divide and what to set."""
    job = _job(tmp_path, training)
    assert cli.main(["--plan", "-c", str(job), "--max-length", "8192", *argv]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert named in err and "training.contextParallel" in err, err
    if "padded" not in named:
        assert "set training.contextParallel to one of 1, 2" in err, err


MEASURED_BAND = (0.6, 1.5)


@pytest.mark.timeout(900)
def test_the_plan_is_within_its_band_of_a_measured_cpu_step(tmp_path):
    """measured / planned (gradients + activations + logits) of one CPU step, tiny widths."""
    cmd = [sys.executable, str(BENCH), "--quick", "--results-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=880)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_memory_plan.quick.json").read_text())["rows"]
    assert rows and all(MEASURED_BAND[0] <= r["ratio"] <= MEASURED_BAND[1] for r in rows), rows
