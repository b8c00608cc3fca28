"""Config loading, distributed environment, attention masks, FLOPs: the small pure parts."""

from __future__ import annotations

import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, write_job
from pydantic import ValidationError

from packtrain.core.sft_config import SFTSpecCore, load_train_config
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.distributed import resolve_env
from packtrain.trainer.metrics import GpuProbe, ModelShape, TrainMetrics, step_flops
from packtrain.trainer.model.attention import block_causal_mask, resolve_attention
from packtrain.trainer.model.build import VLMForTraining, build_model, parameter_groups


def test_sftjob_manifest_and_bare_spec_load_the_same(tmp_path):
    manifest = job_spec(tmp_path / "pack", tmp_path / "out", microBatchSequences=2, attention="sdpa")
    from_manifest = load_train_config(write_job(tmp_path / "m.yaml", manifest))
    from_spec = load_train_config(write_job(tmp_path / "s.yaml", manifest["spec"]))
    assert from_manifest == from_spec
    assert from_manifest.training.micro_batch_sequences == 2
    assert from_manifest.model.config_overrides["num_hidden_layers"] == 2
    assert from_manifest.dump()["training"]["microBatchSequences"] == 2


def test_config_errors_are_reported():
    with pytest.raises(ValidationError, match="packJobRef"):
        SFTSpecCore.model_validate({"data": {}, "model": {"path": "m"}})
    with pytest.raises(ValidationError, match="microBatchSequence"):
        SFTSpecCore.model_validate(
            {"data": {"path": "p"}, "model": {"path": "m"}, "training": {"microBatchSequence": 2}}
        )
    with pytest.raises(ValidationError):
        SFTSpecCore.model_validate(
            {"data": {"path": "p"}, "model": {"path": "m"}, "training": {"attention": "magic"}}
        )


def test_env_from_torchrun_and_from_a_pytorchjob():
    torchrun = resolve_env(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29501"}
    )
    assert (torchrun.rank, torchrun.world_size, torchrun.local_rank, torchrun.master_port) == (3, 4, 1, 29501)
    # A PyTorchJob pod running one process: RANK/WORLD_SIZE per pod, PET_* for torchrun.
    pod = resolve_env(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "job-master-0",
            "MASTER_PORT": "23456",
            "PET_NPROC_PER_NODE": "1",
            "PET_NNODES": "2",
            "PET_NODE_RANK": "1",
        }
    )
    assert (pod.rank, pod.world_size, pod.local_rank, pod.master_addr) == (1, 2, 0, "job-master-0")
    assert resolve_env({"PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1234"}).master_port == 1234
    assert not resolve_env({}).distributed
    with pytest.raises(RuntimeError, match="torchrun"):
        resolve_env({"PET_NPROC_PER_NODE": "8", "WORLD_SIZE": "2", "RANK": "0"})
    with pytest.raises(RuntimeError, match="outside"):
        resolve_env({"RANK": "2", "WORLD_SIZE": "2"})


def test_block_causal_mask_and_backend_choice():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), 5)[0, 0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    cpu = torch.device("cpu")
    assert resolve_attention("auto", cpu) == "sdpa"
    with pytest.raises(RuntimeError, match="flash"):
        resolve_attention("flash", cpu)


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_backend_matches_sdpa_forward(shared_dir):
    """flex (a GPU backend; CPU has no flex backward) gives the same packed losses as SDPA."""
    samples = fx.demo_samples("qwen2.5-vl")
    batch = collate_packed([fx.packed_row(samples[:2], "qwen2.5-vl")], fx.spec("qwen2.5-vl"))
    losses = {}
    for backend in ("flex", "sdpa"):
        model = build_model(
            fx.FOLDER["qwen2.5-vl"], init="random", overrides=fx.TINY["qwen2.5-vl"], attention=backend, seed=2
        )
        with torch.no_grad():
            losses[backend] = VLMForTraining(model, backend)(batch.inputs)["token_losses"]
    torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)


