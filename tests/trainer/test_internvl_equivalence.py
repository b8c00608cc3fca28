"""InternVL (tiled): a packed row trains exactly like each sample alone.

One packed row of four real samples (text-only; one image of 6 tiles + thumbnail; a 4-frame video;
a multi-turn sample with two images) through packtrain's tile decoding, collator (1-D positions
restarting per sample, explicit boundaries) and one-call tile encoder, against plain
`transformers` (`InternVLForConditionalGeneration(**processor outputs)`) on each sample alone.
fp32 on CPU; a tiny random model (Qwen3-shaped decoder, one-layer InternViT at the real 448 tile).
"""

from __future__ import annotations

import dataclasses

import packed_vs_alone as side
import pytest
import torch
import vlm_fixtures as fx

from packtrain.core.model_spec import model_spec
from packtrain.core.sft_config import LoraSpec
from packtrain.trainer.data.batch import Batch
from packtrain.trainer.data.packed import collate_packed
from packtrain.trainer.model import lora, param_groups
from packtrain.trainer.model.build import VLMForTraining, build_model

TOL = 1e-5  # fp32; measured: losses ~1e-7, gradients ~1e-6 (printed)
NAMES = ["text", "tiled-image", "video", "multi-turn"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(fx.INTERNVL_FOLDER, init="random", overrides=fx.INTERNVL_TINY, seed=1)


@pytest.fixture(scope="module")
def batch() -> Batch:
    samples = fx.internvl_samples()
    assert [s.name for s in samples] == NAMES
    return collate_packed([fx.internvl_row(samples)], model_spec(fx.INTERNVL_FOLDER))


def _part_rel(packed: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], keys: list[str]) -> float:
    """Relative difference of a part's whole gradient (its parameters' gradients as one vector).

    Per parameter it would be rounding over rounding where the exact gradient is zero: the key bias
    of the ViT's attention shifts every score of a query alike, which the softmax cancels (its
    fp32 gradient is ~1e-14, noise)."""
    return side.rel(*(torch.cat([g[k].flatten() for k in keys]) for g in (packed, ref)))


