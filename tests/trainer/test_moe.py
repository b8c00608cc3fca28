"""Mixture-of-experts decoders (Qwen3.5-MoE, Qwen3-VL-MoE): packed == padded, router aux loss included.

No real MoE config is in ../shared: each model takes transformers' config class defaults (expert
layout, top-k, aux coefficient, token ids) with the tiny sizes of its dense family and 8 experts,
top-2. The same samples packed in one row and padded one per row (right padding, a 2-D mask) give
the same per-sample losses, the same router auxiliary loss (over real tokens only: padding is
masked out of it) and the same gradients, the router's included. fp64 on CPU.
"""

from __future__ import annotations

import pytest
import torch
import transformers
import vlm_fixtures as fx
from test_equivalence import _double_batch

from packtrain.trainer.data.packed import collate_packed, collate_padded, split_row
from packtrain.trainer.model.build import Router, VLMForTraining
from packtrain.trainer.model.linear_attention import isolate_linear_attention
from packtrain.trainer.model.loss import per_sample_sums

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
CASES = {
    # (MoE config and model classes, the dense family whose tokenizer, pixels and tiny sizes it shares)
    "qwen3.5-moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3.5"),
    "qwen3-vl-moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "qwen3-vl"),
}


def _moe_model(case: str) -> tuple[transformers.PreTrainedModel, str]:
    config_class, model_class, family = CASES[case]
    tiny = fx.TINY[family]
    text = {k: v for k, v in tiny["text_config"].items() if k not in ("rope_scaling", "rope_parameters")}
    text.update(MOE)
    if case == "qwen3.5-moe":
        text["shared_expert_intermediate_size"] = 32
    config = getattr(transformers, config_class)(text_config=text, vision_config=tiny["vision_config"])
    config.text_config.rope_parameters.update(
        tiny["text_config"].get("rope_parameters") or tiny["text_config"]["rope_scaling"]
    )
    torch.manual_seed(4)
    # eager experts: the grouped-GEMM kernel has no fp64
    model = getattr(transformers, model_class)._from_config(
        config, attn_implementation="sdpa", experts_implementation="eager", dtype=torch.float64
    )
    isolate_linear_attention(model, "torch")
    return model, family


def _run(core: VLMForTraining, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-sample mean losses, the aux loss, and the gradients of (token-mean loss + aux loss)."""
    out = core(batch.inputs)
    n = len(batch.info.seq_lens)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    counts = per_sample_sums(
        torch.ones_like(out["token_losses"]), out["positions"], batch.info.sample_index, n
    )
    (out["loss_sum"] / batch.info.num_label_tokens + out["aux_loss"]).backward()
    grads = {k: p.grad.clone() for k, p in core.hf.named_parameters() if p.grad is not None}
    core.hf.zero_grad(set_to_none=True)
    return (sums / counts).detach(), out["aux_loss"].detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_padded_with_the_router_aux_loss_over_real_tokens(case, shared_dir):
    torch.set_num_threads(2)
    model, family = _moe_model(case)
    core = VLMForTraining(model, "sdpa")
    assert core.router is not None and core.router.num_experts == 8 and core.router.coef > 0
    samples = fx.demo_samples(family)[:2]  # text, then a single image: rows of different lengths
    row = fx.packed_row(samples, family)
    packed = _double_batch(collate_packed([row], fx.spec(family)))
    padded = _double_batch(collate_padded(split_row(row), fx.spec(family)))
    assert padded.info.padded_tokens > padded.info.num_tokens  # the shorter row is padded

    losses, aux, grads = _run(core, packed)
    ref_losses, ref_aux, ref_grads = _run(core, padded)
    loss_rel = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
    aux_rel = abs(aux - ref_aux).item() / ref_aux.item()
    grad_rel = max(_rel(grads[k], ref_grads[k]) for k in ref_grads)
    router = max(_rel(grads[k], ref_grads[k]) for k in ref_grads if k.endswith("mlp.gate.weight"))
    print(
        f"{case}: packed vs padded max rel diff loss {loss_rel:.2e}, aux loss {aux_rel:.2e} "
        f"(aux {aux.item():.6f}), grads {grad_rel:.2e}, router grads {router:.2e}"
    )
    assert set(grads) == set(ref_grads)
    assert all(ref_grads[k].norm() > 0 for k in ref_grads if k.endswith("mlp.gate.weight"))
    assert max(loss_rel, aux_rel, grad_rel) <= 1e-6

    # Over the padding too, the aux loss would differ: the mask is what keeps it to real tokens.
    with torch.no_grad():
        out = model.model(
            input_ids=padded.inputs.input_ids,
            attention_mask=padded.inputs.attention_mask,
            position_ids=padded.inputs.position_ids,
            pixel_values=padded.inputs.pixel_values,
            image_grid_thw=padded.inputs.image_grid_thw,
            output_router_logits=True,
            use_cache=False,
        )
    with_padding = core.router.aux_loss(out.router_logits, None)
    assert abs(with_padding - ref_aux).item() / ref_aux.item() > 1e-6


def test_dense_models_have_no_router(shared_dir):
    from packtrain.trainer.model.build import build_model

    model = build_model(fx.FOLDER["qwen3.5"], init="random", overrides=fx.TINY["qwen3.5"])
    assert Router.of(model) is None


def test_the_flops_model_counts_the_experts_a_token_runs(shared_dir):
    from packtrain.trainer.metrics import ModelShape
    from packtrain.trainer.model.build import parameter_groups

    model, _ = _moe_model("qwen3.5-moe")
    counts = parameter_groups(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert experts > 0
    shape = ModelShape.from_model(model, counts)
    assert shape.llm_params == counts["llm"] - experts * 6 // 8  # top-2 of 8 experts per token
    assert (shape.full_attention_layers, shape.linear_attention_layers) == (1, 3)


def test_the_step_objective_weighs_each_micro_batch_aux_loss_by_its_label_tokens():
    from packtrain.trainer.model.loss import aux_objective

    aux = [torch.tensor(2.0), torch.tensor(4.0)]
    tokens = [30, 10]
    # Two ranks holding these same micro-batches: DDP averages the ranks' gradients, so the step's
    # term is the mean of the ranks' objectives (here: one rank's), and it must be the label-token
    # weighted mean over all four micro-batches.
    rank = sum(
        aux_objective(a, 0.01, n, 2 * sum(tokens), world_size=2) for a, n in zip(aux, tokens, strict=True)
    )
    assert rank.item() == pytest.approx(0.01 * 2 * (2.0 * 30 + 4.0 * 10) / (2 * 40))