def test_flops_count_attention_from_real_sample_lengths(shared_dir):
    model = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"])
    shape = ModelShape.from_model(model, parameter_groups(model))
    samples = fx.demo_samples("qwen2-vl")
    packed = collate_packed([fx.packed_row(samples, "qwen2-vl")], fx.spec("qwen2-vl"))
    one = collate_packed([fx.packed_row(samples[:1], "qwen2-vl")], fx.spec("qwen2-vl"))
    n = one.info.num_tokens
    expected = 6 * shape.llm_params * n + 6 * shape.lm_head_params * one.info.num_label_tokens
    expected += 12 * shape.layers * shape.attn_dim * n * n / 2
    assert step_flops(shape, one) == pytest.approx(expected)
    # Packed, the FLOPs are exactly the sum of each sample's alone: the attention term comes from
    # the sub-sample lengths, not from the packed row's length.
    parts = [collate_packed([fx.packed_row([s], "qwen2-vl")], fx.spec("qwen2-vl")) for s in samples]
    assert step_flops(shape, packed) == pytest.approx(sum(step_flops(shape, p) for p in parts))


def test_no_gpu_means_no_gpu_metrics():
    assert GpuProbe.open(torch.device("cpu")) is None
    metrics = TrainMetrics(rank=0, device=torch.device("cpu"))
    metrics.enable_mfu(None)
    recorded = metrics.update({"loss": 1.0, "flops_per_second": 1e9})
    assert "mfu" not in recorded and not any(k.startswith("gpu_") for k in recorded)
    names = {m.name for m in metrics.registry.collect()}
    assert not any(n.startswith("packtrain_gpu") for n in names)
    metrics.enable_mfu(1.0)  # 1 TFLOP/s peak given explicitly
    assert metrics.update({"flops_per_second": 5e11})["mfu"] == pytest.approx(0.5)


def test_epoch_plan_and_resume_position_are_pure_functions_of_the_layout():
    """The epoch plan (cost balancing, order, resume position) lives in one module and needs no pack."""
    from packtrain.trainer.data.sampler import (
        Layout,
        Position,
        after,
        plan_epoch,
        position_state,
        rank_micro_batches,
        resume_position,
        units_and_costs,
    )

    seq_lens = [[300], [100, 100, 100], [50] * 6, [200, 100], [150, 150], [299, 1], [10] * 30, [250, 50]]
    units, costs = units_and_costs(seq_lens, "packed")
    assert units[1] == (1, -1) and costs[1] == 3 * 100**2
    padded_units, padded_costs = units_and_costs(seq_lens, "padded")
    assert (
        len(padded_units) == sum(map(len, seq_lens))
        and padded_units[1] == (1, 0)
        and padded_costs[1] == 100**2
    )
    layout = Layout(seed=3, world_size=2, units_per_micro_batch=1, grad_accum=2, mode="packed", num_units=8)
    assert (layout.units_per_rank, layout.steps_per_epoch, layout.micro_batches_per_epoch) == (2, 2, 4)
    plan = plan_epoch(costs, layout.world_size, layout.units_per_rank, layout.seed, epoch=0)
    mine = [rank_micro_batches(plan, rank, layout) for rank in range(2)]
    assert all(len(m) == 4 and all(len(b) == 1 for b in m) for m in mine)
    assert sorted(u for m in mine for b in m for u in b) == list(range(8))  # each unit once per epoch
    assert after(layout, 0, 2) == Position(0, 3) and after(layout, 0, 3) == Position(1, 0)
    state = position_state(layout, Position(1, 2))
    assert list(state) == [
        "epoch",
        "next",
        "seed",
        "world_size",
        "units_per_micro_batch",
        "grad_accum",
        "mode",
        "num_units",
    ]  # the keys checkpoints have always held
    assert resume_position(layout, state) == Position(1, 2)
    with pytest.raises(ValueError, match="checkpoint has world_size=4, this run 2"):
        resume_position(layout, {**state, "world_size": 4})


def test_pods_start_the_trainers_own_entry_and_the_hint_names_it(monkeypatch, capsys):
    """torchrun in the pods runs `-m packtrain.trainer` (= `packtrain train`), and the error a pod
    gets for PET_NPROC_PER_NODE without torchrun names that same module."""
    import runpy
    import sys

    from packtrain.operator.commands import train_command

    cmd = train_command("c", "d", "o", nproc_per_node=2)
    module = cmd[cmd.index("-m") + 1]
    assert module == "packtrain.trainer" and cmd[cmd.index("-m") + 2] == "-c"
    assert cmd[-2:] == ["--log-format", "json"]
    with pytest.raises(RuntimeError) as err:
        resolve_env({"PET_NPROC_PER_NODE": "2"})
    assert f"torchrun -m {module} " in str(err.value)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as done:  # the module runs the trainer's CLI
        runpy.run_module(module, run_name="__main__")
    assert done.value.code == 0
    assert "--log-format" in capsys.readouterr().out