def _packed(model, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return side.packed(model, batch)


def _reference(model, total: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each sample alone through the Hugging Face model with the processor's outputs."""
    return side.alone(model, fx.internvl_samples(), total)


def _parts(grads: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    return {
        "vision": [k for k in grads if "vision_tower" in k],
        "projector": [k for k in grads if "multi_modal_projector" in k],
        "llm": [k for k in grads if "vision_tower" not in k and "multi_modal_projector" not in k],
    }


def test_packed_equals_each_sample_alone(model, batch):
    torch.set_num_threads(2)
    assert batch.inputs.position_ids.shape == batch.inputs.input_ids.shape  # 1-D, restarting
    assert batch.inputs.position_ids[0, batch.info.seq_lens[0]].item() == 0
    packed, packed_grads = _packed(model, batch)
    ref, ref_grads = _reference(model, batch.info.num_label_tokens)
    loss_rel = ((packed - ref).abs() / ref.abs()).max().item()
    assert set(packed_grads) == set(ref_grads) == {n for n, _ in model.named_parameters()}
    worst = {part: _part_rel(packed_grads, ref_grads, keys) for part, keys in _parts(ref_grads).items()}
    shown = ", ".join(f"{part} {value:.2e}" for part, value in worst.items())
    print(f"internvl fp32: max rel diff per-sample loss sums {loss_rel:.2e}, grads {shown}")
    assert loss_rel <= TOL
    assert all(value <= TOL for value in worst.values()), worst
    # The vision side learned from the pixels (not a zero gradient that would match trivially).
    assert all(ref_grads[k].norm() > 0 for k in _parts(ref_grads)["projector"])
    assert ref_grads["model.vision_tower.embeddings.patch_embeddings.projection.weight"].norm() > 0


@pytest.mark.parametrize("broken", ["boundaries dropped", "tiles out of order"])
def test_broken_packing_fails(model, batch, broken):
    """The control: the same row with its sample boundaries dropped (one causal run over the row), or
    its tiles handed over in another order, no longer matches.

    Positions that do not restart are no control here: with the boundaries kept, RoPE scores depend
    only on distances within a sample, so the losses match to rounding (measured 1.1e-7); restarting
    them is for transformers' own boundary detection and the exported model's view of a sample."""
    torch.set_num_threads(2)
    total = batch.inputs.input_ids.shape[1]
    if broken == "tiles out of order":
        assert batch.inputs.pixel_values is not None
        inputs = dataclasses.replace(batch.inputs, pixel_values=batch.inputs.pixel_values.flip(0))
    else:
        inputs = dataclasses.replace(
            batch.inputs, cu_seq_lens=torch.tensor([0, total], dtype=torch.int32), max_length=total
        )
    packed, _ = _packed(model, Batch(inputs, batch.info))
    ref, _ = _reference(model, batch.info.num_label_tokens)
    loss_rel = ((packed - ref).abs() / ref.abs()).max().item()
    print(f"internvl fp32, {broken}: max rel diff per-sample loss sums {loss_rel:.2e}")
    assert loss_rel > 10 * TOL


def test_text_only_rank_gives_vision_zero_gradients(model, batch):
    """`always_run_vision` on a media-free micro-batch: one zero tile through tower and projector, so
    every vision and projector parameter has a gradient (zero) and FSDP/DDP reductions line up."""
    text = collate_packed([fx.internvl_row(fx.internvl_samples()[:1])], model_spec(fx.INTERNVL_FOLDER))
    assert text.inputs.pixel_values is None
    out = VLMForTraining(model, "sdpa", always_run_vision=True)(text.inputs)
    out["loss_sum"].backward()
    grads = side.grads(model)
    parts = _parts(grads)
    assert len(grads) == len(list(model.parameters()))
    assert all(grads[k].abs().max().item() == 0.0 for k in parts["vision"] + parts["projector"])
    assert any(grads[k].norm() > 0 for k in parts["llm"])


def test_every_parameter_has_a_part(model):
    """Freezing, LoRA targets and per-part learning rates see every InternVL parameter (the ViT's
    cls token and position embeddings in `vision`, the projector in `merger`)."""
    owner = param_groups.part_of_parameters(model)
    named = dict(model.named_parameters())
    assert owner[id(named["model.vision_tower.embeddings.cls_token"])] == "vision"
    assert owner[id(named["model.vision_tower.embeddings.position_embeddings"])] == "vision"
    assert owner[id(named["model.multi_modal_projector.linear_1.weight"])] == "merger"
    assert owner[id(named["model.language_model.layers.0.self_attn.q_proj.weight"])] == "llm"
    assert owner[id(named["model.language_model.embed_tokens.weight"])] == "embeddings"
    assert owner[id(model.lm_head.weight)] == "embeddings"


def test_packed_equals_each_sample_alone_with_lora_in_both_towers(batch):
    """LoRA by the entry's layout (`lora_llm`, `lora_vision`: InternViT's layers and the projector):
    adapters go into both towers, only they train, and their gradients from the packed row equal
    the sum over each sample alone."""
    torch.set_num_threads(2)
    model = build_model(fx.INTERNVL_FOLDER, init="random", overrides=fx.INTERNVL_TINY, seed=1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "linear_1", "linear_2"]
    lora.apply(model, LoraSpec(rank=4, alpha=8, vision=True, targetModules=targets), fx.INTERNVL_FOLDER)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # PEFT starts B at zero (A then gets no gradient): random adapters test all
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for part in ("vision_tower.encoder.layer", "multi_modal_projector", "language_model.layers"):
        assert any(part in n for n in trainable), part
    _, packed = _packed(model, batch)
    _, alone = _reference(model, batch.info.num_label_tokens)
    assert set(packed) == set(alone) == trainable
    worst = max(side.rel(packed[n], alone[n]) for n in trainable)
    print(f"internvl fp32 LoRA (both towers): max rel diff of {len(trainable)} adapter grads {worst:.2e}")
    assert worst <= 10 * TOL
