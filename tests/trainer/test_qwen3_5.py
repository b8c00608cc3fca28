"""Qwen3.5's hybrid decoder: the linear-attention layers' isolation, and what reads the registry.

Each sample's own loss and gradient equal the sample alone in `test_equivalence_per_sample` (its
linear-attention parameters apart: conv1d, A_log, dt_bias, in_proj_*). Here: naive packing
(positions restarted and the block mask, nothing else) does leak through the conv window and the
recurrent state, so those tests can tell; the varlen path the fla kernels take on CUDA gives the
per-sample path's loss and gradients when its kernels are references of the same signatures; and
the parts, freezing, LoRA targets and the FLOPs model know the family from its registry entry.
fp64 on CPU (its RMSNorms and chunked delta rule compute in fp32 inside, as transformers writes them).
"""

from __future__ import annotations

import pytest
import torch
import vlm_fixtures as fx
from test_equivalence import _double_batch

from packtrain.core.sft_config import LoraSpec
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.metrics import ModelShape, step_flops
from packtrain.trainer.model import lora, param_groups
from packtrain.trainer.model.build import VLMForTraining, build_model, parameter_groups
from packtrain.trainer.model.linear_attention import (
    isolate_linear_attention,
    linear_layers,
    linear_path,
    reference_kernels,
    resolve_linear,
)
from packtrain.trainer.model.loss import per_sample_sums

