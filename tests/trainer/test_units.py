"""Config loading, distributed environment, attention masks, FLOPs: the small pure parts."""

from __future__ import annotations

import pytest
import torch
import vlm_fixtures as fx
from conftest import job_spec, write_job
from pydantic import ValidationError

from packtrain.trainer.attention import block_causal_mask, resolve_attention
from packtrain.trainer.config import SFTSpecCore, load_train_config
from packtrain.trainer.data import collate_packed
from packtrain.trainer.distributed import resolve_env
from packtrain.trainer.metrics import GpuProbe, ModelShape, TrainMetrics, step_flops
from packtrain.trainer.model import VLMForTraining, build_model, parameter_groups


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
    batch = collate_packed([fx.packed_row(samples[:2], "qwen2.5-vl")], "qwen2.5-vl")
    losses = {}
    for backend in ("flex", "sdpa"):
        model = build_model(
            fx.FOLDER["qwen2.5-vl"], init="random", overrides=fx.TINY["qwen2.5-vl"], attention=backend, seed=2
        )
        with torch.no_grad():
            losses[backend] = VLMForTraining(model, backend)(batch)["token_losses"]
    torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)


def test_flops_count_attention_from_real_sample_lengths(shared_dir):
    model = build_model(fx.FOLDER["qwen2-vl"], init="random", overrides=fx.TINY["qwen2-vl"])
    shape = ModelShape.from_model(model, parameter_groups(model))
    samples = fx.demo_samples("qwen2-vl")
    packed = collate_packed([fx.packed_row(samples, "qwen2-vl")], "qwen2-vl")
    one = collate_packed([fx.packed_row(samples[:1], "qwen2-vl")], "qwen2-vl")
    n = one["num_tokens"]
    expected = 6 * shape.llm_params * n + 6 * shape.lm_head_params * one["num_label_tokens"]
    expected += 12 * shape.layers * shape.attn_dim * n * n / 2
    assert step_flops(shape, one) == pytest.approx(expected)
    # Packed, the FLOPs are exactly the sum of each sample's alone: the attention term comes from
    # the sub-sample lengths, not from the packed row's length.
    parts = [collate_packed([fx.packed_row([s], "qwen2-vl")], "qwen2-vl") for s in samples]
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
