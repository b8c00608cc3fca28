"""training.activationCheckpointing / visionCheckpointing / compile: configuration, that they act
where they should, and that packed training still equals each sample alone with them on."""

from __future__ import annotations

import pytest
import torch
import vlm_fixtures as fx
from test_equivalence import _double_batch, _grads, _reference, _rel

from packtrain.core.sft_config import SFTSpecCore
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model.build import VLMForTraining, apply_layer_options, build_model
from packtrain.trainer.model.loss import per_sample_sums

SPEC = {"data": {"path": "/packs/x"}, "model": {"path": "/models/x"}}


def test_options_default_off_and_the_old_model_switch_turns_checkpointing_on():
    t = SFTSpecCore.model_validate(SPEC).training
    assert (t.activation_checkpointing, t.vision_checkpointing, t.compile) == (False, False, False)
    t = SFTSpecCore.model_validate(
        {**SPEC, "training": {"activationCheckpointing": True, "compile": True}}
    ).training
    assert (t.activation_checkpointing, t.vision_checkpointing, t.compile) == (True, False, True)
    # model.gradientCheckpointing checkpointed every layer, vision blocks included: it still does
    old = SFTSpecCore.model_validate({**SPEC, "model": {"path": "/m", "gradientCheckpointing": True}})
    assert old.training.activation_checkpointing and old.training.vision_checkpointing


def _calls(modules) -> list[int]:
    """Counts runs of each module's MLP forward (module hooks do not fire in a checkpoint's
    recomputation, so the count wraps the method itself)."""
    counts = [0] * len(modules)

    def counting(forward, i):
        def run(*args, **kwargs):
            counts[i] += 1
            return forward(*args, **kwargs)

        return run

    for i, module in enumerate(modules):
        module.mlp.forward = counting(module.mlp.forward, i)
    return counts


@pytest.mark.parametrize(("text", "vision"), [(True, False), (False, True), (False, False)])
def test_checkpointing_recomputes_exactly_the_chosen_layers(text, vision, shared_dir):
    family = "qwen2-vl"
    samples = fx.demo_samples(family)
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], seed=1)
    names = [n for n, _ in model.named_parameters()]
    apply_layer_options(model, text, vision, False)
    assert [n for n, _ in model.named_parameters()] == names  # checkpoints and exports unchanged
    layers = _calls(list(model.model.language_model.layers))
    blocks = _calls(list(model.model.visual.blocks))
    core = VLMForTraining(model, "sdpa").train()  # checkpointing acts in training only
    core(collate_packed([fx.packed_row(samples[:2], family)], fx.spec(family)).inputs)["loss_sum"].backward()
    assert layers == [2 if text else 1] * len(layers)  # forward, and again in backward
    assert blocks == [2 if vision else 1] * len(blocks)
    with torch.no_grad():  # nothing to recompute for
        core(collate_packed([fx.packed_row(samples[:1], family)], fx.spec(family)).inputs)
    assert layers == [3 if text else 2] * len(layers)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_packed_equals_each_sample_alone_with_checkpointing(family, shared_dir):
    """The equivalence of test_equivalence (fp64, losses and LLM / vision gradients), with every
    decoder layer and vision block checkpointed."""
    samples = fx.demo_samples(family)
    model = build_model(
        fx.FOLDER[family], init="random", overrides=fx.TINY[family], dtype=torch.float64, seed=1
    )
    apply_layer_options(model, True, True, False)
    batch = _double_batch(
        collate_packed(
            [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)], fx.spec(family)
        )
    )
    total = batch.info.num_label_tokens
    out = VLMForTraining(model, "sdpa").train()(batch.inputs)
    (out["loss_sum"] / total).backward()
    packed_grads = _grads(model)
    n = len(samples)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    counts = per_sample_sums(
        torch.ones_like(out["token_losses"]), out["positions"], batch.info.sample_index, n
    )
    ref_losses = _reference(model, samples, total)
    ref_grads = _grads(model)
    assert ((sums / counts).detach() - ref_losses).abs().max() / ref_losses.abs().min() <= 1e-10
    assert set(packed_grads) == set(ref_grads)
    assert max(_rel(packed_grads[k], ref_grads[k]) for k in ref_grads) <= 1e-10


@pytest.mark.slow
def test_packed_equals_each_sample_alone_with_compiled_layers(shared_dir):
    """torch.compile of the decoder layers (CPU inductor; ~2 minutes of compilation on 2 cores):
    still packed == each sample alone, fp32 (compiled kernels reorder float sums)."""
    from torch._dynamo.utils import counters

    family = "qwen2-vl"
    samples = fx.demo_samples(family)
    model = build_model(fx.FOLDER[family], init="random", overrides=fx.TINY[family], seed=1)
    apply_layer_options(model, False, False, True)
    counters.clear()
    batch = collate_packed(
        [fx.packed_row(samples[:2], family), fx.packed_row(samples[2:], family)], fx.spec(family)
    )
    total = batch.info.num_label_tokens
    out = VLMForTraining(model, "sdpa").train()(batch.inputs)
    (out["loss_sum"] / total).backward()
    assert counters["stats"]["unique_graphs"] > 0  # the layers really went through the compiler
    packed_grads = _grads(model)
    n = len(samples)
    sums = per_sample_sums(out["token_losses"], out["positions"], batch.info.sample_index, n)
    counts = per_sample_sums(
        torch.ones_like(out["token_losses"]), out["positions"], batch.info.sample_index, n
    )
    ref_losses = _reference(model, samples, total)
    ref_grads = _grads(model)
    assert ((sums / counts).detach() - ref_losses).abs().max() / ref_losses.abs().min() <= 1e-5
    assert max(_rel(packed_grads[k], ref_grads[k]) for k in ref_grads) <= 1e-4