FAMILY = "qwen3.5"
LINEAR_PARAMS = ("conv1d", "A_log", "dt_bias", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")


def _model(seed: int = 3):
    return build_model(
        fx.FOLDER[FAMILY], init="random", overrides=fx.TINY[FAMILY], dtype=torch.float64, seed=seed
    )


@pytest.fixture(scope="module")
def batch(shared_dir) -> Batch:
    samples = fx.demo_samples(FAMILY)
    rows = [fx.packed_row(samples[:2], FAMILY), fx.packed_row(samples[2:], FAMILY)]
    return _double_batch(collate_packed(rows, fx.spec(FAMILY)))


def _per_sample(core: VLMForTraining, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample's mean loss, and the gradients of the batch's token-mean loss."""
    out = core(batch.inputs)
    n = len(batch.info.seq_lens)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    ones = torch.ones_like(out["token_losses"])
    counts = per_sample_sums(ones, out["positions"], batch.info.sample_index, n)
    (out["loss_sum"] / batch.info.num_label_tokens).backward()
    grads = {k: p.grad.clone() for k, p in core.hf.named_parameters() if p.grad is not None}
    core.hf.zero_grad(set_to_none=True)
    return (sums / counts).detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _linear_rel(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        part: max(_rel(grads[k], ref[k]) for k in ref if f"linear_attn.{part}" in k) for part in LINEAR_PARAMS
    }


def test_naive_packing_leaks_through_the_linear_attention_state(batch):
    """Positions restarted per sample and the block-diagonal mask on the full-attention layers, but
    the linear-attention layers run over the whole row: each sample reads its predecessors' conv
    window and recurrent state. The isolated forward's losses are each sample's alone
    (test_equivalence_per_sample); the naive ones move far beyond fp32 noise (~1e-7). The collator
    joins the batch's packed rows into one row, so every sample after the first has a predecessor."""
    torch.set_num_threads(2)
    model = _model()
    assert len(linear_layers(model)) == 3 and linear_path(model) == "torch"
    isolated = VLMForTraining(model, "sdpa")
    naive = VLMForTraining(model, "sdpa")
    naive.linear_attention = False  # what a plain packed forward through transformers does
    want, want_grads = _per_sample(isolated, batch)
    got, got_grads = _per_sample(naive, batch)
    rel = ((got - want).abs() / want.abs()).tolist()
    grads = _linear_rel(got_grads, want_grads)
    print(
        f"naive packing leak: loss rel diff of the samples after the first {[f'{r:.2e}' for r in rel[1:]]}, "
        f"linear-attention grads {', '.join(f'{k} {v:.2e}' for k, v in grads.items())}"
    )
    assert rel[0] < 1e-9, rel  # the micro-batch's one row starts with sample 0: nothing before it
    # A random-init model is near uniform, so the losses move little; the gradients move by percents.
    assert min(rel[1:]) > 1e-6
    assert min(grads.values()) > 1e-3


@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
def test_flex_gives_the_hybrid_decoder_the_block_mask_sdpa_gets(batch):
    """flex's BlockMask goes to the full-attention layers only (the linear-attention ones are isolated
    by their segments): the same per-token losses as sdpa's dense block-diagonal mask."""
    losses = {}
    for backend in ("sdpa", "flex"):
        model = build_model(
            fx.FOLDER[FAMILY], init="random", overrides=fx.TINY[FAMILY], dtype=torch.float64, seed=3,
            attention=backend,
        )  # fmt: skip
        with torch.no_grad():
            losses[backend] = VLMForTraining(model, backend)(batch.inputs)["token_losses"]
    assert _rel(losses["flex"], losses["sdpa"]) < 1e-9


@pytest.mark.slow
def test_the_varlen_path_equals_the_per_sample_path(batch):
    """The fla path (one varlen call per layer over the row) with reference kernels in fla's
    signatures (transformers' torch conv and chunked delta rule per boundary) gives the per-sample
    path's losses and gradients: the glue around the CUDA kernels is right; the kernels themselves
    need CUDA and are not run here."""
    torch.set_num_threads(2)
    model = _model()
    core = VLMForTraining(model, "sdpa")
    want, want_grads = _per_sample(core, batch)
    assert isolate_linear_attention(model, "fla", reference_kernels()) == "fla"
    assert linear_path(model) == "fla"
    got, got_grads = _per_sample(core, batch)
    loss = ((got - want).abs() / want.abs()).max().item()
    grads = max(_rel(got_grads[k], want_grads[k]) for k in want_grads)
    print(f"varlen vs per-sample path: loss {loss:.2e}, grads {grads:.2e}")
    assert set(got_grads) == set(want_grads)
    assert loss <= 1e-6 and grads <= 1e-6


def test_the_linear_path_is_fla_only_on_cuda_with_the_package():
    assert resolve_linear("cpu", available=True) == "torch"
    assert resolve_linear("cuda", available=False) == "torch"
    assert resolve_linear("cuda", available=True) == "fla"


def test_parts_freezing_and_lora_targets_come_from_the_registry_entry(shared_dir):
    model = build_model(fx.FOLDER[FAMILY], init="random", overrides=fx.TINY[FAMILY])
    owner = param_groups.part_of_parameters(model)  # raises on a parameter outside every part
    named = dict(model.named_parameters())
    linear = [n for n in named if ".linear_attn." in n]
    assert {n.rsplit(".", 1)[-1] for n in linear} >= {"A_log", "dt_bias"}
    assert all(owner[id(named[n])] == "llm" for n in linear)
    assert owner[id(named["model.visual.merger.linear_fc1.weight"])] == "merger"
    param_groups.freeze(model, ["vision", "merger"])
    assert all(p.requires_grad == ("visual" not in n) for n, p in model.named_parameters())

    lora.apply(model, LoraSpec(), fx.FOLDER[FAMILY])
    adapted = {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    names = {a.rsplit(".", 1)[-1] for a in adapted}
    # The default targets reach the linear-attention projections and the full-attention ones.
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "o_proj", "gate_proj"} <= names
    assert not any("visual" in a for a in adapted)  # vision: only with lora.vision


def test_linear_attention_flops_are_linear_in_length(shared_dir):
    """Only the full-attention layers pay Σ l²; the Gated DeltaNet layers' state mixing is linear in
    length, so two samples of l tokens cost what one of 2l costs in them."""
    model = build_model(fx.FOLDER[FAMILY], init="random", overrides=fx.TINY[FAMILY])
    shape = ModelShape.from_model(model, parameter_groups(model))
    assert (shape.full_attention_layers, shape.linear_attention_layers) == (1, 3)
    assert shape.linear_flops_per_token > 0

    def flops(seq_lens: list[int]) -> float:
        batch = collate_packed(
            [
                {
                    "input_ids": [1] * sum(seq_lens),
                    "labels": [-100] * sum(seq_lens),
                    "seq_lens": seq_lens,
                    "sample_ids": [str(k) for k in range(len(seq_lens))],
                    "sources": ["t"] * len(seq_lens),
                    "indices": list(range(len(seq_lens))),
                    "media": [],
                    "pixels": [],
                }
            ],
            fx.spec(FAMILY),
        )
        return step_flops(shape, batch)

    one, two = flops([64]), flops([32, 32])
    quadratic = 12.0 * shape.full_attention_layers * shape.attn_dim * (64 * 64 / 2 - 2 * 32 * 32 / 2)
    assert one - two == pytest.approx(quadratic)  # the linear layers add the same to both
